"""What gunicorn needs for ``batchserve serve --workers N``: options, hooks, the app factory.

``gunicorn_conf.py`` turns these into gunicorn's configuration; nothing here runs on import.
The hooks run in gunicorn's master (``on_starting``, ``pre_fork``, ``child_exit``,
``on_exit``) or in a new worker before it builds its app (``post_fork``).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from prometheus_client import multiprocess

from service.config import ENV_PREFIX, Settings, load_settings
from service.metrics import MULTIPROCESS_DIR_ENV
from service.version_sync import VERSION_DIR_ENV
from service.worker_devices import chooses_gpu, device_for_worker, lowest_free_slot

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)

APP_FACTORY = "service.gunicorn_setup:create_app_from_environment()"
WORKER_CLASS = "service.gunicorn_worker.BatchserveWorker"
#: Set by the launcher to the metrics folder it created, so that ``on_exit`` removes only that.
TEMPORARY_METRICS_DIR_ENV = "_BATCHSERVE_TEMPORARY_METRICS_DIR"
DEVICE_ENV = ENV_PREFIX + "DEVICE"
_SLOT_ATTRIBUTE = "batchserve_slot"


def create_app_from_environment() -> FastAPI:
    """The app of one worker, from the ``BATCHSERVE_*`` variables; gunicorn calls it after fork,
    so every worker builds its own model, runner and batcher (nothing is shared or global)."""
    from service.app import create_app  # imports torch: in the worker, never in the master

    return create_app(load_settings())


def bind_address(host: str, port: int) -> str:
    """gunicorn's ``bind`` for a host and port; IPv6 addresses need brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def worker_shutdown_s(settings: Settings) -> int:
    """How long a worker's uvicorn waits for requests in flight after it stops accepting: the
    longest a queued request can still take (its deadline), plus a margin, as ``batchserve
    serve`` does with one process."""
    return math.ceil(settings.request_timeout_ms / 1000) + 5


def graceful_timeout_s(settings: Settings) -> int:
    """How long gunicorn's master waits after SIGTERM before it kills workers: the drain delay
    (readiness off, still serving), then the worker's own shutdown, then a margin to exit."""
    return math.ceil(settings.drain_delay_s) + worker_shutdown_s(settings) + 5


def logging_config(level: str) -> dict[str, Any]:
    """``logging.config.dictConfig`` settings giving the same JSON lines on stdout as
    ``logs.configure_logging``, for gunicorn's, uvicorn's and the service's records.

    ``gunicorn.error`` gets the handler itself (not through the root) because the uvicorn
    worker copies that logger's handlers onto ``uvicorn.error``. No access log, as with one
    process.
    """
    level_name = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "service.logs.JsonFormatter"}},
        "handlers": {
            "stdout": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stdout",
            }
        },
        "root": {"level": level_name, "handlers": ["stdout"]},
        "loggers": {
            "gunicorn.error": {"level": level_name, "handlers": ["stdout"], "propagate": False},
            "gunicorn.access": {"level": level_name, "handlers": [], "propagate": False},
        },
    }


def gunicorn_options(settings: Settings) -> dict[str, Any]:
    """gunicorn settings, by gunicorn's names, for ``settings``."""
    return {
        "wsgi_app": APP_FACTORY,
        "bind": [bind_address(settings.host, settings.port)],
        "workers": settings.workers,
        "worker_class": WORKER_CLASS,
        "graceful_timeout": graceful_timeout_s(settings),
        # Recycling workers would reload the model each time; off unless asked for.
        "max_requests": 0,
        # uvicorn's default; gunicorn's 2 s is shorter than most load balancers' idle timeout.
        "keepalive": 5,
        # gunicorn >= 25 would otherwise open a control socket under $HOME, shared by every
        # instance of the same user (and failing on a read-only home in a container).
        "control_socket_disable": True,
        "proc_name": "batchserve",
        "loglevel": settings.log_level,
        "logconfig_dict": logging_config(settings.log_level),
        "pre_fork": give_worker_a_slot,
        "post_fork": choose_worker_device,
        "child_exit": forget_dead_worker_gauges,
        "on_starting": create_version_dir,
        "on_exit": remove_run_folders,
    }


def require_multiprocess_dir() -> None:
    """Refuse to start several workers without a metrics folder: each worker's counters would
    then be scraped alone, and every scrape would show a different worker's numbers."""
    directory = os.environ.get(MULTIPROCESS_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        raise RuntimeError(
            f"{MULTIPROCESS_DIR_ENV} must name an existing, empty folder before gunicorn starts "
            f"(got {directory!r}); `batchserve serve --workers N` prepares it for you"
        )


def give_worker_a_slot(server: Any, worker: Any) -> None:
    """``pre_fork`` (master): the new worker takes the lowest slot no live worker holds."""
    taken = (getattr(live, _SLOT_ATTRIBUTE, -1) for live in server.WORKERS.values())
    setattr(worker, _SLOT_ATTRIBUTE, lowest_free_slot(taken))


def choose_worker_device(server: Any, worker: Any) -> None:
    """``post_fork`` (the new worker, before its app is built): pin its GPU by its slot.

    Counting GPUs initialises CUDA, so it happens here in the worker and never in the master,
    whose later forks would inherit a CUDA context they cannot use.
    """
    slot: int = getattr(worker, _SLOT_ATTRIBUTE)
    configured = load_settings().device
    if not chooses_gpu(configured):
        return
    import torch  # only a worker that may take a GPU pays for importing torch here

    device = device_for_worker(configured, slot, torch.cuda.device_count())
    os.environ[DEVICE_ENV] = device
    logger.info("worker_device", extra={"slot": slot, "device": device, "pid": os.getpid()})


def forget_dead_worker_gauges(server: Any, worker: Any) -> None:
    """``child_exit`` (master): drop a dead worker's ``live*`` gauges from the aggregate, so
    that, say, its in-flight count or readiness no longer counts. Its counters stay summed."""
    try:
        multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]
    except FileNotFoundError:
        # Its files are gone already (a replaced worker's, removed on a previous exit): the
        # master must not crash on its way down over it.
        logger.info("dead_worker_gauges_already_removed", extra={"pid": worker.pid})


def create_version_dir(server: Any) -> None:
    """``on_starting`` (master, before any worker): the folder in which a worker that switched
    versions publishes it for the others (``version_sync.py``); workers inherit its name."""
    os.environ[VERSION_DIR_ENV] = tempfile.mkdtemp(prefix="batchserve-versions-")


def remove_run_folders(server: Any) -> None:
    """``on_exit`` (master): remove the published-version folder, and the metrics folder if
    the launcher created it for this run (one named by the operator, such as a Kubernetes
    emptyDir, is left as it is)."""
    versions = os.environ.pop(VERSION_DIR_ENV, None)
    if versions:
        shutil.rmtree(versions, ignore_errors=True)
    temporary = os.environ.get(TEMPORARY_METRICS_DIR_ENV)
    if temporary and temporary == os.environ.get(MULTIPROCESS_DIR_ENV):
        shutil.rmtree(temporary, ignore_errors=True)
