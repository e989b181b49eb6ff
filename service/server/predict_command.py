"""``batchserve predict``'s flags and its run: a file of inputs answered by an engine process
of its own (``service.server.predicting``, whose run is imported only when ``predict`` runs),
as ``batchserve serve --workers N`` runs it.
The exit statuses are in the command's description; after a failure the output's complete
lines are kept, and ``--resume`` continues it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

from service.config import ENV_PREFIX, load_settings
from service.errors import ServiceError
from service.processes import EXIT_STALLED
from service.repository import ModelRepository
from service.server.model_flags import add_model_flags
from service.server.predicting.output_file import OutputFile, OutputFileError
from service.server.predicting.progress import Progress
from service.server.predicting.sources import (
    INPUT_FORMATS,
    InputFileError,
    input_format,
    open_source,
)

EXIT_ROWS_FAILED = 3
EXIT_UNUSABLE_FILE = 2
EXIT_INTERRUPTED = 130


def add_predict_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    predict = commands.add_parser(
        "predict",
        help="answer a file of inputs with a model, no HTTP: one JSON line per row, in input order",
        description="Runs the model as `batchserve serve` does (the same engine, in a process "
        "of its own, batcher, handler and validation, BATCHSERVE_* settings from the "
        "environment) over the rows "
        "of a file, and writes one JSON line per row: {row, model, version, prediction}, the "
        "prediction being what /predict answers that instance, or {row, model, version, "
        "error: {status, code, message}} for a row /predict would refuse. Input formats: "
        "jsonl (a /predict instance per line), txt (a text per line, for text handlers), npy "
        "(rows along axis 0), npz (an array per input name), parquet (a column per input "
        "name, or one column; needs the batch extra). Exit status: 0 when every row was "
        "answered, 3 when some failed, 2 when a file cannot be used, 1 when the model cannot "
        "be served or its engine process was lost, 70 when it hangs (stall_timeout_s), 130 "
        "when interrupted.",
    )
    add_model_flags(predict, "version (default: latest, the newest packaged one)")
    predict.add_argument("--input", type=Path, required=True, help="the file of inputs")
    predict.add_argument(
        "--input-format",
        choices=INPUT_FORMATS,
        default=None,
        help="the input's format (default: from its suffix: .jsonl or .ndjson, .txt, .npy, "
        ".npz, .parquet)",
    )
    predict.add_argument(
        "--output", type=Path, required=True, help="the JSON Lines file to write (new)"
    )
    predict.add_argument(
        "--resume",
        action="store_true",
        help="continue an output a stopped run left: its complete lines are kept (checked to "
        "be the first rows, by the same model and version), the rest is appended",
    )
    predict.add_argument(
        "--allow-errors",
        action="store_true",
        help="exit 0 even when some rows failed (their error records are in the output)",
    )


def file_defaults(environ: Mapping[str, str]) -> dict[str, object]:
    """The settings ``predict`` changes from the server's, unless ``environ`` sets them: the
    engine logs warnings only (its progress is not the command's), and a partial batch never
    waits for batch-mates (``max_wait_ms`` 0): the rows come a chunk of many batches at a time,
    so those batch-mates are queued already, or not coming (the file's last rows)."""
    defaults: dict[str, object] = {"log_level": "warning", "max_wait_ms": 0.0}
    return {
        name: value for name, value in defaults.items() if ENV_PREFIX + name.upper() not in environ
    }


def run_predict(args: argparse.Namespace) -> int:
    """Answer ``--input`` into ``--output``; the exit status (the command's description). The
    model, the files and a resumed output are checked before the engine process starts."""
    overrides: dict[str, object] = {"model_name": args.model, "models": ()}
    overrides |= file_defaults(os.environ)
    if args.repository is not None:
        overrides["model_repository"] = args.repository.resolve()
    settings = load_settings(**overrides)
    manifest = ModelRepository(settings.model_repository).resolve(args.model, args.version)
    overrides["model_version"] = manifest.version
    settings = load_settings(**overrides)
    with ExitStack() as resources:
        try:
            format = input_format(args.input, args.input_format)
            source = open_source(args.input, format, manifest, resources)
            output = OutputFile(
                args.output, resume=args.resume, model=manifest.name, version=manifest.version
            )
            resources.callback(output.close)
        except (InputFileError, OutputFileError) as error:
            return _say(str(error), EXIT_UNUSABLE_FILE)
        if output.tally.rows > source.rows:
            return _say(
                f"{args.output} holds {output.tally.rows} rows, more than the {source.rows} of "
                f"{args.input}: it is not this input's output",
                EXIT_UNUSABLE_FILE,
            )
        progress = Progress(source.rows, output.tally.rows, sys.stderr)
        # Imported only now: the front end's modules they bring take a tenth of a second,
        # which every other command would pay at start-up.
        from service.server.predicting.engine_process import EngineExitedError
        from service.server.predicting.run import ModelStalledError, predict_file

        def kept() -> str:
            return f"; {output.tally.rows:,} rows in {args.output}, resume with --resume"

        summary = None
        try:
            summary = asyncio.run(
                predict_file(settings, overrides, source, format, output, progress)
            )
        except InputFileError as error:
            return _say(f"{error}{kept()}", EXIT_UNUSABLE_FILE)
        except ServiceError as error:  # the version's handler cannot be loaded
            return _say(error.message, 1)
        except ModelStalledError as error:
            return _say(f"{error}{kept()}", EXIT_STALLED)
        except EngineExitedError as error:
            return _say(f"{error}{kept()}", 1)
        except KeyboardInterrupt:
            return _say(f"interrupted{kept()}", EXIT_INTERRUPTED)
        finally:
            progress.finish()
            if summary is None:
                output.discard_if_unused()
    tally = output.tally
    rate = summary.rows_written / summary.seconds if summary.seconds > 0 else 0.0
    kept_before = f" ({output.resumed_rows:,} kept from before)" if output.resumed_rows else ""
    print(
        f"batchserve predict: {summary.model} answered {summary.rows_written:,} rows in "
        f"{summary.seconds:.2f} s ({rate:,.0f} rows/s); {args.output} holds {tally.rows:,} "
        f"rows{kept_before}: {tally.rows - tally.failed:,} ok, {tally.failed:,} failed",
        file=sys.stderr,
    )
    for row, message in tally.first_failed:
        print(f"  row {row}: {message}", file=sys.stderr)
    if tally.failed and not args.allow_errors:
        return EXIT_ROWS_FAILED
    return 0


def _say(message: str, status: int) -> int:
    print(f"batchserve predict: {message}", file=sys.stderr)
    return status
