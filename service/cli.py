"""``batchserve``: serve a model, package a model version, list and verify the repository."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from service.config import Settings, SettingsError, load_settings
from service.errors import ModelIntegrityError, ModelLoadError, ModelNotFoundError
from service.launcher import clear_configured_multiprocess_dir, exec_gunicorn
from service.logs import configure_logging
from service.model_store import (
    ARTIFACT_SUFFIXES,
    Architecture,
    ModelStore,
    TensorSpec,
)
from service.state import ServiceState

#: Exit status when the model hung (a batch outlived ``stall_timeout_s``): EX_SOFTWARE.
EXIT_STALLED = 70


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM first turns readiness off for ``drain_delay_s`` while serving on.

    Then uvicorn's graceful shutdown closes the listening socket, waits for every request in
    flight, and runs the app's shutdown (which drains the batcher). The process exits 0 after a
    clean drain instead of re-raising the signal.
    """

    def __init__(self, config: uvicorn.Config, service: ServiceState, drain_delay_s: float):
        super().__init__(config)
        self._service = service
        self._drain_delay_s = drain_delay_s
        self._exit_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM or SIGINT (or the gunicorn worker, when its master is gone).

        As a signal handler this runs between two bytecodes of the main thread, which may be
        holding a lock just then: under gunicorn prometheus_client has one lock for every
        metric, taken on each request. So it only sets attributes and leaves the rest to the
        event loop; setting a metric here froze a worker under load until it was killed.
        """
        if self._exit_requested:
            # A second signal: stop waiting out the delay; a second Ctrl-C exits at once.
            self.force_exit = sig == signal.SIGINT and self.should_exit
            self.should_exit = True
            return
        self._exit_requested = True
        self._service.draining = True  # /readyz answers 503 from now on
        if self._loop is None or self._drain_delay_s <= 0:
            self.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        """On the event loop: readiness off in the metrics; stop accepting after the delay."""
        self._service.metrics.ready.set(0)
        if not self.should_exit and self._loop is not None:
            self._loop.call_later(self._drain_delay_s, self.stop)

    def stop(self) -> None:
        self.should_exit = True


def serve(settings: Settings) -> int:
    """Run one uvicorn process until SIGTERM/SIGINT; exit status 1 if the model fails to load."""
    from service.app import create_app  # imports torch: only when serving

    server: DrainingServer | None = None

    def stop_serving() -> None:
        if server is not None:
            server.stop()

    app = create_app(settings, on_load_failure=stop_serving, on_stall=stop_serving)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        server_header=False,
        # Long enough for every queued request to meet its deadline.
        timeout_graceful_shutdown=int(settings.request_timeout_ms / 1000) + 5,
    )
    server = DrainingServer(config, app.state.service, settings.drain_delay_s)
    server.run()
    if app.state.service.stalled:
        # The device thread is stuck inside the model and would block interpreter exit: leave
        # at once with a distinct status so the supervisor (Kubernetes, systemd) restarts us.
        logging.getLogger(__name__).error("exiting_with_stalled_model")
        logging.shutdown()
        os._exit(EXIT_STALLED)
    return 1 if app.state.service.load_error is not None else 0


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
    store = ModelStore(_repository(args))
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
            if settings.workers > 1:
                exec_gunicorn(settings, overrides)
            clear_configured_multiprocess_dir()
            return serve(settings)
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
