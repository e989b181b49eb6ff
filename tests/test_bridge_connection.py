"""The front end's connection to an engine (``bridge/connection.py``) on its own, over a real
socket pair: when its frames leave, and what a repeated status costs. No engine runs; the test
plays the engine's end of the socket, whose bytes are there as soon as the front end wrote them
(a Unix socket delivers on ``send``)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest

from service.bridge import contract, wire
from service.bridge.connection import EngineConnection
from service.bridge.interface import EngineStatus, InferenceRequest
from service.tensors import NamedArrays


class EngineEnd:
    """The engine's end of the socket: what the front end sent, read without waiting."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self._reader = wire.FrameReader()

    def frames(self) -> list[wire.Frame]:
        frames: list[wire.Frame] = []
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except BlockingIOError:
                return frames
            frames += self._reader.feed(chunk)

    def send_status(self, status: EngineStatus) -> None:
        for part in wire.encode(wire.Kind.STATUS, status.to_wire()):
            self.sock.sendall(part)


@pytest.fixture
async def connected() -> AsyncIterator[tuple[EngineConnection, EngineEnd, list[int]]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    changes: list[int] = []
    connection = EngineConnection(Path("engine.sock"), "cpu", 10.0, lambda: changes.append(1))
    loop = asyncio.get_running_loop()
    await loop.create_unix_connection(lambda: connection, sock=ours)
    try:
        yield connection, EngineEnd(theirs), changes
    finally:
        connection.close()
        theirs.close()


def a_request() -> InferenceRequest:
    return InferenceRequest(
        model="m",
        version="1",
        instances=NamedArrays({"x": np.ones((1, 4), np.float32)}),
        priority="normal",
        deadline_s=time.monotonic() + 60.0,
        request_id="r",
    )


async def test_a_submit_leaves_on_the_next_loop_turn_not_a_turn_later(
    connected: tuple[EngineConnection, EngineEnd, list[int]],
) -> None:
    """The requests of one turn are gathered until its end (one frame), then written at
    once: a second deferral, through the frame writer's own end-of-turn queue, cost every
    request a loop turn of latency."""
    connection, engine, _ = connected
    connection.submit(a_request())
    connection.submit(a_request())
    assert engine.frames() == []
    await asyncio.sleep(0)  # one turn: the gathered submits go out at its start
    frames = engine.frames()
    assert [frame.kind for frame in frames] == [wire.Kind.SUBMITS]
    submits = contract.decode_submits(frames[0].typed_header)
    assert [submit.id for submit in submits.requests] == [1, 2]


async def test_a_cancel_leaves_on_the_next_loop_turn(
    connected: tuple[EngineConnection, EngineEnd, list[int]],
) -> None:
    connection, engine, _ = connected
    call_id, _ = connection.submit(a_request())
    await asyncio.sleep(0)
    connection.cancel(call_id)
    await asyncio.sleep(0)
    frames = engine.frames()
    assert [frame.kind for frame in frames] == [wire.Kind.SUBMITS, wire.Kind.CANCELS]
    assert contract.decode_cancels(frames[1].typed_header).ids == [call_id]


async def test_a_heartbeat_repeating_the_status_is_not_decoded_again(
    connected: tuple[EngineConnection, EngineEnd, list[int]],
) -> None:
    """Only a status that differs from the last one is rebuilt and reported."""
    connection, engine, changes = connected
    for phase in ("loading", "loading", "loading", "failed", "failed"):
        engine.send_status(EngineStatus(phase=phase, device="cpu", pid=7))  # type: ignore[arg-type]
        for _ in range(20):
            await asyncio.sleep(0.005)
            if connection.status.phase == phase:
                break
    assert connection.status.phase == "failed"
    assert len(changes) == 2


async def test_a_heartbeat_repeating_the_status_still_says_when_the_engine_was_heard(
    connected: tuple[EngineConnection, EngineEnd, list[int]],
) -> None:
    """Not reported as a change, but a takeover is timed from it: before, a takeover was
    timed from the lost engine's last status change, tens of seconds for an outage of 0.5 s."""
    connection, engine, changes = connected
    status = EngineStatus(phase="loading", device="cpu", pid=7)
    engine.send_status(status)
    await until(lambda: len(changes) == 1)
    first_heard_s = connection.last_heard_s
    engine.send_status(status)
    await until(lambda: connection.last_heard_s > first_heard_s)
    assert len(changes) == 1


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Let the loop run until ``condition`` holds; fail after ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, "the condition never held"
        await asyncio.sleep(0.01)
