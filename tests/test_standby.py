"""Warm standby engines (``standby_engines``): when the active engine dies (kill -9) or hangs
(SIGSTOP), the front ends switch to a standby at once. Only the requests in flight on the
lost engine are answered 503, every other answer is the model's own, and a version switch
asked during a failover is all or none, standbys included. A standby that cannot load is
reported and never takes over.

One server serves every test of this module, in order (each fault uses up a standby, whose
replacement imports torch in the background): starting one costs more than the faults.
Timeouts for what is not the point (starting, a replacement's start-up) are generous for a
busy 2-core machine; the point is no wrong answer and the standby taking over.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from tests.digits_versions import DIGITS, add_digits_version, copy_bundled_digits
from tests.processes import Running, alive, scraped, serve_with_engines, wait_for

pytestmark = pytest.mark.slow

WORKERS = 2
STANDBYS = 2
CALLERS = 8
TOKEN = "standby-token-0123456789abcdef0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DIGIT = {"instances": [[[0.5] * 8] * 8]}
#: A replacement imports torch and loads while the load goes on: tens of seconds on a busy host.
REPLACEMENT_TIMEOUT_S = 180.0
#: The longest a caller may wait between two answers when a standby takes over from a dead
#: engine: the goal is 0.5 s on a quiet host; a busy one pauses processes for longer. A
#: restart instead would take the replacement's whole start-up (import torch: seconds).
TAKEOVER_GAP_S = 2.5
#: How much longer than the longest gap between two answers a front end's failover may be
#: timed: from the engine's last frame (up to engine_heartbeat_interval_s before the kill) to
#: that front end's switch, which a loop paused by a busy host delays for its clients alone.
TAKEOVER_SLACK_S = 1.0
#: Twice the default: this module runs three engines and two front ends on a machine that may
#: be busy, where a loop paused past the default 1.5 s would be declared hung (and replaced by
#: a standby, which these tests would then see as a fault they did not cause).
HEARTBEAT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Answer:
    sent_s: float
    answered_s: float
    status: int | str
    version: str | None = None
    predictions: Any = None


@dataclass
class Server:
    running: Running
    root: Path
    versions: tuple[str, str]
    reference: dict[str, np.ndarray]
    """Per version: its answer to ``DIGIT`` alone."""

    @property
    def url(self) -> str:
        return self.running.url


def engines(server: Server) -> list[dict[str, Any]]:
    engines: list[dict[str, Any]] = httpx.get(server.url + "/models", timeout=10.0).json()[
        "engines"
    ]
    return engines


def active_pid(server: Server) -> int:
    (pid,) = [int(e["pid"]) for e in engines(server) if e["role"] == "active"]
    return pid


def standby_pids(server: Server) -> set[int]:
    return {int(e["pid"]) for e in engines(server) if e["role"] == "standby"}


def wait_for_standbys(server: Server, count: int) -> None:
    def ready() -> bool:
        try:
            return len(standby_pids(server)) >= count
        except (httpx.TransportError, ValueError):
            return False

    wait_for(ready, f"{count} standby engine(s) ready", server.running, REPLACEMENT_TIMEOUT_S)


def lone_answer(url: str) -> tuple[str, np.ndarray]:
    answer = httpx.post(url + "/predict", json=DIGIT, timeout=10.0).json()
    return str(answer["version"]), np.asarray(answer["predictions"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("standby")
    root = folder / "models"
    copy_bundled_digits(root)
    shifted = add_digits_version(root, 0.5)
    with serve_with_engines(
        folder,
        WORKERS,
        BATCHSERVE_MODEL_REPOSITORY=str(root),
        BATCHSERVE_MODEL_VERSION=DIGITS.version,
        BATCHSERVE_ADMIN_TOKEN=TOKEN,
        BATCHSERVE_STANDBY_ENGINES=str(STANDBYS),
        BATCHSERVE_ENGINE_HEARTBEAT_TIMEOUT_S=str(HEARTBEAT_TIMEOUT_S),
    ) as running:
        serving = Server(running, root, (DIGITS.version, shifted), {})
        wait_for(
            lambda: running.output().count('"event":"frontend_ready"') >= WORKERS,
            "front ends ready",
            running,
            REPLACEMENT_TIMEOUT_S,
        )
        wait_for_standbys(serving, STANDBYS)
        version, predictions = lone_answer(serving.url)
        serving.reference[version] = predictions
        yield serving


async def _closed_loop(url: str, stop: asyncio.Event) -> list[Answer]:
    answers: list[Answer] = []
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:

        async def caller() -> None:
            while not stop.is_set():
                sent_s = time.monotonic()
                try:
                    response = await client.post("/predict", json=DIGIT)
                except httpx.TransportError as error:
                    answers.append(Answer(sent_s, time.monotonic(), type(error).__name__))
                    continue
                answered_s = time.monotonic()
                if response.status_code != 200:
                    assert response.status_code != 503 or "retry-after" in response.headers
                    answers.append(Answer(sent_s, answered_s, response.status_code))
                    await asyncio.sleep(0.05)  # as a client honouring Retry-After would, briefly
                    continue
                body = response.json()
                answers.append(
                    Answer(sent_s, answered_s, 200, str(body["version"]), body["predictions"])
                )

        await asyncio.gather(*(caller() for _ in range(CALLERS)))
    return answers


def under_load(
    server: Server, faults: list[tuple[float, int]], after_s: float, victims: list[int]
) -> list[Answer]:
    """Closed-loop load from ``CALLERS`` callers; each fault ``(at_s, signal)`` is sent to the
    engine active at that moment (added to ``victims``), ``at_s`` after the load started; the
    load stops ``after_s`` after the last fault."""

    async def run() -> list[Answer]:
        stop = asyncio.Event()
        load = asyncio.create_task(_closed_loop(server.url, stop))
        started_s = time.monotonic()
        for at_s, signum in faults:
            await asyncio.sleep(max(0.0, started_s + at_s - time.monotonic()))
            victims.append(await asyncio.to_thread(active_pid, server))
            os.kill(victims[-1], signum)
        await asyncio.sleep(after_s)
        stop.set()
        return await load

    return asyncio.run(run())


def failovers(server: Server) -> list[tuple[int, int]]:
    """Each front end's switch to a standby, as (from pid, to pid), from the logs."""
    return [
        (int(record["from_pid"]), int(record["to_pid"]))
        for line in server.running.output().splitlines()
        if '"event":"engine_failover"' in line
        for record in [orjson.loads(line)]
    ]


def failover_seconds(server: Server, victims: list[int]) -> list[float]:
    """How long each front end's switch from each victim took, as it logged it."""
    return [
        float(record["takeover_s"])
        for line in server.running.output().splitlines()
        if '"event":"engine_failover"' in line
        for record in [orjson.loads(line)]
        if record["from_pid"] in victims
    ]


def taken_over_by_standbys(server: Server, victims: list[int], standbys: set[int]) -> None:
    """Every front end switched from each victim to an engine that was a standby before the
    faults (not to a restarted one)."""
    switched = failovers(server)
    for victim in victims:
        to = {to for source, to in switched if source == victim}
        assert to, f"no failover from {victim}: {switched}"
        assert to <= standbys, (victim, to, standbys)


def check_answers(server: Server, answers: list[Answer], faults: int) -> float:
    """Every answer 200 and the model's own, or 503 for a request in flight on a lost
    engine (at most one per caller and fault); the longest gap between two answers."""
    statuses = {answer.status for answer in answers}
    assert statuses <= {200, 503}, statuses
    refused = [answer for answer in answers if answer.status == 503]
    assert len(refused) <= CALLERS * faults, f"{len(refused)} answered 503"
    served = sorted((a for a in answers if a.status == 200), key=lambda a: a.answered_s)
    assert len(served) > 20 * faults  # answers on either side of each fault
    for answer in served:
        assert answer.version in server.reference, answer.version
        np.testing.assert_allclose(
            answer.predictions, server.reference[answer.version], rtol=1e-5, atol=1e-5
        )
    return max(b.answered_s - a.answered_s for a, b in itertools.pairwise(served))


def test_kill_9_of_the_active_engine_twice_costs_only_its_requests_in_flight(
    server: Server,
) -> None:
    standbys = standby_pids(server)
    victims: list[int] = []
    faults = [(1.0, signal.SIGKILL), (4.0, signal.SIGKILL)]
    answers = under_load(server, faults, after_s=1.5, victims=victims)
    gap_s = check_answers(server, answers, faults=2)
    refused = sum(answer.status == 503 for answer in answers)
    print(f"\nkill -9 twice: {len(answers)} requests, {refused} 503, longest gap {gap_s:.3f} s")
    assert gap_s < TAKEOVER_GAP_S
    assert victims[1] in standbys  # the first standby took over, then the second
    taken_over_by_standbys(server, victims, standbys)
    assert not any(alive(victim) for victim in victims)
    assert scraped(server.url, "batchserve_engine_failovers_total") >= 2 * WORKERS
    # Each front end timed each failover as about the outage its clients saw; before, from
    # the victim's last status change (when it became ready): 28-51 s for outages under 3 s.
    timed = failover_seconds(server, victims)
    print(f"failovers timed {timed} s")
    assert len(timed) == 2 * WORKERS
    assert all(seconds <= gap_s + TAKEOVER_SLACK_S for seconds in timed), (timed, gap_s)
    observed = scraped(server.url, "batchserve_engine_takeover_seconds_sum")
    assert observed == pytest.approx(sum(timed), abs=1e-3)


def test_a_hung_active_engine_is_replaced_by_a_standby_within_its_heartbeat_timeout(
    server: Server,
) -> None:
    wait_for_standbys(server, 1)
    standbys = standby_pids(server)
    victims: list[int] = []
    try:
        answers = under_load(
            server, [(1.0, signal.SIGSTOP)], after_s=HEARTBEAT_TIMEOUT_S + 3.0, victims=victims
        )
    finally:
        for victim in victims:
            if alive(victim):
                os.kill(victim, signal.SIGKILL)
    gap_s = check_answers(server, answers, faults=1)
    print(f"\nSIGSTOP: {len(answers)} requests, longest gap {gap_s:.3f} s")
    # Declared hung at the heartbeat timeout, by the supervisor looking every 0.1 s.
    assert gap_s < HEARTBEAT_TIMEOUT_S + TAKEOVER_GAP_S
    taken_over_by_standbys(server, victims, standbys)
    assert '"event":"engine_unresponsive"' in server.running.output()


def served_versions(server: Server) -> set[str | None]:
    return {engine["version"] for engine in engines(server)}


def test_a_switch_during_a_failover_reaches_every_engine_or_none(server: Server) -> None:
    wait_for_standbys(server, 1)
    before = lone_answer(server.url)[0]
    target = next(version for version in server.versions if version != before)
    os.kill(active_pid(server), signal.SIGKILL)
    switched = httpx.post(
        f"{server.url}/admin/models/digits/versions/{target}/load", headers=AUTH, timeout=120
    )
    assert switched.status_code in (200, 503), switched.text
    expected = target if switched.status_code == 200 else before
    wait_for_standbys(server, STANDBYS)  # the replacement serves what the answer said too
    assert served_versions(server) == {expected}
    if switched.status_code == 503:  # every engine is up now: the switch goes through
        answer = httpx.post(
            f"{server.url}/admin/models/digits/versions/{target}/load", headers=AUTH, timeout=120
        )
        assert answer.status_code == 200, answer.text
        # A switch's full garbage collections, in every engine at once, can pause a loop past
        # the heartbeat timeout on a busy host: that engine is replaced (by a standby), and its
        # replacement serves what the record says.
        if None in served_versions(server):
            wait_for_standbys(server, STANDBYS)
        assert served_versions(server) == {target}
    version, predictions = lone_answer(server.url)
    assert version == target
    server.reference[version] = predictions
    print(f"\nswitch during a failover: {switched.status_code}")


def test_a_standby_that_cannot_load_is_reported_and_never_takes_over(server: Server) -> None:
    wait_for_standbys(server, STANDBYS)
    served = lone_answer(server.url)[0]
    weights = next((server.root / "digits" / served).glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-8] + b"corrupt!")  # fails its hash check
    victim = min(standby_pids(server))
    os.kill(victim, signal.SIGKILL)

    failed: list[dict[str, Any]] = []

    def reported() -> bool:
        readiness = httpx.get(server.url + "/readyz", timeout=10.0)
        assert readiness.status_code == 200, readiness.text  # the active engine serves on
        failed[:] = [e for e in readiness.json()["engines"] if e["status"] == "failed"]
        return bool(failed)

    wait_for(reported, "the failed standby reported", server.running, REPLACEMENT_TIMEOUT_S)
    assert failed[0]["role"] is None
    assert failed[0]["detail"], failed
    assert scraped(server.url, "batchserve_standby_engines_ready") == STANDBYS - 1
    healthy = standby_pids(server)
    victims: list[int] = []
    answers = under_load(server, [(1.0, signal.SIGKILL)], after_s=1.5, victims=victims)
    check_answers(server, answers, faults=1)
    taken_over_by_standbys(server, victims, healthy)
    roles = {engine["role"] for engine in engines(server) if engine["status"] == "failed"}
    assert roles == {None}  # the healthy standby took over, never the failed one
