"""Overload and deadlines against the real ``batchserve serve`` process on 127.0.0.1.

A slow model (textenc, 512 tokens per request, one torch thread) behind a small queue, flooded
by many more concurrent connections than it can serve: the excess is answered 429 at once with
``Retry-After``, everything accepted is answered 200, nothing is dropped, memory stays bounded
and the server is ready afterwards. With a short deadline, a request that cannot finish in
time is refused at once, and one queued behind a batch that overruns its estimate is answered
504 at its deadline even while the device is busy, and is never computed.

The flood client is the soak test's minimal HTTP/1.1 client, one keep-alive connection per
worker: on two cores shared with the server, a general-purpose client would measure itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.soak import HttpConnection, ProtocolError, error_kind
from tests.processes import (
    BATCHSERVE,
    REPOSITORY_ROOT,
    Running,
    answers,
    batchserve_environment,
    free_port,
    running,
    wait_for,
)
from tests.torch_models import FEATURES, HANG_VALUE, package_hanging_model

pytestmark = pytest.mark.slow

TOKENS_PER_REQUEST = 512
FLOOD_REQUESTS = 2000
FLOOD_CONNECTIONS = 400
FLOOD_QUEUE_SIZE = 32
#: Upper bound of the whole flood; it takes seconds on an idle two-core machine.
FLOOD_CAP_S = 240.0
#: Resident memory may grow this much during the flood, no more: after warm-up it moves by
#: about +-20 MiB from one flood to the next (allocator caches, connection buffers).
RSS_GROWTH_BOUND_BYTES = 100 * 1024 * 1024
DEADLINE_MS = 300
#: How late a 504 may come after its deadline on a shared, noisy two-core machine (event loop
#: wake-up, GIL hand-over from the model thread, HTTP); typically a few ms.
DEADLINE_SLACK_S = 0.25
JSON_HEADERS = {"Content-Type": "application/json"}


def token_bodies(count: int, length: int, rows: int = 1) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [
        json.dumps({"instances": rng.integers(1, 1000, size=(rows, length)).tolist()}).encode()
        for _ in range(count)
    ]


# ------------------------------------------------------------------------------ the flood


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    latency_s: float


async def post(connection: HttpConnection, body: bytes) -> Answer:
    started_s = time.perf_counter()
    response = await connection.request("POST", "/predict", body, JSON_HEADERS)
    return Answer(response.status, response.headers, response.body, time.perf_counter() - started_s)


@dataclass
class Flood:
    answers: list[Answer] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def of_status(self, status: int) -> list[Answer]:
        return [answer for answer in self.answers if answer.status == status]


async def flood(port: int, bodies: list[bytes], total: int, connections: int) -> Flood:
    """``total`` requests from ``connections`` workers, each sending its next one at once."""
    result = Flood()
    tickets = iter(range(total))
    started_s = time.monotonic()

    async def worker() -> None:
        connection = HttpConnection("127.0.0.1", port)
        for ticket in tickets:
            if time.monotonic() - started_s > FLOOD_CAP_S:
                result.errors.append("flood cap reached")
                break
            try:
                result.answers.append(await post(connection, bodies[ticket % len(bodies)]))
            except (OSError, ProtocolError, asyncio.IncompleteReadError) as error:
                result.errors.append(f"{error_kind(error)}: {error!r}")
        await connection.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    result.duration_s = time.monotonic() - started_s
    return result


# ------------------------------------------------------------------------------ metrics


def scrape(server: Running) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def samples(text: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """Every sample called ``name`` whose labels include ``labels``."""
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]


def value(text: str, name: str, **labels: str) -> float:
    """The value of one series (0 when it was never set)."""
    found = samples(text, name, **labels)
    assert len(found) <= 1, found
    return found[0][1] if found else 0.0


def histogram_quantile(text: str, name: str, quantile: float, **labels: str) -> float:
    """Upper bound of the bucket holding ``quantile`` of a histogram's observations."""
    buckets = sorted((float(found["le"]), count) for found, count in samples(text, name, **labels))
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= quantile * total)


# ------------------------------------------------------------------------------ servers


@contextlib.contextmanager
def textenc_server(tmp_path: Path, **variables: str) -> Iterator[Running]:
    port = free_port()
    env = batchserve_environment(port, BATCHSERVE_MODEL_NAME="textenc", **variables)
    url = f"http://127.0.0.1:{port}"
    with running([str(BATCHSERVE), "serve"], url, tmp_path / "server.log", env) as server:
        wait_for(lambda: answers(url + "/readyz"), "ready", server, timeout_s=120)
        yield server


def port_of(server: Running) -> int:
    return int(server.url.rsplit(":", 1)[1])


# ------------------------------------------------------------------------------ tests


def test_a_flood_gets_fast_429s_the_rest_200_and_memory_stays_bounded(tmp_path: Path) -> None:
    bodies = token_bodies(16, TOKENS_PER_REQUEST)
    with textenc_server(
        tmp_path,
        BATCHSERVE_MAX_QUEUE_SIZE=str(FLOOD_QUEUE_SIZE),
        # Four 512-token rows per forward pass: a batch takes tens to hundreds of ms here.
        BATCHSERVE_MAX_BATCH_TOKENS=str(4 * TOKENS_PER_REQUEST),
        # Long enough that an accepted request is never answered 504 in this test.
        BATCHSERVE_REQUEST_TIMEOUT_MS="120000",
        # Every worker resends each 429 at once: the refusal path itself is measured here,
        # unheld (the hold of such clients: test_a_client_resending_before_retry_after...).
        BATCHSERVE_REFUSAL_HOLD_MS="0",
    ) as server:
        # Full batches first, so the baseline includes the allocator's working set for them
        # (about 90 MiB): the growth measured is then the flood's own.
        warm_up = asyncio.run(flood(port_of(server), bodies, total=32, connections=8))
        assert [answer.status for answer in warm_up.answers] == [200] * 32, warm_up.errors
        rss_before = value(scrape(server), "batchserve_process_resident_memory_bytes")

        result = asyncio.run(flood(port_of(server), bodies, FLOOD_REQUESTS, FLOOD_CONNECTIONS))

        after = scrape(server)
        rss_after = value(after, "batchserve_process_resident_memory_bytes")
        ok, refused = result.of_status(200), result.of_status(429)
        ok_p50_s = statistics.median(answer.latency_s for answer in ok)
        refused_p50_s = statistics.median(answer.latency_s for answer in refused)
        server_refused_p50_s = histogram_quantile(
            after, "batchserve_request_duration_seconds_bucket", 0.5, route="/predict", status="429"
        )
        print(
            f"\nflood: {len(result.answers)} answers in {result.duration_s:.1f} s from "
            f"{FLOOD_CONNECTIONS} connections: {len(ok)} x 200, {len(refused)} x 429, "
            f"{len(result.errors)} errors\n"
            f"latency p50: 200 {ok_p50_s * 1000:.1f} ms, 429 {refused_p50_s * 1000:.1f} ms "
            f"(client side), 429 <= {server_refused_p50_s * 1000:.1f} ms (server histogram)\n"
            f"RSS: {rss_before / 2**20:.1f} MiB before, {rss_after / 2**20:.1f} MiB after, "
            f"growth {(rss_after - rss_before) / 2**20:+.1f} MiB "
            f"(bound {RSS_GROWTH_BOUND_BYTES / 2**20:.0f} MiB)"
        )

        assert result.errors == [], result.errors[:5]
        assert len(result.answers) == FLOOD_REQUESTS
        assert sorted({answer.status for answer in result.answers}) == [200, 429]
        assert len(ok) >= FLOOD_QUEUE_SIZE
        for answer in refused:
            assert int(answer.headers["retry-after"]) >= 1
            error = json.loads(answer.body)["error"]
            assert error["code"] == "queue_full"
            assert error["request_id"] == answer.headers["x-request-id"]
        for answer in ok:
            assert len(json.loads(answer.body)["predictions"][0]) == 256
        assert refused_p50_s < ok_p50_s / 5, "429s must be answered at once, not after a wait"
        assert server_refused_p50_s <= 0.025
        assert value(after, "batchserve_dropped_requests_total", reason="queue_full") == len(
            refused
        )
        assert value(after, "batchserve_queue_depth") == 0
        assert value(after, "batchserve_in_flight_requests") == 0
        assert rss_after - rss_before < RSS_GROWTH_BOUND_BYTES

        assert answers(server.url + "/readyz")
        still = asyncio.run(flood(port_of(server), bodies, total=2, connections=1))
        assert [answer.status for answer in still.answers] == [200, 200]

        # A huge declared Content-Length is refused from the headers, without waiting for a
        # body that will never come; and no Server banner is sent.
        with socket.create_connection(("127.0.0.1", port_of(server)), timeout=5) as raw:
            started_s = time.monotonic()
            raw.sendall(
                b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n{"
            )
            head = raw.recv(65536).decode("latin-1")
            assert head.startswith("HTTP/1.1 413"), head
            assert time.monotonic() - started_s < 2.0
            assert "\r\nserver:" not in head.lower()


def test_a_request_that_cannot_finish_by_its_deadline_is_refused_at_once(
    tmp_path: Path,
) -> None:
    """16 rows of 512 tokens take seconds on one CPU thread (the warm-up measured 512-token
    rows): with a 300 ms deadline they were computed for nobody and answered 504; now they
    are refused at once, 422, and never reach the model."""
    (too_much,) = token_bodies(1, TOKENS_PER_REQUEST, rows=16)
    with textenc_server(tmp_path, BATCHSERVE_REQUEST_TIMEOUT_MS=str(DEADLINE_MS)) as server:
        started_s = time.monotonic()
        response = httpx.post(
            server.url + "/predict", content=too_much, headers=JSON_HEADERS, timeout=10
        )
        assert time.monotonic() - started_s < DEADLINE_MS / 1000
        assert response.status_code == 422, response.text
        assert "send fewer instances" in response.json()["error"]["message"]
        metrics = scrape(server)
        assert value(metrics, "batchserve_batch_size_rows_count") == 0
        dropped = value(metrics, "batchserve_dropped_requests_total", reason="deadline_unreachable")
        assert dropped == 1


def test_a_queued_request_gets_504_at_its_deadline_while_a_batch_runs_past_its_estimate(
    tmp_path: Path,
) -> None:
    """A batch that runs far longer than its warm-up said holds the device; the request
    queued behind it is answered 504 at its deadline, not when the batch ends, and is never
    computed. The running request itself is answered 504 at its deadline too."""
    gate = tmp_path / "hold"
    gate.touch()
    package_hanging_model(tmp_path / "models", gate)
    port = free_port()
    env = batchserve_environment(
        port,
        BATCHSERVE_MODEL_REPOSITORY=str(tmp_path / "models"),
        BATCHSERVE_MODEL_NAME="hangs",
        BATCHSERVE_WARMUP_BATCH_SIZES="1",
        BATCHSERVE_REQUEST_TIMEOUT_MS=str(DEADLINE_MS),
        PYTHONPATH=str(REPOSITORY_ROOT),  # the model's architecture is in tests/
    )
    blocker_body = json.dumps({"instances": [[HANG_VALUE] * FEATURES]}).encode()
    probe_body = json.dumps({"instances": [[1.0] * FEATURES]}).encode()
    url = f"http://127.0.0.1:{port}"
    with running([str(BATCHSERVE), "serve"], url, tmp_path / "server.log", env) as server:
        wait_for(lambda: answers(url + "/readyz"), "ready", server)

        async def scenario() -> tuple[Answer, Answer, str]:
            blocker_connection = HttpConnection("127.0.0.1", port)
            probe_connection = HttpConnection("127.0.0.1", port)
            blocker = asyncio.create_task(post(blocker_connection, blocker_body))
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
                started_s = time.monotonic()
                while time.monotonic() - started_s < 10:  # until the blocker's batch started
                    metrics = (await http.get("/metrics")).text
                    if value(metrics, "batchserve_batch_size_rows_count") >= 1:
                        break
                    await asyncio.sleep(0.01)
                probe = await post(probe_connection, probe_body)
                during = (await http.get("/metrics")).text
            blocked = await blocker
            await blocker_connection.close()
            await probe_connection.close()
            return blocked, probe, during

        blocked, probe, during = asyncio.run(scenario())
        print(
            f"\ndeadline {DEADLINE_MS} ms: queued request answered {probe.status} after "
            f"{probe.latency_s * 1000:.0f} ms; running request answered {blocked.status} after "
            f"{blocked.latency_s * 1000:.0f} ms"
        )
        deadline_s = DEADLINE_MS / 1000
        assert blocked.status == 504, blocked.body
        assert deadline_s - 0.01 <= blocked.latency_s <= deadline_s + DEADLINE_SLACK_S
        assert probe.status == 504, probe.body
        assert json.loads(probe.body)["error"]["code"] == "deadline_exceeded"
        assert probe.latency_s <= deadline_s + DEADLINE_SLACK_S
        # Both 504s were sent while the batch was still running.
        assert value(during, "batchserve_inference_duration_seconds_count") == 0
        gate.unlink()
        wait_for(
            lambda: value(scrape(server), "batchserve_inference_duration_seconds_count") >= 1,
            "done with the long batch",
            server,
        )

        def probe_dropped() -> bool:
            """The probe left the queue without running: nothing is left to start a batch."""
            metrics = scrape(server)
            dropped = sum(
                count for _, count in samples(metrics, "batchserve_dropped_requests_total")
            )
            return dropped >= 1 and value(metrics, "batchserve_queue_depth") == 0

        wait_for(probe_dropped, "the probe dropped from the queue", server)
        after = scrape(server)
        assert value(after, "batchserve_batch_size_rows_count") == 1
        assert value(after, "batchserve_batch_size_rows_sum") == 1  # the probe never ran
        # The server's own view of both 504s: answered after their deadlines, by less than
        # the client saw (the client's clock also counts the HTTP round trip).
        assert value(after, "batchserve_deadline_overrun_seconds_count") == 2
        overrun_s = value(after, "batchserve_deadline_overrun_seconds_sum")
        client_overrun_s = blocked.latency_s + probe.latency_s - 2 * deadline_s
        assert 0 <= overrun_s <= max(0.0, client_overrun_s) + 0.02
        assert answers(server.url + "/readyz")


def test_a_client_resending_before_retry_after_is_held_until_it_passes(tmp_path: Path) -> None:
    """Issue 23, finding 4: clients that resend every 429 at once made a storm of refusals
    that took the forward's CPU. A connection's first 429 is answered at once; the next one
    it asks for before its ``Retry-After`` (1 s) has passed waits until most of it has;
    another connection's first 429 is still answered at once."""
    gate = tmp_path / "hold"
    gate.touch()
    package_hanging_model(tmp_path / "models", gate)
    port = free_port()
    env = batchserve_environment(
        port,
        BATCHSERVE_MODEL_REPOSITORY=str(tmp_path / "models"),
        BATCHSERVE_MODEL_NAME="hangs",
        BATCHSERVE_WARMUP_BATCH_SIZES="1",
        BATCHSERVE_MAX_QUEUE_SIZE="1",
        BATCHSERVE_MAX_INSTANCES_PER_REQUEST="64",
        BATCHSERVE_REQUEST_TIMEOUT_MS="60000",
        PYTHONPATH=str(REPOSITORY_ROOT),  # the model's architecture is in tests/
    )
    blocker_body = json.dumps({"instances": [[HANG_VALUE] * FEATURES]}).encode()
    body = json.dumps({"instances": [[1.0] * FEATURES]}).encode()
    url = f"http://127.0.0.1:{port}"
    with running([str(BATCHSERVE), "serve"], url, tmp_path / "server.log", env) as server:
        wait_for(lambda: answers(url + "/readyz"), "ready", server)

        async def scenario() -> tuple[list[Answer], Answer]:
            blocker, queued, greedy, other = (HttpConnection("127.0.0.1", port) for _ in range(4))
            running_batch = asyncio.create_task(post(blocker, blocker_body))
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                started_s = time.monotonic()
                while time.monotonic() - started_s < 10:  # the blocker's batch has started
                    metrics = (await http.get("/metrics")).text
                    if value(metrics, "batchserve_batch_size_rows_count") >= 1:
                        break
                    await asyncio.sleep(0.01)
            waiting = asyncio.create_task(post(queued, body))
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                started_s = time.monotonic()
                while time.monotonic() - started_s < 10:  # the queue is full now
                    metrics = (await http.get("/metrics")).text
                    if value(metrics, "batchserve_queue_depth") >= 1:
                        break
                    await asyncio.sleep(0.01)
            refusals = [await post(greedy, body) for _ in range(3)]  # resent at once
            first_of_other = await post(other, body)
            gate.unlink()
            await asyncio.gather(running_batch, waiting)
            for connection in (blocker, queued, greedy, other):
                await connection.close()
            return refusals, first_of_other

        refusals, first_of_other = asyncio.run(scenario())
        print("\nrefusals resent at once: " + ", ".join(
            f"{r.status} after {r.latency_s * 1000:.0f} ms" for r in refusals))  # fmt: skip
        assert [answer.status for answer in refusals] == [429, 429, 429]
        assert refusals[0].latency_s < 0.5
        for held in refusals[1:]:
            assert held.latency_s >= 0.45  # half its Retry-After of 1 s, at least
            assert held.headers["retry-after"] == "1"
        assert first_of_other.status == 429
        assert first_of_other.latency_s < 0.5
