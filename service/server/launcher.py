"""The environment a server with several processes starts in: settings and the metrics folder.

Settings given as flags become ``BATCHSERVE_*`` variables, so every process reads the same.
``PROMETHEUS_MULTIPROC_DIR`` is prepared before any process that counts is started: the
client chooses between in-memory and file-backed values when it is first imported.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from service.config import ENV_PREFIX
from service.metrics import MULTIPROCESS_DIR_ENV


def settings_environment(overrides: Mapping[str, object]) -> dict[str, str]:
    """Command-line overrides as ``BATCHSERVE_*`` variables, for every process to read them
    (a list as its items joined by commas, as ``models`` is written)."""
    return {
        ENV_PREFIX + name.upper(): (
            ",".join(map(str, value)) if isinstance(value, tuple | list) else str(value)
        )
        for name, value in overrides.items()
    }


def clear_multiprocess_dir(directory: Path) -> int:
    """Create ``directory`` if needed and delete the metric files (``*.db``) of earlier runs,
    whose counts would otherwise be added to this run's. Only those files: a mistyped path
    loses nothing else. Returns how many were deleted."""
    directory.mkdir(parents=True, exist_ok=True)
    stale = list(directory.glob("*.db"))
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def prepare_multiprocess_dir(environ: MutableMapping[str, str]) -> tuple[Path, bool]:
    """Empty the folder ``PROMETHEUS_MULTIPROC_DIR`` names in ``environ``; if none is named,
    create a temporary one and name it there. Returns the folder and whether it is temporary
    (to be removed when the server exits)."""
    configured = environ.get(MULTIPROCESS_DIR_ENV)
    if configured:
        directory = Path(configured)
        clear_multiprocess_dir(directory)
        return directory, False
    directory = Path(tempfile.mkdtemp(prefix="batchserve-metrics-"))
    environ[MULTIPROCESS_DIR_ENV] = str(directory)
    return directory, True


def clear_configured_multiprocess_dir() -> None:
    """For one process serving alone: empty ``PROMETHEUS_MULTIPROC_DIR`` when the environment
    names one (a container image may set it for every start), so stale counts are not added."""
    configured = os.environ.get(MULTIPROCESS_DIR_ENV)
    if configured:
        clear_multiprocess_dir(Path(configured))
