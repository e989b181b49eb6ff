"""What gunicorn needs to run the front ends: options, hooks and the app factory.

``gunicorn_conf.py`` turns these into gunicorn's configuration; nothing here runs on import.
gunicorn's master loads the worker class, so everything it imports stays free of torch: the
master and the front ends are small processes, and the engines hold the model.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from prometheus_client import multiprocess

from service.config import SHUTDOWN_MARGIN_S, Settings
from service.logs import logger_levels
from service.metrics import MULTIPROCESS_DIR_ENV

logger = logging.getLogger(__name__)

APP_FACTORY = "service.server.frontend_process:create_app_from_environment()"
WORKER_CLASS = "service.server.gunicorn_worker.BatchserveWorker"


def bind_address(host: str, port: int) -> str:
    """gunicorn's ``bind`` for a host and port; IPv6 addresses need brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def graceful_timeout_s(settings: Settings) -> int:
    """How long gunicorn's master waits after SIGTERM before it kills workers: the drain delay
    (readiness off, still serving), then the worker's own shutdown, then a margin to exit."""
    return math.ceil(settings.drain_delay_s) + settings.shutdown_grace_s + SHUTDOWN_MARGIN_S


def logging_config(level: str, library_level: str) -> dict[str, Any]:
    """``logging.config.dictConfig`` settings giving the same JSON lines on stdout as
    ``logs.configure_logging``, for gunicorn's, uvicorn's, the service's and libraries'
    records, each logger at its level (``logs.logger_levels``).

    uvicorn's loggers write through the root's handler; ``gunicorn.error`` has it itself and
    does not propagate. gunicorn's access log is off: the front ends write their own
    (``access_log``), as one process does.
    """
    level_name = level.upper()
    levels = logger_levels(level, library_level)
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
        "root": {"level": levels.pop(""), "handlers": ["stdout"]},
        "loggers": {
            **{name: {"level": name_level} for name, name_level in levels.items()},
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
        # Each front end listens on a socket of its own (SO_REUSEPORT) and the kernel spreads
        # new connections over them evenly. With one shared socket the front end that happened
        # to be waiting in accept() took most of a burst of connections: measured at c=64 with
        # 2 front ends, one did 85 % of the work while the other idled.
        "reuse_port": True,
        "graceful_timeout": graceful_timeout_s(settings),
        # A front end holds no model, but recycling would still drop its keep-alive clients.
        "max_requests": 0,
        # gunicorn >= 25 would otherwise open a control socket under $HOME, shared by every
        # instance of the same user (and failing on a read-only home in a container).
        "control_socket_disable": True,
        "proc_name": "batchserve-frontend",
        "loglevel": settings.log_level,
        "logconfig_dict": logging_config(settings.log_level, settings.library_log_level),
        "child_exit": forget_dead_worker_gauges,
    }


def require_multiprocess_dir() -> None:
    """Refuse to start front ends without a metrics folder: each process's counters would then
    be scraped alone, and every scrape would show a different process's numbers."""
    directory = os.environ.get(MULTIPROCESS_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        raise RuntimeError(
            f"{MULTIPROCESS_DIR_ENV} must name an existing, empty folder before gunicorn starts "
            f"(got {directory!r}); `batchserve serve --workers N` prepares it for you"
        )


def forget_dead_worker_gauges(server: Any, worker: Any) -> None:
    """``child_exit`` (master): drop a dead worker's ``live*`` gauges from the aggregate, so
    that, say, its in-flight count or readiness no longer counts. Its counters stay summed."""
    try:
        multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]
    except FileNotFoundError:
        # Its files are gone already (a replaced worker's, removed on a previous exit): the
        # master must not crash on its way down over it.
        logger.info("dead_worker_gauges_already_removed", extra={"pid": worker.pid})
