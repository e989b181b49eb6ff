"""``batchserve package --hf DIR``: the command's half that checks its flags and packages."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from service.packaging.spec import check_handler
from service.server.hf_package import hf_version

#: Flags that describe a version by hand: --hf reads all of it from the folder.
_BY_HAND = (
    "spec",
    "artifact",
    "format",
    "architecture",
    "kwargs",
    "input",
    "output",
    "handler",
    "handler_options",
    "file",
)


def package_hf(args: argparse.Namespace, repository: Path) -> int:
    """Package ``args.hf`` as a version of ``args.name``; print its id."""
    if args.hf is None:
        raise ValueError("--max-length goes with --hf (a tokenizer's length); give --hf DIR")
    given = [f"--{flag.replace('_', '-')}" for flag in _BY_HAND if getattr(args, flag) is not None]
    if given:
        raise ValueError(f"--hf reads the version from the folder; leave out {', '.join(given)}")
    if not args.name:
        raise ValueError("missing --name")
    with tempfile.TemporaryDirectory(prefix="batchserve-hf-") as scratch:
        version = hf_version(args.hf, Path(scratch), args.max_length)
        from service.packaging.package import Packager  # imports torch: only when packaging

        manifest = Packager(repository).package(
            name=args.name,
            artifact=version.artifact,
            format="safetensors",
            architecture=version.architecture,
            inputs=version.inputs,
            outputs=version.outputs,
            handler=version.handler,
            files=version.files,
            metadata={**version.metadata, **(args.metadata or {})},
            check_version=check_handler,
        )
    print(manifest.version)
    if version.left_out:
        print(
            f"batchserve: left out of {manifest.label}, as serving never reads them: "
            f"{'; '.join(version.left_out)}",
            file=sys.stderr,
        )
    if version.not_applied:
        print(
            f"batchserve: {manifest.label} generates without generation_config.json's "
            f"{', '.join(version.not_applied)} (beam search and these settings of generate are "
            "not served): its answers are generate's with them unset",
            file=sys.stderr,
        )
    return 0
