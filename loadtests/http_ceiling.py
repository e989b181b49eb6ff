"""The HTTP ceiling: batchserve's own HTTP stack answering ``/predict`` without running a model.

This process runs the real server (``service.cli.serve``: same app, middleware, request-id
and metrics handling, body reading, parsing and validation against the model's input spec,
JSON or ``.npy`` encoding, same uvicorn options), except that ``DynamicBatcher.submit`` is
replaced, in this process only, by one that answers at once with zero rows: nothing is
queued, batched or computed. The model is still loaded (fp32, not compiled, warmed at batch
size 1 only) because readiness waits for it, but it never runs on a request. No server can
answer faster than this on the same machine, whatever its batching.

    BATCHSERVE_MODEL_NAME=digits python -m loadtests.http_ceiling --port 8098

Patching the class, rather than building a stand-in app, keeps this in step with the service
as its modules change.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from service.batching import DynamicBatcher
from service.cli import serve
from service.config import load_settings
from service.logs import configure_logging
from service.model_store import ModelStore


def answer_with_zeros(row_shape: tuple[int, ...]) -> None:
    """Make every ``DynamicBatcher`` in this process answer ``submit`` at once with zeros."""

    async def submit(self: DynamicBatcher[Any, Any], payload: Any, **_: Any) -> list[Any]:
        return [np.zeros((len(payload), *row_shape), dtype=np.float32)]

    DynamicBatcher.submit = submit  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    # Compilation and precision change only the (unused) forward pass; skip their start-up.
    settings = load_settings(
        host=args.host,
        port=args.port,
        compile_mode="off",
        precision="fp32",
        warmup_batch_sizes=(1,),
    )
    manifest = ModelStore(settings.model_repository).resolve(
        settings.model_name, settings.model_version
    )
    answer_with_zeros(tuple(max(size, 1) for size in manifest.output.instance_shape))
    configure_logging(settings.log_level)
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
