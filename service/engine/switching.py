"""Changing what one engine serves: load a version beside the others, switch to it, split a
model's traffic over several of its versions, unload.

A switch has two steps so that a front end can switch several engines all or none: ``prepare``
loads, verifies and warms up the version beside what is served and holds it; ``commit`` serves
it, ``abort`` discards it. A traffic split has the same two steps (``prepare_split``: every
version it names that is not loaded yet). ``switch`` is both at once, for one engine alone.
One change at a time per engine (``state.switch_lock``): a second one is refused (409) rather
than queued, so that the admin API answers at once and every memory measurement is a model's
own.

Committing publishes what the engine serves (``bridge/published.py``) before it answers: that
record is the commit point, which an engine started later serves, and which a front end reads
to tell whether a commit whose answer it never got took place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service import traffic_split
from service.bridge.interface import SwitchResult
from service.engine import lifecycle
from service.engine.compatibility import interchangeable, request_contract
from service.engine.state import EngineState, ServedModel
from service.errors import (
    ConflictError,
    ModelIntegrityError,
    ModelLoadError,
    ModelNotFoundError,
    ModelRejectedError,
)
from service.manifest import Manifest


@dataclass
class _Prepared:
    name: str
    loaded: ServedModel | None
    """None: the version asked for is served already (committing changes nothing)."""
    weights: dict[str, int] | None = None
    """A traffic split to serve (then ``loaded`` is None, and ``beside`` what it loaded)."""
    beside: dict[str, ServedModel] = field(default_factory=dict)
    promoted: bool = False
    """``loaded`` is the copy loaded beside already (a split's): committing makes it the
    primary, aborting leaves it where it is."""


class Switcher:
    """One engine's loads, switches and unloads, one at a time."""

    def __init__(self, state: EngineState) -> None:
        self._state = state
        self._prepared: _Prepared | None = None

    async def prepare(self, name: str, version: str) -> Manifest:
        """Load ``name`` at ``version`` (or ``latest``) beside what is served and hold it until
        ``commit`` or ``abort``; meanwhile any other change is refused (409). Raises
        ``ModelRejectedError`` (422) for a version that fails its hash check or cannot be
        built, ``ConflictError`` (409) for one that does not fit in the memory budget."""
        await self._lock("another version is being loaded")
        try:
            loaded = await _load_beside(self._state, name, version)
        except BaseException:
            self._state.switch_lock.release()
            raise
        promoted = loaded is not None and self._state.in_use(loaded)
        self._prepared = _Prepared(name, loaded, promoted=promoted)
        return (loaded or self._state.models[name]).manifest

    async def prepare_split(self, name: str, weights: dict[str, int]) -> Manifest:
        """Load each version of ``weights`` (checked: ``traffic_split.checked_weights``) that
        is not loaded yet beside the versions of ``name`` loaded, within the memory budget
        counting them all, and hold them until ``commit`` (which splits ``name``'s traffic by
        ``weights``) or ``abort``. Returns the manifest of the primary to be. Refused as
        ``prepare`` is; 404 for a model not served."""
        await self._lock("another version is being loaded")
        try:
            beside = await _load_split(self._state, name, weights)
        except BaseException:
            self._state.switch_lock.release()
            raise
        self._prepared = _Prepared(name, None, weights, beside)
        current = self._state.models[name]
        primary = traffic_split.primary_of(weights, current.manifest.version)
        return (
            beside[primary].manifest
            if primary in beside
            else self._state.store.resolve(name, primary)
        )

    async def commit(self) -> SwitchResult:
        """Serve what ``prepare`` or ``prepare_split`` loaded (nothing changes if it was
        served already)."""
        prepared = self._take_prepared("commit")
        try:
            if prepared.weights is not None:
                replaced = lifecycle.split_traffic(
                    self._state, prepared.name, prepared.weights, prepared.beside
                )
                return SwitchResult(
                    serving=self._state.models[prepared.name].manifest, replaced=replaced
                )
            if prepared.loaded is None:
                return SwitchResult(
                    serving=self._state.models[prepared.name].manifest, replaced=None
                )
            replaced = lifecycle.switch_to(self._state, prepared.loaded)
            return SwitchResult(serving=prepared.loaded.manifest, replaced=replaced)
        finally:
            self._state.switch_lock.release()

    async def abort(self) -> None:
        """Discard what ``prepare`` loaded, if anything; what is served stays."""
        if self._prepared is None:
            return
        prepared = self._take_prepared("abort")
        try:
            if prepared.loaded is not None and not prepared.promoted:
                await lifecycle.retire(prepared.loaded)
            for served in prepared.beside.values():
                await lifecycle.retire(served)
        finally:
            self._state.switch_lock.release()

    async def switch(self, name: str, version: str) -> SwitchResult:
        """``prepare`` then ``commit``: serve ``name`` at ``version`` beside the other models,
        or in place of the version of ``name`` served now."""
        await self.prepare(name, version)
        return await self.commit()

    async def unload(self, name: str) -> str:
        """Stop serving ``name``: new requests for it are refused at once, those queued
        finish, then its memory is freed. Returns the ``name@version`` unloaded. Refused (409)
        for the only model served and while another change is under way."""
        await self._lock("a version is being loaded")
        try:
            served = self._state.models.get(name)
            if served is None:
                serving = ", ".join(self._state.models) or "nothing"
                raise ModelNotFoundError(f"{name} is not served here (serving {serving})")
            if len(self._state.models) == 1:
                raise ConflictError(
                    f"{served.manifest.label} is the only model served; load another before "
                    "unloading it, or switch its version instead"
                )
            await lifecycle.withdraw(self._state, name)
        finally:
            self._state.switch_lock.release()
        return served.manifest.label

    async def _lock(self, reason: str) -> None:
        """Take the switch lock, or refuse (409) while another change holds it."""
        if self._state.switch_lock.locked():
            raise ConflictError(f"{reason}; retry when it is done")
        await self._state.switch_lock.acquire()

    def _take_prepared(self, step: str) -> _Prepared:
        if self._prepared is None:
            raise ConflictError(f"no version has been prepared; nothing to {step}")
        prepared, self._prepared = self._prepared, None
        return prepared


async def _load_split(
    state: EngineState, name: str, weights: dict[str, int]
) -> dict[str, ServedModel]:
    """The versions of ``weights`` not loaded for ``name`` yet, loaded and warmed up beside
    every version loaded; all or none. 404 for a model not served or a version that is not
    an id in the repository, 422 for one that fails its check or cannot be built."""
    if name not in state.models:
        serving = ", ".join(state.models) or "nothing"
        raise ModelNotFoundError(
            f"{name} is not served here (serving {serving}); load a version of it first"
        )
    try:
        for version in weights:
            if state.store.resolve(name, version).version != version:
                raise ModelNotFoundError(f"a split names versions by id, got {version!r}")
        return await lifecycle.load_missing_versions(state, name, weights)
    except (ModelIntegrityError, ModelLoadError) as error:
        reason = str(error).replace(str(state.store.root), "<repository>")
        raise ModelRejectedError(f"{reason}; still serving {name} as before") from error


async def _load_beside(state: EngineState, name: str, version: str) -> ServedModel | None:
    """``name`` at ``version`` loaded and warmed up beside the models served, or None when
    that version is served already, or its copy loaded beside (a split's) when it is: that
    copy is promoted, never loaded twice. A version refused leaves what is served untouched."""
    current = state.models.get(name)
    serving = current.manifest.label if current else "nothing"
    try:
        manifest = state.store.resolve(name, version)
        if current is not None and current.manifest.version == manifest.version:
            return None
        beside = state.beside_copy(name, manifest.version)
        if beside is not None:
            return beside
        await lifecycle.release_shadow_copy(state, name, manifest.version)
        return await lifecycle.load_version(state, name, manifest.version)
    except (ModelIntegrityError, ModelLoadError) as error:
        reason = str(error).replace(str(state.store.root), "<repository>")
        raise ModelRejectedError(f"{reason}; still serving {serving} for {name}") from error


async def load_shadow(state: EngineState, served: ServedModel, version: str) -> ServedModel:
    """``served``'s model at ``version`` loaded beside every model served, as a shadow
    candidate (``engine/shadow.py``), or its copy loaded beside for a split when it is.
    Refused (409) for the version served: it cannot shadow itself; (422) for one that would
    prepare or answer a request otherwise (``compatibility.py``): its answers to the served
    version's instances could not be compared. 409 while another change is under way."""
    name = served.manifest.name
    manifest = state.store.resolve(name, version)
    if manifest.version == served.manifest.version:
        raise ConflictError(
            f"{manifest.label} is the version served; a shadow runs another version of {name}"
        )
    if not interchangeable(request_contract(manifest), request_contract(served.manifest)):
        raise ModelRejectedError(
            f"{manifest.label} cannot shadow {served.manifest.label}: their inputs, outputs, "
            "handler or files other than the weights differ, so the same request would not "
            "mean the same to both"
        )
    beside = state.beside_copy(name, manifest.version)
    if beside is not None:
        return beside  # one copy per version: the split's serves the shadow too
    if state.switch_lock.locked():
        raise ConflictError("a version is being loaded; retry when it is done")
    async with state.switch_lock:
        try:
            return await lifecycle.load_version(state, name, manifest.version, shadow=True)
        except (ModelIntegrityError, ModelLoadError) as error:
            reason = str(error).replace(str(state.store.root), "<repository>")
            raise ModelRejectedError(f"{reason}; no shadow of {name} started") from error
