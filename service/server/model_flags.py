"""The flags that name a model version, shared by the commands that take one."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from service.errors import ModelNotFoundError
from service.manifest import check_name, check_version

REPOSITORY_HELP = "model repository (default: BATCHSERVE_MODEL_REPOSITORY, else the bundled one)"


def add_repository_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repository", type=Path, default=None, help=REPOSITORY_HELP)


def add_model_flags(parser: argparse.ArgumentParser, version_help: str) -> None:
    """``--model``, ``--version`` (checked as the repository checks them) and ``--repository``."""
    parser.add_argument("--model", required=True, type=_checked(check_name), help="model name")
    parser.add_argument(
        "--version", default="latest", type=_checked(check_version), help=version_help
    )
    add_repository_flag(parser)


def _checked(check: Callable[[str], str]) -> Callable[[str], str]:
    """A flag's parser from one of ``service.manifest``'s checks (its message quotes it)."""

    def parse(text: str) -> str:
        try:
            return check(text)
        except ModelNotFoundError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse
