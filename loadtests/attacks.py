"""Attacks on a real ``batchserve serve``, each measured against the same server unattacked.

- ``goodput``: ``textenc`` at 512 tokens per request, ``max_queue_size`` 8 and a 300 ms
  deadline, closed-loop clients at 1, 4 and 64: requests answered 200 per second (goodput),
  and how late each 504 came after its deadline. Clients send their next request as soon as
  they have an answer, 429 included: the harshest client there is. Once with the engine in
  the HTTP process (``engine_mode=in_process``, the default at one worker) and once in its
  own process (``engine_mode=process``). ``--protocol grpc``: the same over gRPC
  ``ModelInfer``, a connection per client.
- ``recovery``: after the 64-client storm of ``goodput``, one client sends a request every
  100 ms: how soon it is answered 200 again, and what it was answered meanwhile (a stale
  duration estimate refused such requests 422 for up to 30 s).
- ``fairness``: two clients keep the 512-token bucket full (32 x 512 tokens per request, one
  full batch each) while a third sends 3-token requests: their latency beside the long bucket
  against alone, and the long requests' rows per second.
- ``slow-uploads``: 8 connections send half a body and stall; a lone client's latency beside
  them against alone.
- ``headers``: a 1 MiB header, and connections offering a 100 MB header each: the status,
  how much the client got to send before the answer, and the server's resident memory.
- ``slowloris``: 200 connections that send half a request line, and 20 that trickle a header
  a byte a second: how many are still open after a while, and a lone client's latency beside
  them against alone.
- ``handler-bomb``: single costly requests to handler models (many maximal-pixel PNGs, the
  most pixels one request may declare, a 2 MB text) while a probe asks ``/healthz`` and
  another model: the probe's latency during each request against the server idle.

Every server runs on a free 127.0.0.1 port with one torch thread; every loop is bounded in
time and count. Writes a Markdown report to stdout.

    python -m loadtests.attacks                       # all seven, about 7 minutes
    python -m loadtests.attacks --scenario fairness --duration-s 20
    python -m loadtests.attacks --scenario goodput --clients 1,64 --engine-mode in_process \
        --set BATCHSERVE_REFUSAL_HOLD_MS=0            # a setting changed on every server
    python -m loadtests.attacks --scenario goodput --clients 1,64 --protocol grpc
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np
from PIL import Image

from loadtests import servers
from loadtests.soak import HttpConnection

T = TypeVar("T")
JSON_HEADERS = {"Content-Type": "application/json"}
OVERRUN = "batchserve_deadline_overrun_seconds"
LOOP_LAG = "batchserve_event_loop_lag_seconds"
GOODPUT_CLIENTS = (1, 4, 64)
ENGINE_MODES = ("in_process", "process")
PROTOCOLS = ("http", "grpc")
DEADLINE_MS = 300
#: A 504 the client saw later than this after its deadline is looked into (the goal: 20 ms).
LATE_504_MS = 20.0
SLOW_UPLOADS = 8
SCENARIOS = [
    "goodput",
    "recovery",
    "fairness",
    "slow-uploads",
    "headers",
    "slowloris",
    "handler-bomb",
]
#: Settings every server of a run gets (``--set``), over each scenario's own.
EXTRA_SETTINGS: dict[str, str] = {}
#: Bounds of every loop: requests per client and seconds per measurement.
MAX_REQUESTS_PER_CLIENT = 100_000


@dataclass(frozen=True)
class Outcome:
    status: int | str
    latency_s: float
    sent_s: float = 0.0
    #: The first request of its client: its latency includes opening the connection.
    first: bool = False


def token_body(rng: np.random.Generator, rows: int, length: int) -> bytes:
    ids = rng.integers(1, 1000, size=(rows, length)).tolist()
    return json.dumps({"instances": ids}).encode()


@contextmanager
def server(settings: Mapping[str, str], scratch: Path, name: str) -> Iterator[tuple[str, int]]:
    with server_process(settings, scratch, name) as (host, port, _):
        yield host, port


@contextmanager
def server_process(
    settings: Mapping[str, str], scratch: Path, name: str
) -> Iterator[tuple[str, int, int]]:
    """A server's host, port and process id."""
    env = servers.server_env(
        {
            "BATCHSERVE_DEVICE": "cpu",
            "BATCHSERVE_TORCH_THREADS": "1",
            "BATCHSERVE_LOG_LEVEL": "warning",
            **settings,
            **EXTRA_SETTINGS,
        }
    )
    log = scratch / f"{name}.log"
    with servers.serving(servers.batchserve_command(), env, log, ready_timeout_s=180) as running:
        parts = urlsplit(running.url)
        assert parts.hostname is not None
        assert parts.port is not None
        yield parts.hostname, parts.port, running.pid


async def closed_loop(
    host: str, port: int, body: bytes, clients: int, duration_s: float
) -> tuple[list[Outcome], float]:
    """``clients`` connections, each sending ``body`` again as soon as it has an answer."""
    outcomes: list[Outcome] = []
    started_s = time.monotonic()

    async def client() -> None:
        connection = HttpConnection(host, port)
        try:
            for index in range(MAX_REQUESTS_PER_CLIENT):
                if time.monotonic() - started_s >= duration_s:
                    return
                sent_s = time.monotonic()
                try:
                    response = await connection.request("POST", "/predict", body, JSON_HEADERS)
                    status: int | str = response.status
                except (OSError, asyncio.IncompleteReadError) as error:
                    status = type(error).__name__
                outcomes.append(Outcome(status, time.monotonic() - sent_s, sent_s, index == 0))
        finally:
            await connection.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes, time.monotonic() - started_s


#: gRPC statuses by the HTTP status the server maps them from, so the goodput table reads
#: alike for both protocols.
GRPC_AS_HTTP = {"OK": 200, "RESOURCE_EXHAUSTED": 429, "DEADLINE_EXCEEDED": 504, "UNAVAILABLE": 503}


async def grpc_closed_loop(
    address: str, request: bytes, clients: int, duration_s: float
) -> tuple[list[Outcome], float]:
    """``closed_loop`` over gRPC ``ModelInfer``: each client a channel, and so a connection, of
    its own (channels to one address in a process share one unless told not to, and the
    server holds refusals per connection), ``RESOURCE_EXHAUSTED`` included."""
    # Imported here: the server's protocol module and tritonclient's (which the tests of this
    # harness sit beside) define the same protobuf symbols, and one process cannot hold both.
    import grpc

    from service.frontend.oip.proto import grpc_predict_v2_pb2 as pb
    from service.frontend.oip.proto import grpc_predict_v2_pb2_grpc as pb_grpc

    outcomes: list[Outcome] = []
    started_s = time.monotonic()
    message = pb.ModelInferRequest.FromString(request)

    async def client() -> None:
        own_connection = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(address, own_connection) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            for _ in range(MAX_REQUESTS_PER_CLIENT):
                if time.monotonic() - started_s >= duration_s:
                    return
                sent_s = time.monotonic()
                code = await stub.ModelInfer(message).code()
                status: int | str = GRPC_AS_HTTP.get(code.name, code.name)
                outcomes.append(Outcome(status, time.monotonic() - sent_s, sent_s))

    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes, time.monotonic() - started_s


async def loop_lags(work: Awaitable[T]) -> tuple[T, list[tuple[float, float]]]:
    """``work``'s result, and how far this event loop fell behind a 1 ms ticker meanwhile:
    (when the tick started, its lag), every tick. A load generator late to read an answer
    adds its lag to the latency it measures."""
    lags: list[tuple[float, float]] = []
    task = asyncio.ensure_future(work)
    while not task.done():
        ticked_s = time.monotonic()
        await asyncio.wait([task], timeout=0.001)
        lags.append((ticked_s, max(0.0, time.monotonic() - ticked_s - 0.001)))
    return task.result(), lags


def lag_during_s(lags: Sequence[tuple[float, float]], start_s: float, end_s: float) -> float:
    """The largest lag of a tick that overlapped ``start_s`` to ``end_s`` (``loop_lags``)."""
    return max(
        (lag for ticked_s, lag in lags if ticked_s <= end_s and ticked_s + 0.001 + lag >= start_s),
        default=0.0,
    )


def late_504s(
    point: str, outcomes: Sequence[Outcome], lags: Sequence[tuple[float, float]]
) -> list[str]:
    """A line for each 504 the client saw over ``LATE_504_MS`` after its deadline: how much of
    it was the load generator's own loop lag (its send, its read of the answer). The server
    starts a deadline once it has read the request's headers, so the rest is time before the
    server read the request: its loop busy, or waiting for a core."""
    lines = []
    for outcome in outcomes:
        late_s = outcome.latency_s - DEADLINE_MS / 1000
        if outcome.status != 504 or late_s * 1000 <= LATE_504_MS:
            continue
        generator_s = lag_during_s(lags, outcome.sent_s, outcome.sent_s + outcome.latency_s)
        opened = " (its connection opened)" if outcome.first else ""
        lines.append(
            f"- {point}: a 504 {late_s * 1000:.1f} ms late{opened}; the load generator's lag "
            f"{generator_s * 1000:.1f} ms, the server's side {(late_s - generator_s) * 1000:.1f} ms"
        )
    return lines


def percentile_ms(values: Sequence[float], quantile: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(values, quantile)) * 1000


# --------------------------------------------------------------------------- goodput


def token_ids_of(body: bytes) -> list[int]:
    """The token ids of a one-row ``token_body``."""
    ids: list[int] = json.loads(body)["instances"][0]
    return ids


def grpc_token_request(ids: Sequence[int]) -> bytes:
    """A serialized ``ModelInferRequest`` of one row of ``ids`` (``token_ids``, INT64)."""
    from service.frontend.oip.proto import grpc_predict_v2_pb2 as pb  # see grpc_closed_loop

    request = pb.ModelInferRequest(model_name="textenc")
    request.inputs.add(name="token_ids", datatype="INT64", shape=[1, len(ids)])
    request.raw_input_contents.append(b"".join(t.to_bytes(8, "little") for t in ids))
    return request.SerializeToString()


#: What a closed loop gives: every answer, and the seconds it ran.
LoadResult = tuple[list["Outcome"], float]


@dataclass(frozen=True)
class LoadTarget:
    """Where the goodput attack's clients send, and what, over HTTP or gRPC."""

    protocol: str
    host: str
    port: int
    grpc_port: int
    body: bytes
    ids: Sequence[int]

    def load(self, clients: int, duration_s: float) -> Coroutine[Any, Any, LoadResult]:
        if self.protocol == "grpc":
            address = f"{self.host}:{self.grpc_port}"
            return grpc_closed_loop(address, grpc_token_request(self.ids), clients, duration_s)
        return closed_loop(self.host, self.port, self.body, clients, duration_s)


def goodput_settings(engine_mode: str) -> dict[str, str]:
    return {
        "BATCHSERVE_MODEL_NAME": "textenc",
        "BATCHSERVE_MAX_QUEUE_SIZE": "8",
        "BATCHSERVE_MAX_INSTANCES_PER_REQUEST": "64",
        "BATCHSERVE_REQUEST_TIMEOUT_MS": str(DEADLINE_MS),
        "BATCHSERVE_ENGINE_MODE": engine_mode,
    }


def goodput(
    scratch: Path,
    duration_s: float,
    clients_list: Sequence[int] = GOODPUT_CLIENTS,
    engine_modes: Sequence[str] = ENGINE_MODES,
    tokens: int = 512,
    protocol: str = "http",
) -> list[str]:
    rng = np.random.default_rng(0)
    body = token_body(rng, 1, tokens)
    ids = [int(token) for token in token_ids_of(body)]
    lines = [
        "## Goodput under overload" + (" (gRPC)" if protocol == "grpc" else ""),
        "",
        f"`textenc`, {tokens} tokens per request, `max_queue_size=8`, deadline {DEADLINE_MS} ms; "
        f"closed loop for {duration_s:.0f} s per point, the next request sent as soon as an "
        "answer (429 included) arrives.",
        "",
        "| engine | clients | 200/s | vs 1 client | answers by status | dropped by reason "
        "| 504 after deadline p50 / max (less the load generator's lag) ms "
        "| server: p50 / max ≤ ms | server loop lag ≤ ms | load generator lag ms |",
        "| --- | --: | --: | --: | --- | --- | --- | --- | --- | --: |",
    ]
    for engine_mode in engine_modes:
        settings = goodput_settings(engine_mode)
        grpc_port = servers.free_port()
        if protocol == "grpc":
            settings["BATCHSERVE_GRPC_PORT"] = str(grpc_port)
        late_lines: list[str] = []
        with server(settings, scratch, f"goodput-{engine_mode}") as (host, port):
            target = LoadTarget(protocol, host, port, grpc_port, body, ids)
            asyncio.run(target.load(1, 2.0))  # warm-up
            one_client = None
            for clients in clients_list:
                url = f"http://{host}:{port}"
                dropped_before = servers.dropped_by_reason(url)
                overrun_before = servers.histogram_buckets(url, OVERRUN)
                loop_lag_before = servers.histogram_buckets(url, LOOP_LAG)
                (outcomes, elapsed_s), lags = asyncio.run(
                    loop_lags(target.load(clients, duration_s))
                )
                late_lines += late_504s(f"{engine_mode}, {clients} clients", outcomes, lags)
                lag_s = max((lag for _, lag in lags), default=0.0)
                dropped_after = servers.dropped_by_reason(url)
                overrun_after = servers.histogram_buckets(url, OVERRUN)
                server_lag = servers.bucket_bound(
                    loop_lag_before, servers.histogram_buckets(url, LOOP_LAG), 1.0
                )
                server_late = " / ".join(
                    "-" if bound is None else f"{bound * 1000:g}"
                    for bound in (
                        servers.bucket_bound(overrun_before, overrun_after, quantile)
                        for quantile in (0.5, 1.0)
                    )
                )
                dropped = ", ".join(
                    f"{reason} {count - dropped_before.get(reason, 0.0):.0f}"
                    for reason, count in sorted(dropped_after.items())
                    if count > dropped_before.get(reason, 0.0)
                )
                ok_per_s = sum(o.status == 200 for o in outcomes) / elapsed_s
                one_client = one_client or ok_per_s or float("nan")
                late = [o.latency_s - DEADLINE_MS / 1000 for o in outcomes if o.status == 504]
                beyond_lag = [
                    o.latency_s
                    - DEADLINE_MS / 1000
                    - lag_during_s(lags, o.sent_s, o.sent_s + o.latency_s)
                    for o in outcomes
                    if o.status == 504
                ]
                statuses = ", ".join(f"{s}: {n}" for s, n in sorted(Counter(
                    str(o.status) for o in outcomes).items()))  # fmt: skip
                lateness = (
                    f"{percentile_ms(late, 50):.1f} / {max(late) * 1000:.1f}"
                    f" ({max(beyond_lag) * 1000:.1f})"
                    if late
                    else "no 504"
                )
                lines.append(
                    f"| {engine_mode} | {clients} | {ok_per_s:.1f} | {ok_per_s / one_client:.2f}x"
                    f" | {statuses} | {dropped or '-'} | {lateness} | {server_late}"
                    f" | {'-' if server_lag is None else f'{server_lag * 1000:g}'}"
                    f" | {lag_s * 1000:.1f} |"
                )
    lines += ["", *late_lines] if late_lines else []
    lines += [
        "",
        "A 504 before the deadline (negative) is a request the batcher found could not finish "
        "in time even alone, answered at once rather than computed for nobody. The server's "
        "own lateness (`batchserve_deadline_overrun_seconds`, when its front end had the "
        "engine's 504) is the bucket edge that holds the median and the latest; the load "
        "generator's lag is the most its own event loop fell behind a 1 ms ticker: a client "
        "late to read its answer measures that much more; the server's loop lag "
        "(`batchserve_event_loop_lag_seconds`, largest bucket) is the same of its front end's "
        "loop, sampled every 100 ms. In brackets: the latest 504 less "
        "the largest lag of the load generator's loop while that request was out. "
        f"Load average at the end: {os.getloadavg()[0]:.2f}.",
    ]
    return lines


# --------------------------------------------------------------------------- recovery


async def lone_statuses(
    host: str, port: int, body: bytes, duration_s: float
) -> list[tuple[float, int]]:
    """One client, a request every 100 ms for ``duration_s``: (seconds from the start, status)."""
    connection = HttpConnection(host, port)
    started_s = time.monotonic()
    answers = []
    try:
        while time.monotonic() - started_s < duration_s:
            sent_s = time.monotonic()
            response = await connection.request("POST", "/predict", body, JSON_HEADERS)
            answers.append((sent_s - started_s, response.status))
            await asyncio.sleep(0.1)
    finally:
        await connection.close()
    return answers


def recovery(
    scratch: Path, duration_s: float, engine_modes: Sequence[str], tokens: int = 512
) -> list[str]:
    rng = np.random.default_rng(0)
    body = token_body(rng, 1, tokens)
    lines = [
        "## Recovery after the storm",
        "",
        f"The `goodput` server, {tokens} tokens per request; 64 clients resend at once for "
        f"{duration_s:.0f} s, then one client sends a request every 100 ms for 10 s: when its "
        "requests are answered 200 again, and what it was answered meanwhile.",
        "",
        "| engine | storm 200/s | first 200 after the storm, s | 200 in the next 10 s "
        "| the lone client's answers by status |",
        "| --- | --: | --: | --: | --- |",
    ]
    for engine_mode in engine_modes:
        with server(goodput_settings(engine_mode), scratch, f"recovery-{engine_mode}") as (
            host,
            port,
        ):
            asyncio.run(closed_loop(host, port, body, 1, 2.0))  # warm-up
            storm, elapsed_s = asyncio.run(closed_loop(host, port, body, 64, duration_s))
            answers = asyncio.run(lone_statuses(host, port, body, 10.0))
        first_ok = next((at_s for at_s, status in answers if status == 200), None)
        statuses = ", ".join(
            f"{s}: {n}" for s, n in sorted(Counter(str(s) for _, s in answers).items())
        )
        lines.append(
            f"| {engine_mode} | {sum(o.status == 200 for o in storm) / elapsed_s:.1f} | "
            f"{'never' if first_ok is None else f'{first_ok:.1f}'} | "
            f"{sum(s == 200 for _, s in answers)} of {len(answers)} | {statuses} |"
        )
    return lines


# --------------------------------------------------------------------------- fairness


async def short_requests(host: str, port: int, body: bytes, count: int) -> list[Outcome]:
    """``count`` short requests one after another, 100 ms apart."""
    connection = HttpConnection(host, port)
    outcomes = []
    try:
        for _ in range(count):
            sent_s = time.monotonic()
            response = await connection.request("POST", "/predict", body, JSON_HEADERS)
            outcomes.append(Outcome(response.status, time.monotonic() - sent_s))
            await asyncio.sleep(0.1)
    finally:
        await connection.close()
    return outcomes


async def shorts_beside_longs(
    host: str, port: int, short: bytes, long: bytes, count: int, duration_s: float
) -> tuple[list[Outcome], list[Outcome], float]:
    """The short requests while two clients send long ones for ``duration_s``: the shorts'
    outcomes, the longs' and how long the longs ran."""
    longs = asyncio.create_task(closed_loop(host, port, long, 2, duration_s))
    await asyncio.sleep(1.0)  # the long bucket is full
    shorts = await short_requests(host, port, short, count)
    long_outcomes, elapsed_s = await longs
    return shorts, long_outcomes, elapsed_s


def fairness(scratch: Path, count: int, duration_s: float) -> list[str]:
    rng = np.random.default_rng(0)
    short = token_body(rng, 1, 3)
    long = token_body(rng, 32, 512)
    with server({"BATCHSERVE_MODEL_NAME": "textenc"}, scratch, "fairness") as (host, port):
        alone = asyncio.run(short_requests(host, port, short, count))
        longs_alone, alone_s = asyncio.run(closed_loop(host, port, long, 2, duration_s))
        beside, longs_beside, beside_s = asyncio.run(
            shorts_beside_longs(host, port, short, long, count, duration_s)
        )
    lines = [
        "## Fairness: short requests beside a full long bucket",
        "",
        f"`textenc` defaults; {count} requests of 3 tokens, 100 ms apart, alone and while two "
        "clients keep the 512-token bucket full (32 x 512 tokens per request: one full batch "
        f"each at `max_batch_tokens`) for {duration_s:.0f} s.",
        "",
        "| short requests | answered 200 | p50 ms | p99 ms | max ms |",
        "| --- | --: | --: | --: | --: |",
    ]
    for label, outcomes in (("alone", alone), ("beside the long bucket", beside)):
        latencies = [o.latency_s for o in outcomes if o.status == 200]
        lines.append(
            f"| {label} | {len(latencies)} of {len(outcomes)} | "
            f"{percentile_ms(latencies, 50):.1f} | {percentile_ms(latencies, 99):.1f} | "
            f"{max(latencies, default=float('nan')) * 1000:.1f} |"
        )
    rows_alone = 32 * sum(o.status == 200 for o in longs_alone) / alone_s
    rows_beside = 32 * sum(o.status == 200 for o in longs_beside) / beside_s
    lines += [
        "",
        f"Long requests (two clients, 32 x 512 tokens each): {rows_alone:.1f} rows/s alone, "
        f"{rows_beside:.1f} rows/s beside the short ones (requests answered whole; one in "
        "flight per client at the end is not counted). Load average at the end: "
        f"{os.getloadavg()[0]:.2f}.",
    ]
    return lines


# --------------------------------------------------------------------------- slow uploads


async def stalled_upload(host: str, port: int, body: bytes, stop: asyncio.Event) -> int:
    """Send half a body and stall; when the server gives up on it, start again. Returns how
    many times the server closed such a connection."""
    closed = 0
    while not stop.is_set():
        reader, writer = await asyncio.open_connection(host, port)
        head = (
            f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        writer.write(head + body[: len(body) // 2])
        await writer.drain()
        read = asyncio.create_task(reader.read())
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for task in (read, stopped):
            task.cancel()
        closed += read in done
        writer.close()
    return closed


async def lone_beside_uploads(
    host: str, port: int, body: bytes, count: int, uploads: int
) -> tuple[list[Outcome], int]:
    stop = asyncio.Event()
    stalled = [asyncio.create_task(stalled_upload(host, port, body, stop)) for _ in range(uploads)]
    await asyncio.sleep(0.5)
    lone = await short_requests(host, port, body, count)
    stop.set()
    closed = sum(await asyncio.gather(*stalled))
    return lone, closed


def slow_uploads(scratch: Path, count: int) -> list[str]:
    digit = json.dumps({"instances": np.full((1, 8, 8), 0.5).tolist()}).encode()
    settings = {"BATCHSERVE_REQUEST_TIMEOUT_MS": "2000"}
    with server(settings, scratch, "slow-uploads") as (host, port):
        alone = asyncio.run(short_requests(host, port, digit, count))
        beside, closed = asyncio.run(lone_beside_uploads(host, port, digit, count, SLOW_UPLOADS))
    p50_alone = statistics.median(o.latency_s for o in alone) * 1000
    p50_beside = statistics.median(o.latency_s for o in beside) * 1000
    return [
        "## Slow uploads",
        "",
        f"`digits`, deadline 2 s; {count} requests one after another, 100 ms apart, alone and "
        f"beside {SLOW_UPLOADS} connections that send half a body and stall (when the server "
        "answers one 408 and closes it, it starts again).",
        "",
        "| lone client | answered 200 | p50 ms | p99 ms |",
        "| --- | --: | --: | --: |",
        f"| alone | {sum(o.status == 200 for o in alone)} of {len(alone)} | {p50_alone:.2f} | "
        f"{percentile_ms([o.latency_s for o in alone], 99):.2f} |",
        f"| beside {SLOW_UPLOADS} stalled uploads | {sum(o.status == 200 for o in beside)} of "
        f"{len(beside)} | {p50_beside:.2f} | "
        f"{percentile_ms([o.latency_s for o in beside], 99):.2f} |",
        "",
        f"p50 beside / alone: {p50_beside / p50_alone:.2f}; stalled connections the server "
        f"closed (408): {closed}.",
    ]


# ------------------------------------------------- headers, slowloris, handler bombs

DIGIT = json.dumps({"instances": np.full((1, 8, 8), 0.5).tolist()}).encode()
#: The probe's goal while any one request is preprocessed.
PROBE_GOAL_MS = 250.0


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def offer_header(host: str, port: int, header_bytes: int) -> tuple[str, int, float]:
    """Send a request whose one header is ``header_bytes`` long; the status answered, the bytes
    sent before it came (or the connection broke), and the seconds it took."""
    reader, writer = await asyncio.open_connection(host, port)
    answered = asyncio.create_task(reader.read(4096))  # the first bytes of an answer
    started_s = time.monotonic()
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
    sent, chunk = 0, b"a" * 65536
    try:
        while sent < header_bytes and not answered.done():
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
        if not answered.done():
            writer.write(b"\r\n\r\n")
    except OSError:
        pass
    try:
        answer = await asyncio.wait_for(answered, timeout=30.0)
    except (OSError, TimeoutError) as error:
        answer = type(error).__name__.encode()
    writer.close()
    status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else answer.decode()
    return status or "closed", sent, time.monotonic() - started_s


def headers(scratch: Path) -> list[str]:
    lines = [
        "## Huge headers",
        "",
        "`digits`, one process, default limits; `GET /healthz` with one header of the size "
        "offered. Bytes sent: what the client wrote before the answer came or the connection "
        "was closed.",
        "",
        "| offered | connections | statuses | bytes sent (max) | seconds (max) "
        "| server RSS before / after MB |",
        "| --: | --: | --- | --: | --: | --- |",
    ]
    with server_process({}, scratch, "headers") as (host, port, pid):
        for offered, connections in ((1 << 20, 1), (100 * 10**6, 4)):
            before = resident_mb(pid)

            async def attack(
                offered: int = offered, connections: int = connections
            ) -> list[tuple[str, int, float]]:
                return await asyncio.gather(
                    *(offer_header(host, port, offered) for _ in range(connections))
                )

            results = asyncio.run(attack())
            after = resident_mb(pid)
            statuses = ", ".join(sorted({status for status, _, _ in results}))
            lines.append(
                f"| {offered / 2**20:.0f} MiB | {connections} | {statuses} | "
                f"{max(sent for _, sent, _ in results):,} | "
                f"{max(seconds for _, _, seconds in results):.2f} | {before:.0f} / {after:.0f} |"
            )
    return lines


# --------------------------------------------------------------------------- slowloris


async def lone_latencies(host: str, port: int, count: int) -> list[float]:
    connection = HttpConnection(host, port)
    latencies = []
    try:
        for _ in range(count):
            sent_s = time.monotonic()
            response = await connection.request("POST", "/predict", DIGIT, JSON_HEADERS)
            if response.status == 200:
                latencies.append(time.monotonic() - sent_s)
            await asyncio.sleep(0.1)
    finally:
        await connection.close()
    return latencies


async def is_open(reader: asyncio.StreamReader) -> bool:
    """Whether the server still holds the connection: a closed one has its end of stream
    waiting (after any 408)."""
    try:
        await asyncio.wait_for(reader.read(), timeout=0.05)
    except TimeoutError:
        return True
    except OSError:
        return False
    return False


async def slowloris_attack(
    host: str, port: int, half_lines: int, tricklers: int, hold_s: float, count: int
) -> tuple[int, int, list[float]]:
    """Open the attack's connections, measure a lone client, and count after ``hold_s`` the
    connections the server has not closed."""
    opened = [await asyncio.open_connection(host, port) for _ in range(half_lines + tricklers)]
    for _, writer in opened[:half_lines]:
        writer.write(b"POST /predi")
    stop = asyncio.Event()

    async def trickle(writer: asyncio.StreamWriter) -> None:
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            if stop.is_set() or writer.is_closing():
                return
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except OSError:
                return
            await asyncio.sleep(1.0)

    trickling = [asyncio.create_task(trickle(writer)) for _, writer in opened[half_lines:]]
    started_s = time.monotonic()
    lone = await lone_latencies(host, port, count)
    await asyncio.sleep(max(0.0, hold_s - (time.monotonic() - started_s)))
    still_open = [await is_open(reader) for reader, _ in opened]
    stop.set()
    await asyncio.gather(*trickling)
    for _, writer in opened:
        writer.close()
    return sum(still_open[:half_lines]), sum(still_open[half_lines:]), lone


def slowloris(scratch: Path, count: int, hold_s: float = 8.0) -> list[str]:
    half_lines, tricklers = 200, 20
    with server_process({}, scratch, "slowloris") as (host, port, _):
        alone = asyncio.run(lone_latencies(host, port, count))
        open_half, open_trickling, beside = asyncio.run(
            slowloris_attack(host, port, half_lines, tricklers, hold_s, count)
        )
    return [
        "## Slowloris",
        "",
        f"`digits`, one process, default `header_timeout_s`; {half_lines} connections send half "
        f"a request line and wait, {tricklers} send a header a byte a second; after {hold_s:.0f} "
        "s, the connections the server still holds open. A lone client sends "
        f"{count} requests, 100 ms apart, alone and beside them.",
        "",
        "| still open after the hold | half request lines | trickled headers |",
        "| --- | --: | --: |",
        f"| {hold_s:.0f} s | {open_half} of {half_lines} | {open_trickling} of {tricklers} |",
        "",
        "| lone client | answered 200 | p50 ms | max ms |",
        "| --- | --: | --: | --: |",
        *(
            f"| {label} | {len(values)} of {count} | {statistics.median(values) * 1000:.2f} | "
            f"{max(values) * 1000:.2f} |"
            for label, values in (("alone", alone), ("beside the attack", beside))
            if values
        ),
    ]


# --------------------------------------------------------------------------- handler bombs


def bilevel_png(side: int) -> bytes:
    """A one-bit white square: a few KB that decode to ``side``² pixels."""
    buffer = io.BytesIO()
    Image.new("1", (side, side), 1).save(buffer, format="PNG")
    return buffer.getvalue()


def multipart(files: list[bytes], boundary: str = "bomb") -> tuple[bytes, str]:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="f{index}"; '
        f'filename="{index}.png"\r\nContent-Type: image/png\r\n\r\n'.encode()
        + data
        + b"\r\n"
        for index, data in enumerate(files)
    ]
    return b"".join(
        parts
    ) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


async def probe_once(probe: HttpConnection, other: HttpConnection) -> float:
    """One ``/healthz`` and one request to ``digits``, each on its own connection: the slower."""
    started_s = time.monotonic()
    await probe.request("GET", "/healthz", b"", {})
    health_s = time.monotonic() - started_s
    started_s = time.monotonic()
    await other.request("POST", "/models/digits/predict", DIGIT, JSON_HEADERS)
    return max(health_s, time.monotonic() - started_s)


async def probed_bomb(
    host: str, port: int, path: str, body: bytes, content_type: str
) -> tuple[int, float, list[float]]:
    """Send one bomb; probe until it is answered. Its status, its seconds, the probe times."""
    bomber, probe, other = (HttpConnection(host, port) for _ in range(3))
    try:
        started_s = time.monotonic()
        bomb = asyncio.create_task(
            bomber.request("POST", path, body, {"Content-Type": content_type})
        )
        probes = []
        while not bomb.done() and time.monotonic() - started_s < 60.0:
            probes.append(await probe_once(probe, other))
        response = await bomb
        return response.status, time.monotonic() - started_s, probes
    finally:
        for connection in (bomber, probe, other):
            await connection.close()


async def idle_probes(host: str, port: int, count: int) -> list[float]:
    probe, other = HttpConnection(host, port), HttpConnection(host, port)
    try:
        return [await probe_once(probe, other) for _ in range(count)]
    finally:
        await probe.close()
        await other.close()


def handler_bomb(scratch: Path, repeats: int = 3) -> list[str]:
    maximal = bilevel_png(4000)  # 16 Mpx, the most one image may declare
    text = "great film " * 190_000
    bombs = [
        ("128 PNGs of 16 Mpx, multipart (2 Gpx declared)", "digits_png",
         *multipart([maximal] * 128)),
        ("4 PNGs of 16 Mpx, multipart (64 Mpx: the cap, decoded)", "digits_png",
         *multipart([maximal] * 4)),
        ("2 MB text/plain (about a million tokens)", "sentiment", text.encode(), "text/plain"),
        ("2 MB JSON text instance", "sentiment", json.dumps({"instances": [text]}).encode(),
         "application/json"),
    ]  # fmt: skip
    settings = {"BATCHSERVE_MODELS": "digits,digits_png,sentiment"}
    lines = [
        "## Handler bombs",
        "",
        "`digits`, `digits_png` and `sentiment` in one process, default handler threads and "
        f"limits. One costly request at a time ({repeats} of each); meanwhile a probe sends "
        "`GET /healthz` then a `digits` request, each on its own kept-alive connection, again "
        "and again; the probe time is the slower of the two. Goal: under "
        f"{PROBE_GOAL_MS:.0f} ms.",
        "",
        "| request | status | request s (max) | probes | probe p50 ms | probe max ms |",
        "| --- | --- | --: | --: | --: | --: |",
    ]
    with server_process(settings, scratch, "handler-bomb") as (host, port, _):
        idle = asyncio.run(idle_probes(host, port, 20))
        lines.append(
            f"| (idle server) | | | {len(idle)} | {statistics.median(idle) * 1000:.1f} | "
            f"{max(idle) * 1000:.1f} |"
        )
        for label, model, body, content_type in bombs:
            statuses, durations, probes = set(), [], []
            for _ in range(repeats):
                status, seconds, probed = asyncio.run(
                    probed_bomb(host, port, f"/models/{model}/predict", body, content_type)
                )
                statuses.add(str(status))
                durations.append(seconds)
                probes += probed
            summary = (
                f"{statistics.median(probes) * 1000:.1f} | {max(probes) * 1000:.1f}"
                if probes
                else "- | -"
            )
            lines.append(
                f"| {label} | {', '.join(sorted(statuses))} | {max(durations):.2f} | "
                f"{len(probes)} | {summary} |"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenario",
        choices=SCENARIOS,
        action="append",
        help="the attacks to run (default: all)",
    )
    parser.add_argument(
        "--duration-s",
        type=float,
        default=10.0,
        help="per goodput point; the storm of recovery; the long clients of fairness",
    )
    parser.add_argument("--count", type=int, default=30, help="short or lone requests")
    parser.add_argument(
        "--clients",
        default=",".join(map(str, GOODPUT_CLIENTS)),
        help="goodput: closed-loop clients per point, the first the reference (1,4,64)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=512,
        help="goodput, recovery: tokens per request (fewer on a machine too loaded for 512)",
    )
    parser.add_argument(
        "--engine-mode", choices=ENGINE_MODES, action="append", help="goodput, recovery"
    )
    parser.add_argument(
        "--protocol", choices=PROTOCOLS, default="http", help="goodput: the clients' protocol"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="BATCHSERVE_NAME=VALUE",
        help="a setting of every server, over the scenario's own (repeatable)",
    )
    args = parser.parse_args(argv)
    clients = [int(part) for part in args.clients.split(",")]
    engine_modes = args.engine_mode or ENGINE_MODES
    EXTRA_SETTINGS.update(item.split("=", 1) for item in args.set)
    chosen = args.scenario or SCENARIOS
    report = ["# Attacks on batchserve", ""]
    with tempfile.TemporaryDirectory(prefix="batchserve-attacks-") as folder:
        scratch = Path(folder)
        for scenario in chosen:
            if scenario == "goodput":
                report += goodput(
                    scratch, args.duration_s, clients, engine_modes, args.tokens, args.protocol
                )
            elif scenario == "recovery":
                report += recovery(scratch, args.duration_s, engine_modes, args.tokens)
            elif scenario == "fairness":
                report += fairness(scratch, args.count, args.duration_s)
            elif scenario == "slow-uploads":
                report += slow_uploads(scratch, args.count)
            elif scenario == "headers":
                report += headers(scratch)
            elif scenario == "slowloris":
                report += slowloris(scratch, args.count)
            else:
                report += handler_bomb(scratch)
            report.append("")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
