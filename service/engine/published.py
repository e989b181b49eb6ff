"""The version the engines serve, kept on disk for the engine that starts next.

An admin switch (``/admin/.../load`` or ``/admin/rollback``) reaches every engine of a server.
Each engine then records what it serves in a file of the server's run folder, which the
supervisor creates and names in ``RUN_DIR_ENV``; an engine started later, such as the
replacement for one that died, serves the recorded version instead of
``model_name``/``model_version``, and can roll back from it. One process serving alone has no
run folder and records nothing.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import orjson

from service.processes import RUN_DIR_ENV

logger = logging.getLogger(__name__)

VERSION_FILE = "serving.json"


@dataclass(frozen=True)
class PublishedVersion:
    name: str
    version: str
    previous: tuple[str, str] | None = None
    """(name, version) served before the switch: what an engine started later rolls back to."""


def version_file() -> Path | None:
    """The published-version file of this server's run, or None for one process alone."""
    directory = os.environ.get(RUN_DIR_ENV)
    return Path(directory) / VERSION_FILE if directory else None


def publish(published: PublishedVersion) -> None:
    """Record what is served now (atomically: write, then rename)."""
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
    """The version last recorded in this server's run, or None if there is none (yet)."""
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
