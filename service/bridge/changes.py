"""Admin changes that reach every engine of a server: switch a version (or load one beside the
others), split a model's traffic over several versions, and unload a model, all or none.

A switch first has each engine load and warm up the version beside what it serves
(``prepare``); only when all have it does each serve it (``commit``); if any refuses, the others
discard it (``abort``). An engine commits by publishing what it serves (``published.py``)
before it answers, so when an engine is lost before its answer comes (killed, restarted), the
published record decides: the change took place if the record shows it (a restarted engine
serves it) and did not otherwise (503; what was served stays, after any restart). The answer
never says the opposite of what is served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from service.bridge import published
from service.bridge.interface import EngineStatus, ModelInfo, SwitchResult
from service.errors import EngineUnavailableError, ServiceError
from service.manifest import Manifest

logger = logging.getLogger(__name__)

Record = list[published.PublishedVersion] | None


class ControlChannel(Protocol):
    """One engine, as the front end's connection to it (``client.EngineConnection``)."""

    status: EngineStatus

    async def control(self, op: str, **args: object) -> Any:
        """One step on this engine; its result, or its ``ServiceError``."""
        ...


async def switch_everywhere(
    engines: Sequence[ControlChannel], name: str, version: str, before: ModelInfo | None
) -> SwitchResult:
    """Serve ``name`` at ``version`` on every engine or on none; ``before`` is the model of
    that name served now (None: not served), for the answer when no engine could say."""
    require_every_engine(engines, "a version switch")
    target = await _prepare_everywhere(engines, "prepare", name=name, version=version)
    replies = await _on_every_engine(
        engines,
        "commit",
        {},
        lambda record: published.recorded_version(record, name) == target.version,
        f"switching {name} to {target.version}",
    )
    if replies:
        reply = replies[0]
        return SwitchResult(
            serving=Manifest.model_validate(reply["serving"]), replaced=reply["replaced"]
        )
    return SwitchResult(serving=target, replaced=replaced_by(before, target))


async def split_everywhere(
    engines: Sequence[ControlChannel],
    name: str,
    weights: dict[str, int],
    before: ModelInfo | None,
) -> SwitchResult:
    """Split ``name``'s traffic by ``weights`` on every engine or on none (each loads the
    versions it lacks first); ``before``: its primary now, for the answer when no engine
    could say."""
    require_every_engine(engines, "a traffic split")
    target = await _prepare_everywhere(engines, "prepare_split", name=name, weights=weights)
    replies = await _on_every_engine(
        engines,
        "commit",
        {},
        lambda record: published.recorded_weights(record, name) == weights,
        f"splitting {name}'s traffic {weights}",
    )
    if replies:
        reply = replies[0]
        return SwitchResult(
            serving=Manifest.model_validate(reply["serving"]), replaced=reply["replaced"]
        )
    replaced = replaced_by(before, target)
    return SwitchResult(serving=target, replaced=None if replaced == "nothing" else replaced)


async def _prepare_everywhere(
    engines: Sequence[ControlChannel], op: str, **args: object
) -> Manifest:
    """``op`` (a first step) on every engine: the manifest it will serve, or, when any
    refuses, the others' step aborted and the most telling refusal raised."""
    outcomes = await every_engine_or_none(engines, (op, args), ("abort", {}))
    return Manifest.model_validate(outcomes[0])


async def every_engine_or_none(
    engines: Sequence[ControlChannel],
    step: tuple[str, dict[str, object]],
    undo: tuple[str, dict[str, object]],
) -> list[Any]:
    """``step`` (an operation and its arguments) on every engine at once: each engine's
    reply, or, when any refuses, ``undo`` on the engines that took it and the most telling
    refusal raised."""
    op, args = step
    outcomes = await asyncio.gather(
        *(engine.control(op, **args) for engine in engines),
        return_exceptions=True,
    )
    failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    if failures:
        took = [
            engine
            for engine, outcome in zip(engines, outcomes, strict=True)
            if not isinstance(outcome, BaseException)
        ]
        undo_op, undo_args = undo
        await asyncio.gather(
            *(engine.control(undo_op, **undo_args) for engine in took), return_exceptions=True
        )
        raise most_telling(failures)
    return outcomes


async def unload_everywhere(
    engines: Sequence[ControlChannel], name: str, served: ModelInfo | None
) -> str:
    """Stop serving ``name`` on every engine; the ``name@version`` unloaded. Any refusal is
    the answer (each engine refuses alike)."""
    require_every_engine(engines, "unloading a model")
    replies = await _on_every_engine(
        engines,
        "unload",
        {"name": name},
        lambda record: record is not None and published.recorded_version(record, name) is None,
        f"unloading {name}",
    )
    if replies:
        return str(replies[0]["unloaded"])
    return served.manifest.label if served else name


def replaced_by(before: ModelInfo | None, target: Manifest) -> str | None:
    """What serving ``target`` replaces: ``name@version``, ``nothing`` for a model not served
    yet, or None when ``target`` is what was served."""
    if before is None:
        return "nothing"
    return None if before.manifest.version == target.version else before.manifest.label


async def _on_every_engine(
    engines: Sequence[ControlChannel],
    op: str,
    args: dict[str, object],
    recorded: Callable[[Record], bool],
    what: str,
) -> list[Any]:
    """``op`` on every engine: the replies of those that answered. Any refusal is raised;
    engines lost before they answered are decided by ``recorded`` (the published record)."""
    outcomes = await asyncio.gather(
        *(engine.control(op, **args) for engine in engines), return_exceptions=True
    )
    failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    lost = [f for f in failures if isinstance(f, EngineUnavailableError | TimeoutError)]
    if len(lost) < len(failures):
        raise most_telling(failures)
    if lost and not recorded(published.read_published()):
        logger.error("admin_change_lost", extra={"change": what, "error": str(lost[0])})
        raise EngineUnavailableError(
            f"an engine was lost while {what}, before the change was recorded: it did not "
            "take place, and what was served stays served; retry"
        )
    if lost:
        logger.warning("admin_change_recorded_before_engine_lost", extra={"change": what})
    return [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]


def require_every_engine(engines: Sequence[ControlChannel], what: str) -> None:
    """Refuse (503) a change while some engine is not ready: it would miss it."""
    down = [engine for engine in engines if not engine.status.ready]
    if down:
        phases = ", ".join(f"{e.status.device} {e.status.phase}" for e in down)
        raise EngineUnavailableError(
            f"{what} must reach every engine, and not all are ready ({phases})"
        )


def most_telling(failures: list[BaseException]) -> BaseException:
    """The error to answer a failed change with: a refusal (422) or conflict (409) says more
    than an engine being away, which says more than anything unexpected."""
    service_errors = [failure for failure in failures if isinstance(failure, ServiceError)]
    for status in (422, 404, 409):
        for failure in service_errors:
            if failure.status_code == status:
                return failure
    return service_errors[0] if service_errors else failures[0]
