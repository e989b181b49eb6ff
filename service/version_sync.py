"""One model version for every worker of a gunicorn server.

An admin switch (``/admin/.../load`` or ``/admin/rollback``) is answered by whichever worker
took the connection. That worker publishes the version it now serves in a file of a folder the
gunicorn master creates for this run (``VERSION_DIR_ENV``); every worker looks at the file once
a second (its housekeeping) and switches too, verifying the hashes itself, and a worker started
later, such as the replacement for one that died, loads the published version instead of
``model_name``/``model_version``. A single process (``--workers 1``) has no such folder and
publishes nothing.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import orjson

logger = logging.getLogger(__name__)

#: Set by the gunicorn master (``on_starting``) for its workers; removed with the folder on exit.
VERSION_DIR_ENV = "_BATCHSERVE_VERSION_DIR"
VERSION_FILE = "serving.json"


@dataclass(frozen=True)
class PublishedVersion:
    name: str
    version: str
    previous: tuple[str, str] | None = None
    """(name, version) served before the switch: what a worker started later rolls back to."""


def version_file() -> Path | None:
    """The published-version file of this gunicorn run, or None outside gunicorn."""
    directory = os.environ.get(VERSION_DIR_ENV)
    return Path(directory) / VERSION_FILE if directory else None


def publish(published: PublishedVersion) -> None:
    """Tell the other workers what to serve (atomically: write, then rename)."""
    path = version_file()
    if path is None:
        return
    document = {
        "name": published.name,
        "version": published.version,
        "previous": list(published.previous) if published.previous else None,
    }
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".serving-", delete=False) as staged:
        staged.write(orjson.dumps(document))
    os.replace(staged.name, path)
    logger.info("version_published", extra={"model": published.name, "version": published.version})


def read_published() -> PublishedVersion | None:
    """The version last published in this gunicorn run, or None if there is none (yet)."""
    path = version_file()
    if path is None:
        return None
    try:
        document = orjson.loads(path.read_bytes())
        previous = document.get("previous")
        return PublishedVersion(
            name=str(document["name"]),
            version=str(document["version"]),
            previous=(str(previous[0]), str(previous[1])) if previous else None,
        )
    except FileNotFoundError:
        return None
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, IndexError) as error:
        logger.error("published_version_unreadable", extra={"path": str(path), "error": str(error)})
        return None
