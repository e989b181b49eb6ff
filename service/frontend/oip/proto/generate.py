"""Regenerate the Python code of ``grpc_predict_v2.proto`` (needs ``grpcio-tools``, a
development dependency; the generated files are committed so serving never needs it)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc


def main() -> int:
    here = Path(__file__).parent
    root = here.parents[3]  # the repository: imports are service.frontend.oip.proto....
    status: int = protoc.main(
        [
            "grpc_tools.protoc",
            f"--proto_path={root}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            str((here / "grpc_predict_v2.proto").relative_to(root)),
        ]
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
