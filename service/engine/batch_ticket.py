"""A queued request as its caller holds it: the outputs of its chunks, in request order.

No asyncio future per request: a chunk is answered by setting its slot, and once every chunk
is answered the ticket goes to its ``Sink`` with the other tickets of the same front end that
the same batch finished (one call per batch per front end: the bridge answers them in one
frame). An in-process caller awaits ``wait()`` instead, which makes the one future it needs.

It always finishes: each chunk is answered by its batch, its deadline or a cancel, and once
one chunk has failed the request's other chunks are withdrawn (those still queued are never
computed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from service.engine.batch_queue import Entry

OutputT = TypeVar("OutputT")


class Sink(Protocol):
    """Where a front end's finished tickets go: once per batch, all of that batch's."""

    def deliver(self, tickets: Sequence[Ticket[Any]]) -> None: ...


class Ticket(Generic[OutputT]):
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

    def __init__(
        self,
        *,
        tag: object,
        sink: Sink | None,
        withdraw: Callable[[list[Entry]], None],
        finished: Callable[[Ticket[Any]], None],
    ) -> None:
        self.tag = tag
        """What the caller knows the request by (the bridge: its call id and version)."""
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
        """Every chunk's output once done; raises the first chunk's error, or
        ``CancelledError`` when it was withdrawn."""
        errors = [error for error in self._errors if error is not None]
        for error in errors:
            if not isinstance(error, asyncio.CancelledError):
                raise error
        if errors:
            raise asyncio.CancelledError()
        return list(self._outputs)

    async def wait(self) -> list[OutputT]:
        """The outputs; if the caller is cancelled meanwhile, the request is withdrawn."""
        if self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except BaseException:
                self.cancel()
                raise
        return self.outputs()

    def batches(self) -> tuple[tuple[str, int], ...]:
        """The traced batches that ran the request's chunks, and the rows each held."""
        return tuple(batch for entry in self._entries for batch in entry.batches)

    def cancel(self) -> None:
        """Withdraw the request: its chunks still queued are dropped and never computed."""
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
