"""``batchserve serve --workers N``: prepare the metrics folder, then become gunicorn's master.

The launcher replaces itself with gunicorn (``exec``) rather than running it inside: signals
from a container runtime then reach gunicorn directly, and gunicorn's fresh interpreter
imports ``prometheus_client`` only after ``PROMETHEUS_MULTIPROC_DIR`` is set. (The client
chooses between in-memory and file-backed values when it is first imported, and this process
imported it long before it knew how many workers it would start.)
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import NoReturn

from service.config import ENV_PREFIX, Settings
from service.gunicorn_setup import APP_FACTORY, TEMPORARY_METRICS_DIR_ENV
from service.metrics import MULTIPROCESS_DIR_ENV

logger = logging.getLogger(__name__)

GUNICORN_CONFIG = "python:service.gunicorn_conf"


def gunicorn_command() -> list[str]:
    """The command ``batchserve serve --workers N`` becomes (with the settings in the env)."""
    return [sys.executable, "-m", "gunicorn", "--config", GUNICORN_CONFIG, APP_FACTORY]


def settings_environment(overrides: Mapping[str, object]) -> dict[str, str]:
    """Command-line overrides as ``BATCHSERVE_*`` variables, for the workers to read them."""
    return {ENV_PREFIX + name.upper(): str(value) for name, value in overrides.items()}


def clear_multiprocess_dir(directory: Path) -> int:
    """Create ``directory`` if needed and delete the metric files (``*.db``) of earlier runs,
    whose counts would otherwise be added to this run's. Only those files: a mistyped path
    loses nothing else. Returns how many were deleted."""
    directory.mkdir(parents=True, exist_ok=True)
    stale = list(directory.glob("*.db"))
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def prepare_multiprocess_dir(environ: MutableMapping[str, str]) -> Path:
    """Empty the folder ``PROMETHEUS_MULTIPROC_DIR`` names in ``environ``; if none is named,
    create a temporary one, name it there, and mark it for removal when gunicorn exits."""
    configured = environ.get(MULTIPROCESS_DIR_ENV)
    if configured:
        directory = Path(configured)
        clear_multiprocess_dir(directory)
        return directory
    directory = Path(tempfile.mkdtemp(prefix="batchserve-metrics-"))
    environ[MULTIPROCESS_DIR_ENV] = str(directory)
    environ[TEMPORARY_METRICS_DIR_ENV] = str(directory)
    return directory


def exec_gunicorn(settings: Settings, overrides: Mapping[str, object]) -> NoReturn:
    """Replace this process with gunicorn serving ``settings`` in ``settings.workers`` workers.

    ``overrides`` are the settings given as flags; the workers read them from the environment.
    """
    environ = dict(os.environ) | settings_environment(overrides)
    directory = prepare_multiprocess_dir(environ)
    logger.info(
        "starting_gunicorn",
        extra={"workers": settings.workers, "metrics_dir": str(directory)},
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, gunicorn_command(), environ)


def clear_configured_multiprocess_dir() -> None:
    """For one process (``workers`` 1): empty ``PROMETHEUS_MULTIPROC_DIR`` when the environment
    names one (a container image may set it for every start), so stale counts are not added."""
    configured = os.environ.get(MULTIPROCESS_DIR_ENV)
    if configured:
        clear_multiprocess_dir(Path(configured))
