"""``batchserve``: serve a model, package a model version, list and verify the repository,
split a served model's traffic over versions."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from service.config import Settings, SettingsError, load_settings
from service.errors import ModelIntegrityError, ModelLoadError, ModelNotFoundError
from service.logs import configure_logging
from service.manifest import ARTIFACT_SUFFIXES, Architecture, HandlerSpec, TensorSpec
from service.packaging.spec import PackageSpec, check_handler, tensor_spec, unreadable_files
from service.repository import ModelRepository, one_line
from service.server.devices import count_cuda_devices, engine_devices
from service.server.env_file import apply_env_file
from service.server.launcher import clear_configured_multiprocess_dir
from service.server.model_flags import add_repository_flag
from service.server.predict_command import add_predict_parser, run_predict
from service.server.rollout_command import add_rollout_parser, run_rollout
from service.server.traffic_command import add_traffic_parser, run_traffic
from service.server.tune_command import add_tune_parser, run_tune


def serves_in_one_process(settings: Settings) -> bool:
    """``engine_mode`` as decided: ``auto`` means one process for one worker on one device
    with no standby engine."""
    if settings.engine_mode != "auto":
        return settings.engine_mode == "in_process"
    if settings.workers > 1 or settings.standby_engines > 0:
        return False
    return len(engine_devices(settings.device, count_cuda_devices)) == 1


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


class _Once(argparse.Action):
    """A flag that may be given once: a second value is an error, never silently the winner."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        if getattr(namespace, f"_given_{self.dest}", False):
            parser.error(f"{option_string} is given twice; give it once")
        setattr(namespace, f"_given_{self.dest}", True)
        setattr(namespace, self.dest, values)


def _parse_tensor(text: str) -> TensorSpec:
    try:
        return tensor_spec(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(one_line(error)) from None


def _parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


#: The metadata key ``models list`` shows as its accuracy column (docs/models.md).
ACCURACY_KEY = "test_accuracy"


def _repository(args: argparse.Namespace) -> Path:
    """``--repository``, else the configured repository, as ``batchserve serve`` would use."""
    repository: Path = args.repository or load_settings().model_repository
    return repository


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser("serve", help="serve a model over HTTP")
    _add_settings_flags(serve_parser)
    serve_parser.add_argument(
        "--env-file",
        type=Path,
        default=None,
        help="KEY=VALUE lines of BATCHSERVE_* settings (docker run --env-file's format, as "
        "batchserve tune writes); the environment and flags win over it",
    )
    add_tune_parser(commands)
    add_predict_parser(commands)
    add_traffic_parser(commands)
    add_rollout_parser(commands)

    package = commands.add_parser(
        "package",
        help="add a model (weights, TorchScript or ExportedProgram, with its tokenizer, "
        "code and handler) as a new content-addressed version",
        description="Every field of the version can be given as a flag, or in a JSON spec "
        "file (--spec) whose fields the flags override. The version id hashes all of it.",
    )
    add_repository_flag(package)
    package.add_argument(
        "--spec",
        type=Path,
        action=_Once,
        help="JSON file with any of: name, artifact, format, architecture {import_path, "
        "kwargs}, inputs, outputs, handler {import_path, options}, files, metadata (paths "
        "relative to the file)",
    )
    package.add_argument("--name", action=_Once, help="model name (a plain identifier)")
    package.add_argument("--artifact", type=Path, action=_Once, help="the file to package")
    package.add_argument("--format", action=_Once, choices=sorted(ARTIFACT_SUFFIXES))
    package.add_argument(
        "--architecture",
        action=_Once,
        help="module:Class of the nn.Module (safetensors and state_dict); the module may be "
        "a .py file given with --file",
    )
    package.add_argument("--kwargs", type=_parse_json_object, action=_Once, help="JSON object")
    package.add_argument(
        "--input",
        type=_parse_tensor,
        action="append",
        metavar="NAME:DTYPE:SHAPE[:KEY=VALUE...]",
        help="an input tensor, once per input in forward()'s order, e.g. "
        "input_ids:int64:-1,-1:max_length=128:min_value=1:max_value=29999:pad_value=0 "
        "(keys: max_length, min_value, max_value, pad_value, default_value: a request may "
        "leave the input out, filled with it)",
    )
    package.add_argument(
        "--output",
        type=_parse_tensor,
        action="append",
        metavar="NAME:DTYPE:SHAPE[:KEY=VALUE...]",
        help="an output tensor, once per output, e.g. logits:float32:-1,2:labels=neg,pos; "
        "tags:int64:-1,-1:length_of=input_ids answers each instance at its own length (found "
        "by a run of the model when not given)",
    )
    package.add_argument(
        "--handler",
        action=_Once,
        help="module:Class of the pre/post-processing handler (service.frontend.handlers."
        "text:TextHandler, ...image:ImageHandler, ...classification:ClassificationHandler, "
        "or a .py file given with --file)",
    )
    package.add_argument(
        "--handler-options", type=_parse_json_object, action=_Once, help="JSON object"
    )
    package.add_argument(
        "--file",
        type=Path,
        action="append",
        help="a file packaged and hashed with the version (tokenizer.json, a .py module); "
        "repeat for several",
    )
    package.add_argument("--metadata", type=_parse_json_object, action=_Once, help="JSON object")
    package.add_argument(
        "--hf",
        type=Path,
        action=_Once,
        metavar="DIR",
        help="a folder written by transformers' save_pretrained (config.json, model.safetensors, "
        "tokenizer.json or preprocessor_config.json): the task, labels, inputs and handler come "
        "from it (needs the hf extra); only --name, --metadata and --max-length go with it",
    )
    package.add_argument(
        "--max-length",
        type=int,
        action=_Once,
        help="with --hf: the most tokens a text may have (default: what the tokenizer and the "
        "model's position embeddings both hold)",
    )

    export = commands.add_parser(
        "export",
        help="convert a version to torchscript, exported_program, aoti or onnx: a new version "
        "recording its source, settings and the parity measured against it; served when "
        "named by its id (never 'latest')",
    )
    add_repository_flag(export)
    export.add_argument("--model", required=True, action=_Once, help="model name")
    export.add_argument(
        "--version",
        default="latest",
        action=_Once,
        help="version (default: latest, the newest packaged version)",
    )
    export.add_argument(
        "--to",
        required=True,
        action=_Once,
        choices=["torchscript", "exported_program", "aoti", "onnx"],
        help="the format to export to",
    )

    models = commands.add_parser("models", help="list or verify the model repository")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    for name, help_text in (
        ("list", "list models and versions, oldest first"),
        ("verify", "check every file of every version against its SHA-256"),
    ):
        sub = model_commands.add_parser(name, help=help_text)
        add_repository_flag(sub)
        sub.add_argument("name", nargs="?", help="only this model")
    return parser


def _package(args: argparse.Namespace) -> int:
    if args.hf is not None or args.max_length is not None:
        from service.server.hf_cli import package_hf

        return package_hf(args, _repository(args))
    spec = PackageSpec.from_file(args.spec) if args.spec else PackageSpec()
    spec = spec.overridden(
        name=args.name,
        artifact=args.artifact,
        format=args.format,
        architecture=(
            Architecture(import_path=args.architecture, kwargs=args.kwargs or {})
            if args.architecture
            else None
        ),
        inputs=tuple(args.input) if args.input else None,
        outputs=tuple(args.output) if args.output else None,
        handler=(
            HandlerSpec(import_path=args.handler, options=args.handler_options or {})
            if args.handler
            else None
        ),
        files=tuple(args.file) if args.file else None,
        metadata=args.metadata,
    )
    from service.packaging.package import Packager  # imports torch: only when packaging

    name, artifact, format = spec.required()
    problems = unreadable_files(artifact, spec.files or ())
    if problems:
        print(f"batchserve: cannot package: {'; '.join(problems)}", file=sys.stderr)
        return 2
    try:
        packaged = Packager(_repository(args)).package_version(
            name=name,
            artifact=artifact,
            format=format,
            architecture=spec.architecture,
            inputs=spec.inputs or (),
            outputs=spec.outputs or (),
            handler=spec.handler,
            files=spec.files or (),
            metadata=spec.metadata,
            check_version=check_handler,
        )
    except OSError as error:  # unreadable, or gone since the check
        print(f"batchserve: cannot package: {error.filename}: {error.strerror}", file=sys.stderr)
        return 2
    print(packaged.manifest.version)
    if packaged.repaired:
        print(
            f"batchserve: {packaged.manifest.label} was there with {', '.join(packaged.repaired)} "
            "damaged or missing; replaced from the files given (they hash to its id)",
            file=sys.stderr,
        )
    return 0


def _export(args: argparse.Namespace) -> int:
    from service.engine.model_store import ModelStore  # imports torch
    from service.packaging.export import ExportError, export_version

    try:
        manifest = export_version(ModelStore(_repository(args)), args.model, args.version, args.to)
    except ExportError as error:
        print(f"batchserve: {error}", file=sys.stderr)
        return 1
    parity = manifest.metadata["parity"]
    print(manifest.version)
    print(
        f"{manifest.label} ({manifest.format}): max abs diff {parity['max_abs_diff']}, "
        f"max rel diff {parity['max_rel_diff']} over {parity['samples']} samples; not "
        f"'latest' (an export is served by its id: BATCHSERVE_MODEL_VERSION={manifest.version})",
        file=sys.stderr,
    )
    return 0


def _models(args: argparse.Namespace) -> int:
    store = ModelRepository(_repository(args))
    names = [args.name] if args.name else store.model_names()
    failures = 0
    for name in names:
        if args.models_command == "list":
            latest = _latest_version(store, name)
            for manifest in store.versions(name):
                accuracy = manifest.metadata.get(ACCURACY_KEY, "")
                parity = manifest.metadata.get("parity")
                exported = (
                    f"\tfrom {manifest.metadata.get('exported_from')}, max abs diff "
                    f"{parity['max_abs_diff']}"
                    if isinstance(parity, dict)
                    else ""
                )
                print(
                    f"{manifest.name}\t{manifest.version}\t{manifest.created_at.isoformat()}\t"
                    f"{manifest.format}\t{accuracy}{exported}"
                    + ("\tlatest" if manifest.version == latest else "")
                )
            continue
        for version in store.version_ids(name):
            try:
                store.verify(store.read_manifest(name, version))
                print(f"ok\t{name}\t{version}")
            except ModelIntegrityError as error:
                failures += 1
                print(f"FAILED\t{name}\t{version}\t{error}")
    return 1 if failures else 0


def _latest_version(store: ModelRepository, name: str) -> str | None:
    """The version ``latest`` names (the newest packaged one), if any."""
    try:
        return store.resolve(name).version
    except ModelNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            overrides = {
                name: getattr(args, name)
                for name in Settings.model_fields
                if getattr(args, name) is not None
            }
            if args.env_file is not None:
                apply_env_file(args.env_file, flags=overrides)
            settings = load_settings(**overrides)
            configure_logging(settings.log_level, settings.library_log_level)
            return serve(settings, overrides)
        configure_logging("warning")
        if args.command == "package":
            return _package(args)
        if args.command == "export":
            return _export(args)
        if args.command == "tune":
            return run_tune(args)
        if args.command == "predict":
            return run_predict(args)
        if args.command == "traffic":
            return run_traffic(args)
        if args.command == "rollout":
            return run_rollout(args)
        return _models(args)
    except SettingsError as error:
        print(error, file=sys.stderr)
        return 2
    except ValidationError as error:
        print(f"batchserve: {one_line(error, 2000)}", file=sys.stderr)
        return 1
    except (ModelNotFoundError, ModelIntegrityError, ModelLoadError, ValueError) as error:
        print(f"batchserve: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
