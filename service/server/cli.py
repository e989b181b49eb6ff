"""``batchserve``: serve a model, package a model version, list and verify the repository."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service.config import Settings, SettingsError, load_settings
from service.errors import ModelIntegrityError, ModelLoadError, ModelNotFoundError
from service.logs import configure_logging
from service.manifest import ARTIFACT_SUFFIXES, Architecture, TensorSpec
from service.repository import ModelRepository
from service.server.devices import count_cuda_devices, engine_devices
from service.server.launcher import clear_configured_multiprocess_dir


def serves_in_one_process(settings: Settings) -> bool:
    """``engine_mode`` as decided: ``auto`` means one process for one worker on one device."""
    if settings.engine_mode != "auto":
        return settings.engine_mode == "in_process"
    return settings.workers == 1 and len(engine_devices(settings.device, count_cuda_devices)) == 1


def serve(settings: Settings, overrides: dict[str, object]) -> int:
    """Serve until SIGTERM/SIGINT, in one process or with a supervisor; the exit status.

    Only the chosen path is imported: the supervisor never imports torch (its engines do).
    """
    if serves_in_one_process(settings):
        from service.server.single import serve as serve_alone

        clear_configured_multiprocess_dir()
        return serve_alone(settings)
    from service.server.supervisor import run_server

    return run_server(settings, overrides)


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per settings field; each overrides its ``BATCHSERVE_*`` variable."""
    for name, field in Settings.model_fields.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            metavar=name.upper(),
            help=f"{field.description or ''} [env BATCHSERVE_{name.upper()}]",
        )


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a shape is comma-separated integers with -1 for the batch axis, got {text!r}"
        ) from None


def _parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


_REPOSITORY_HELP = "model repository (default: BATCHSERVE_MODEL_REPOSITORY, else the bundled one)"


def _repository(args: argparse.Namespace) -> Path:
    """``--repository``, else the configured repository, as ``batchserve serve`` would use."""
    repository: Path = args.repository or load_settings().model_repository
    return repository


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser("serve", help="serve a model over HTTP")
    _add_settings_flags(serve_parser)

    package = commands.add_parser(
        "package", help="add a weights, TorchScript or ExportedProgram file as a new version"
    )
    package.add_argument("--repository", type=Path, default=None, help=_REPOSITORY_HELP)
    package.add_argument("--name", required=True, help="model name (a plain identifier)")
    package.add_argument("--artifact", type=Path, required=True, help="the file to package")
    package.add_argument("--format", required=True, choices=sorted(ARTIFACT_SUFFIXES))
    package.add_argument(
        "--architecture",
        help="module:Class of the nn.Module (needed for safetensors and state_dict)",
    )
    package.add_argument("--kwargs", type=_parse_json_object, default={}, help="JSON object")
    package.add_argument("--input-name", default="input")
    package.add_argument("--input-dtype", default="float32")
    package.add_argument(
        "--input-shape", type=_parse_shape, required=True, help="e.g. -1,8,8 (-1: batch/variable)"
    )
    package.add_argument("--output-name", default="output")
    package.add_argument("--output-dtype", default="float32")
    package.add_argument("--output-shape", type=_parse_shape, required=True, help="e.g. -1,10")
    package.add_argument("--metadata", type=_parse_json_object, default={}, help="JSON object")

    models = commands.add_parser("models", help="list or verify the model repository")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    for name, help_text in (
        ("list", "list models and versions, oldest first"),
        ("verify", "check every file of every version against its SHA-256"),
    ):
        sub = model_commands.add_parser(name, help=help_text)
        sub.add_argument("--repository", type=Path, default=None, help=_REPOSITORY_HELP)
        sub.add_argument("name", nargs="?", help="only this model")
    return parser


def _package(args: argparse.Namespace) -> int:
    architecture = (
        Architecture(import_path=args.architecture, kwargs=args.kwargs)
        if args.architecture
        else None
    )
    from service.engine.model_store import ModelStore  # imports torch: only when packaging

    manifest = ModelStore(_repository(args)).package(
        name=args.name,
        artifact=args.artifact,
        format=args.format,
        architecture=architecture,
        inputs=(TensorSpec(name=args.input_name, dtype=args.input_dtype, shape=args.input_shape),),
        outputs=(
            TensorSpec(name=args.output_name, dtype=args.output_dtype, shape=args.output_shape),
        ),
        metadata=args.metadata,
    )
    print(manifest.version)
    return 0


def _models(args: argparse.Namespace) -> int:
    store = ModelRepository(_repository(args))
    names = [args.name] if args.name else store.model_names()
    failures = 0
    for name in names:
        for manifest in store.versions(name):
            if args.models_command == "list":
                accuracy = manifest.metadata.get("test_accuracy", "")
                print(
                    f"{manifest.name}\t{manifest.version}\t{manifest.created_at.isoformat()}\t"
                    f"{manifest.format}\t{accuracy}"
                )
                continue
            try:
                store.verify(manifest)
                print(f"ok\t{manifest.name}\t{manifest.version}")
            except ModelIntegrityError as error:
                failures += 1
                print(f"FAILED\t{manifest.name}\t{manifest.version}\t{error}")
    return 1 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            overrides = {
                name: getattr(args, name)
                for name in Settings.model_fields
                if getattr(args, name) is not None
            }
            settings = load_settings(**overrides)
            configure_logging(settings.log_level)
            return serve(settings, overrides)
        configure_logging("warning")
        if args.command == "package":
            return _package(args)
        return _models(args)
    except SettingsError as error:
        print(error, file=sys.stderr)
        return 2
    except (ModelNotFoundError, ModelIntegrityError, ModelLoadError, ValueError) as error:
        print(f"batchserve: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
