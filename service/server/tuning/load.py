"""Closed-loop load on loopback with aiohttp: ``concurrency`` clients, each sending its next
request as soon as its last is answered, for a bounded time and number of requests.

What is sent is ``bodies``' business (``tuning.bodies``); client ``i`` sends bodies ``i``,
``i + concurrency``, ... in turn, so every candidate gets the same requests.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
REQUEST_TIMEOUT_S = 30.0
#: Most requests one measurement sends, whatever its duration (a bound on a fast server).
MAX_REQUESTS = 2_000_000


@dataclass(frozen=True)
class Body:
    """One ``/predict`` request body and its ``Content-Type``."""

    content: bytes
    content_type: str = "application/json"


@dataclass(frozen=True)
class LoadResult:
    """What one measurement window saw: answered requests, failures and their latencies."""

    duration_s: float
    latencies_ms: tuple[float, ...]
    errors: int

    @property
    def throughput_rps(self) -> float:
        return len(self.latencies_ms) / self.duration_s if self.duration_s > 0 else 0.0

    def percentile_ms(self, share: float) -> float:
        """Nearest-rank percentile (``share`` in 0..1); infinite when nothing was answered."""
        if not self.latencies_ms:
            return math.inf
        ordered = sorted(self.latencies_ms)
        rank = max(1, math.ceil(share * len(ordered)))
        return ordered[rank - 1]


def check_loopback(url: str) -> str:
    host = urlsplit(url).hostname
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"tune only sends load to 127.0.0.1 (or localhost), got {url!r}")
    return url.rstrip("/")


async def closed_loop(
    url: str,
    bodies: Sequence[Body],
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 0.0,
    max_requests: int = MAX_REQUESTS,
) -> LoadResult:
    """Load ``url``/predict for ``warmup_s`` (not counted), then ``duration_s``: the requests
    answered inside that window count, with their whole latency (a slow request begun in the
    warm-up counts too, so slow models are not measured as if they had none). Requests still
    in flight when the window ends are cancelled. Bounded by time and ``max_requests``."""
    target = check_loopback(url) + "/predict"
    window_start_s = time.monotonic() + warmup_s
    window_end_s = window_start_s + duration_s
    latencies_ms: list[float] = []
    errors = 0
    sent = 0

    async def client(session: aiohttp.ClientSession, first: int) -> None:
        nonlocal errors, sent
        index = first
        while time.monotonic() < window_end_s and sent < max_requests:
            sent += 1
            body = bodies[index % len(bodies)]
            index += concurrency
            headers = {"content-type": body.content_type}
            begun_s = time.monotonic()
            try:
                async with session.post(target, data=body.content, headers=headers) as response:
                    await response.read()
                    ok = response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            ended_s = time.monotonic()
            if not window_start_s <= ended_s <= window_end_s:
                continue
            if ok:
                latencies_ms.append((ended_s - begun_s) * 1000)
            else:
                errors += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        clients = [asyncio.create_task(client(session, first)) for first in range(concurrency)]
        # Every client stops by itself at the window's end, but one waiting for a slow answer
        # would hold the measurement for as long as the answer takes: cancel what is left.
        done, pending = await asyncio.wait(clients, timeout=window_end_s - time.monotonic())
        for task in pending:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        for task in done:
            task.result()  # a bug in a client surfaces here rather than as a low count
    return LoadResult(duration_s=duration_s, latencies_ms=tuple(latencies_ms), errors=errors)
