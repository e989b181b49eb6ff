"""The models and versions the engines serve, kept on disk for the engine that starts next.

An admin load, unload or rollback reaches every engine of a server. Each engine then records
what it serves in a file of the server's run folder, which the supervisor creates and names in
``RUN_DIR_ENV``; an engine started later, such as the replacement for one that died, serves
the recorded models instead of ``models`` (or ``model_name``/``model_version``), and can roll
each back. One process serving alone has no run folder and records nothing.

The record is the commit point of an admin change: an engine writes it when it commits, before
it answers, so a front end that lost an engine's answer reads here whether the change took
place (``recorded_version``): what the record says is what every engine serves after any
restart.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from service.processes import RUN_DIR_ENV

logger = logging.getLogger(__name__)

VERSION_FILE = "serving.json"


@dataclass(frozen=True)
class PublishedVersion:
    name: str
    version: str
    previous: str | None = None
    """The version served before the last switch: what an engine started later rolls back to."""
    weights: dict[str, int] = field(default_factory=dict)
    """The model's traffic split over its versions (``version`` the primary among them);
    empty when ``version`` is served alone."""
    shadow: tuple[str, int] | None = None
    """The model's shadow (``engine/shadow.py``): its candidate version and the percent of
    requests copied to it, which an engine started later resumes; None without one."""


def version_file() -> Path | None:
    """The published-version file of this server's run, or None for one process alone."""
    directory = os.environ.get(RUN_DIR_ENV)
    return Path(directory) / VERSION_FILE if directory else None


def publish(served: list[PublishedVersion]) -> None:
    """Record what is served now, in order (atomically: write, then rename)."""
    path = version_file()
    if path is None:
        return
    document = [
        {
            "name": entry.name,
            "version": entry.version,
            "previous": entry.previous,
            **({"weights": entry.weights} if entry.weights else {}),
            **(
                {"shadow": {"version": entry.shadow[0], "percent": entry.shadow[1]}}
                if entry.shadow
                else {}
            ),
        }
        for entry in served
    ]
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".serving-", delete=False) as staged:
        staged.write(orjson.dumps(document))
    os.replace(staged.name, path)
    logger.info(
        "version_published", extra={"models": [f"{entry.name}@{entry.version}" for entry in served]}
    )


def read_published() -> list[PublishedVersion] | None:
    """What was last recorded in this server's run, or None if nothing is (yet)."""
    path = version_file()
    if path is None:
        return None
    try:
        document = orjson.loads(path.read_bytes())
        return [
            PublishedVersion(
                name=str(entry["name"]),
                version=str(entry["version"]),
                previous=str(entry["previous"]) if entry.get("previous") else None,
                weights={
                    str(version): int(weight)
                    for version, weight in (entry.get("weights") or {}).items()
                },
                shadow=(
                    (str(entry["shadow"]["version"]), int(entry["shadow"]["percent"]))
                    if entry.get("shadow")
                    else None
                ),
            )
            for entry in document
        ]
    except FileNotFoundError:
        return None
    except (
        OSError,
        orjson.JSONDecodeError,
        KeyError,
        TypeError,
        IndexError,
        ValueError,
        AttributeError,
    ) as error:
        logger.error("published_version_unreadable", extra={"path": str(path), "error": str(error)})
        return None


def recorded_weights(record: list[PublishedVersion] | None, name: str) -> dict[str, int] | None:
    """The traffic split of ``name`` that ``record`` says is served (``{version: 100}`` for a
    version served alone); None when it says ``name`` is not served, or there is no record."""
    entry = next((entry for entry in record or () if entry.name == name), None)
    if entry is None:
        return None
    return entry.weights or {entry.version: 100}


def recorded_version(record: list[PublishedVersion] | None, name: str) -> str | None:
    """The version of ``name`` that ``record`` says is served; None when it says ``name`` is
    not served, or when there is no record."""
    return next((entry.version for entry in record or () if entry.name == name), None)


class RolloutRecords:
    """Each model's rollout plan (``service/rollout_plan.py``), kept in the server's run folder
    beside the published version record, one file per model: it outlives any engine or front
    end restart, as what is served does. One process serving alone keeps them in memory."""

    def __init__(self, directory: Path | None) -> None:
        self._directory = directory
        self._in_memory: dict[str, bytes] = {}

    @classmethod
    def of_run(cls) -> RolloutRecords:
        path = version_file()
        return cls(None if path is None else path.parent)

    def read(self, name: str) -> bytes | None:
        """The plan of ``name`` as last written (JSON), or None."""
        if self._directory is None:
            return self._in_memory.get(name)
        try:
            return (self._directory / self._file_name(name)).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, plan: bytes) -> None:
        """Record ``plan`` (JSON) for ``name`` (atomically: write, then rename)."""
        if self._directory is None:
            self._in_memory[name] = plan
            return
        with tempfile.NamedTemporaryFile(
            dir=self._directory, prefix=".rollout-", delete=False
        ) as staged:
            staged.write(plan)
        os.replace(staged.name, self._directory / self._file_name(name))

    @staticmethod
    def _file_name(name: str) -> str:
        return f"rollout-{name}.json"  # a checked plain identifier (manifest.check_name)
