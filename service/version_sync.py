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


def version_file() -> Path | None:
    """The published-version file of this gunicorn run, or None outside gunicorn."""
    directory = os.environ.get(VERSION_DIR_ENV)
    return Path(directory) / VERSION_FILE if directory else None


def publish(name: str, version: str) -> None:
    """Tell the other workers to serve ``name`` at ``version`` (atomically: write, rename)."""
    path = version_file()
    if path is None:
        return
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".serving-", delete=False) as staged:
        staged.write(orjson.dumps({"name": name, "version": version}))
    os.replace(staged.name, path)
    logger.info("version_published", extra={"model": name, "version": version})


def read_published() -> PublishedVersion | None:
    """The version last published in this gunicorn run, or None if there is none (yet)."""
    path = version_file()
    if path is None:
        return None
    try:
        document = orjson.loads(path.read_bytes())
        return PublishedVersion(name=str(document["name"]), version=str(document["version"]))
    except FileNotFoundError:
        return None
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as error:
        logger.error("published_version_unreadable", extra={"path": str(path), "error": str(error)})
        return None
