"""A queued request as its caller holds it: the outputs of its chunks, in request order.

No asyncio future per request: a chunk is answered by setting its slot, and once every chunk
is answered the ticket goes to its ``Sink`` with the other tickets of the same front end that
the same batch finished (one call per batch per front end: the bridge answers them in one
frame). An in-process caller awaits ``wait()`` instead, which makes the one future it needs.

A request that fits in one batch (the common case) is one object: its queue entry is its
ticket (``SoloTicket``). A larger one has a ``ChunkedTicket`` over the entries of its chunks.

It always finishes: each chunk is answered by its batch, its deadline or a cancel, and once
one chunk has failed the request's other chunks are withdrawn (those still queued are never
computed).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from service.engine.batch_queue import Entry
from service.types import Priority

OutputT = TypeVar("OutputT")


class Sink(Protocol):
    """Where a front end's finished tickets go: once per batch, all of that batch's."""

    def deliver(self, tickets: Sequence[Ticket[Any]]) -> None: ...


class Ticket(Protocol[OutputT]):
    """A queued request as its caller holds it."""

    tag: object
    """What the caller knows the request by (the bridge: its call id and version)."""

    @property
    def output(self) -> OutputT | None:
        """Its output once computed in one batch (else None: ask ``outputs``), read by a
        sink without a call."""
        ...

    @property
    def batches(self) -> tuple[tuple[str, int], ...]:
        """``traced_batches()``, read without a call where the ticket holds them."""
        ...

    @property
    def sink(self) -> Sink | None: ...

    def outputs(self) -> list[OutputT]:
        """Every chunk's output once done; raises the first chunk's error, or
        ``CancelledError`` when it was withdrawn."""
        ...

    async def wait(self) -> list[OutputT]:
        """The outputs; if the caller is cancelled meanwhile, the request is withdrawn."""
        ...

    def traced_batches(self) -> tuple[tuple[str, int], ...]:
        """The traced batches that ran the request's chunks, and the rows each held."""
        ...

    def cancel(self) -> None:
        """Withdraw the request: its chunks still queued are dropped and never computed."""
        ...


class ChunkedTicket(Generic[OutputT]):
    """The ticket of a request in several chunks (or of any request, one at a time)."""

    __slots__ = (
        "_entries",
        "_errors",
        "_finished",
        "_outputs",
        "_pending",
        "_waiter",
        "_withdraw",
        "sink",
        "tag",
    )

    output: None = None
    """Only a ``SoloTicket`` holds its output here (read by its sink without a call)."""

    def __init__(
        self,
        *,
        tag: object,
        sink: Sink | None,
        withdraw: Callable[[list[Entry]], None],
        finished: Callable[[Ticket[Any]], None],
    ) -> None:
        self.tag = tag
        self.sink = sink
        self._entries: list[Entry] = []
        self._outputs: list[Any] = []
        self._errors: list[BaseException | None] = []
        self._pending = 0
        self._withdraw = withdraw
        self._finished = finished
        self._waiter: asyncio.Future[None] | None = None

    def attach(self, entries: list[Entry]) -> None:
        """The request's chunks, in order (each entry's ``ticket`` and ``index`` point here)."""
        self._entries = entries
        self._outputs = [None] * len(entries)
        self._errors = [None] * len(entries)
        self._pending = len(entries)

    @property
    def abandoned(self) -> bool:
        """Its in-process caller was cancelled and has not withdrawn it yet (it will as soon
        as it runs again): the collector drops it rather than compute it for nobody."""
        return self._waiter is not None and self._waiter.cancelled()

    def outputs(self) -> list[OutputT]:
        errors = [error for error in self._errors if error is not None]
        for error in errors:
            if not isinstance(error, asyncio.CancelledError):
                raise error
        if errors:
            raise asyncio.CancelledError()
        return list(self._outputs)

    async def wait(self) -> list[OutputT]:
        if self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except BaseException:
                self.cancel()
                raise
        return self.outputs()

    def traced_batches(self) -> tuple[tuple[str, int], ...]:
        return tuple(batch for entry in self._entries for batch in entry.batches)

    @property
    def batches(self) -> tuple[tuple[str, int], ...]:
        """``traced_batches()``, as a ``SoloTicket`` holds them."""
        return self.traced_batches()

    def cancel(self) -> None:
        if self._pending:
            self._withdraw(self._entries)

    def chunk_answered(self, index: int, output: object) -> None:
        self._outputs[index] = output
        self._chunk_done()

    def chunk_failed(self, index: int, error: BaseException) -> None:
        self._errors[index] = error
        self._pending -= 1
        if self._pending:
            self._withdraw(self._entries)  # the request has failed as a whole
        else:
            self._finish()

    def _chunk_done(self) -> None:
        self._pending -= 1
        if self._pending == 0:
            self._finish()

    def _finish(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._finished(self)


class SoloTicket(Entry, Generic[OutputT]):
    """A request that fits in one batch: its one queue entry and its ticket in one object."""

    __slots__ = ("_error", "_finished", "_waiter", "_withdraw", "output", "sink", "tag")

    def __init__(
        self,
        payload: Any,
        rows: int,
        cost: int,
        group: Hashable,
        priority: Priority,
        arrival_s: float,
        deadline_s: float,
        request_id: str,
        source: Hashable,
        trace: str | None,
        tag: object,
        sink: Sink | None,
        withdraw: Callable[[list[Entry]], None],
        finished: Callable[[Ticket[Any]], None],
    ) -> None:
        # Every slot set here rather than through Entry.__init__: this runs once a request.
        self.payload = payload
        self.rows = rows
        self.cost = cost
        self.group = group
        self.priority = priority
        self.arrival_s = arrival_s
        self.deadline_s = deadline_s
        self.request_id = request_id
        self.source = source
        self.trace = trace
        self.batches = ()
        self.ticket = None
        self.index = 0
        self.queued = False
        self.done = False
        self.awaited = False  # until wait() is called
        self.tag = tag
        self.sink = sink
        self._withdraw = withdraw
        self._finished = finished
        self.output: OutputT | None = None
        """Its output once computed (None until then, or when it failed or was withdrawn)."""
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def abandoned(self) -> bool:
        return self._waiter is not None and self._waiter.cancelled()

    def resolve(self, output: object) -> None:
        if not self.done:
            self.done = True
            self.payload = None
            self.output = output  # type: ignore[assignment]
            self._settle()

    def reject(self, error: BaseException) -> None:
        if not self.done:
            self.done = True
            self.payload = None
            self._error = error
            self._settle()

    def outputs(self) -> list[OutputT]:
        error = self._error
        if error is not None:
            raise asyncio.CancelledError() if isinstance(error, asyncio.CancelledError) else error
        return [self.output]  # type: ignore[list-item]

    async def wait(self) -> list[OutputT]:
        if not self.done:
            self.awaited = True
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except BaseException:
                self.cancel()
                raise
        return self.outputs()

    def traced_batches(self) -> tuple[tuple[str, int], ...]:
        return self.batches

    def cancel(self) -> None:
        if not self.done:
            self._withdraw([self])

    def _settle(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._finished(self)


def settle_batch(
    batch: Sequence[Entry], outputs: Sequence[object], gathering: dict[Sink, list[Ticket[Any]]]
) -> None:
    """Answer each entry of a batch that ran with its output (an exception: its error), each
    finished ticket gathered for its sink in ``gathering``; the batch's caller delivers them.

    The common case (a front end's request in one entry, no in-process waiter, answered) is
    settled here inline, as ``resolve`` and its ``finished`` would: this runs once a request,
    and their chain of calls cost more than the rest of answering it."""
    last_sink: Sink | None = None
    last_tickets: list[Ticket[Any]] = []
    # Asked once in C: a batch with no failure (the common case) asks no entry's output.
    failed = any(map(isinstance, outputs, itertools.repeat(Exception)))
    for entry, output in zip(batch, outputs, strict=True):
        if failed and isinstance(output, Exception):
            entry.reject(output)
        elif (
            type(entry) is SoloTicket
            and entry.sink is not None
            and entry._waiter is None
            and not entry.done
        ):
            entry.done = True
            entry.payload = None
            entry.output = output
            sink = entry.sink
            if sink is not last_sink:
                last_sink = sink
                last_tickets = gathering.setdefault(sink, [])
            last_tickets.append(entry)
        else:
            entry.resolve(output)
