"""A spare engine interpreter: ``python -m service.engine.spare --ready-fd N``.

Torch and the engine take seconds to import, far longer than loading a small model, so the
supervisor keeps one spare per host (``server/spare_engine.py``) for the next engine it must
start. The spare imports what an engine needs, writes ``ready`` to file descriptor N, then
reads one JSON line on stdin (the engine's variables: ``service/processes.py``) and becomes
that engine in the same process, writing ``taken`` once its heartbeat beats: the supervisor
hands it the engine's place only then (a stopped spare never answers). An end of input: exit
0. Until then it touches no device (CUDA starts once it knows its device), writes no
heartbeat or metric, and answers no front end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import sys

import orjson

from service.config import load_settings
from service.engine import process
from service.processes import SPARE_READY, SPARE_TAKEN
from service.repository import ModelRepository

#: The engine itself (torch, the batcher, the bridge): what ``process.py`` imports once its
#: heartbeat beats, imported here before the spare is ready.
ENGINE_MODULE = "service.engine.serving"
#: The module whose models are ``transformers`` classes: loading one imports its heavy part.
_TRANSFORMERS_MODELS = "service.engine.hf_model"


def backend_modules(formats_and_paths: list[tuple[str, str | None]]) -> list[str]:
    """The modules that loading models of these (format, architecture import path) imports
    beyond the engine's own: ONNX Runtime for ``onnx``, transformers for a transformers model,
    the architecture's module when it is part of the installed service (a model's bundled code
    is read from its folder at load, not imported here)."""
    modules: list[str] = []
    for model_format, import_path in formats_and_paths:
        if model_format == "onnx":
            modules.append("onnxruntime")
        module = import_path.split(":", 1)[0] if import_path else None
        if module == _TRANSFORMERS_MODELS:
            modules.append("transformers.modeling_utils")
        if module is not None and module.startswith("service."):
            modules.append(module)
    return list(dict.fromkeys(modules))


def _served_backends() -> list[str]:
    """What the served models' manifests need (``backend_modules``); none when the settings or
    a manifest cannot be read: the engine reports that when it loads."""
    try:
        settings = load_settings()
        repository = ModelRepository(settings.model_repository)
        manifests = [
            repository.resolve(name, version) for name, version in settings.served_models()
        ]
    except Exception:  # the engine's own load reports it, with its reason
        return []
    return backend_modules(
        [(m.format, m.architecture.import_path if m.architecture else None) for m in manifests]
    )


def engine_variables(line: bytes) -> dict[str, str]:
    """The engine's variables from the supervisor's line; ValueError when it is not a JSON
    object of strings."""
    variables = orjson.loads(line)
    if not isinstance(variables, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in variables.items()
    ):
        raise ValueError(f"expected a JSON object of strings, got {line[:200]!r}")
    return variables


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ready-fd", type=int, required=True)
    arguments = parser.parse_args()
    importlib.import_module(ENGINE_MODULE)
    for module in _served_backends():
        with contextlib.suppress(Exception):  # the engine reports a missing backend on load
            importlib.import_module(module)
    # What the imports made lives as long as the process (as in serving.run_engine).
    gc.collect()
    gc.freeze()
    ready_fd = arguments.ready_fd
    _tell(ready_fd, SPARE_READY)
    try:
        line = sys.stdin.buffer.readline()
    except KeyboardInterrupt:
        return 0
    if not line.strip():
        return 0
    os.environ.update(engine_variables(line))
    # The engine reads nothing on stdin: give it what a fresh engine would have, not the pipe.
    with open(os.devnull, "rb") as nothing:
        os.dup2(nothing.fileno(), sys.stdin.fileno())

    def taken() -> None:
        _tell(ready_fd, SPARE_TAKEN)
        os.close(ready_fd)

    return process.main(beating=taken)


def _tell(ready_fd: int, message: bytes) -> None:
    """Write ``message`` on the ready pipe; the supervisor may have stopped reading it."""
    with contextlib.suppress(BrokenPipeError):
        os.write(ready_fd, message)


if __name__ == "__main__":
    sys.exit(main())
