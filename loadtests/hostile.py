"""Attacks by one hostile client on a real ``batchserve serve``: huge headers, slowloris, and
handler bombs. ``loadtests.attacks`` runs them (``--scenario headers|slowloris|handler-bomb``).

- ``headers``: a 1 MiB header, and connections offering a 100 MB header each: the status,
  how much the client got to send before the answer, and the server's resident memory.
- ``slowloris``: 200 connections that send half a request line, and 20 that trickle a header
  a byte a second: how many are still open after a while, and a lone client's latency beside
  them against alone.
- ``handler-bomb``: single costly requests to handler models (many maximal-pixel PNGs, the
  most pixels one request may declare, a 2 MB text) while a probe asks ``/healthz`` and
  another model: the probe's latency during each request against the server idle.

Every server is one process on a free 127.0.0.1 port with one torch thread; every loop is
bounded in time and count.
"""

from __future__ import annotations

import asyncio
import io
import json
import statistics
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from PIL import Image

from loadtests import servers
from loadtests.soak import HttpConnection

JSON_HEADERS = {"Content-Type": "application/json"}
DIGIT = json.dumps({"instances": np.full((1, 8, 8), 0.5).tolist()}).encode()
#: The probe's goal while any one request is preprocessed (issue 23).
PROBE_GOAL_MS = 250.0


@contextmanager
def serve(settings: Mapping[str, str], scratch: Path, name: str) -> Iterator[tuple[str, int, int]]:
    """Host, port and pid of a one-process server with ``settings``."""
    env = servers.server_env(
        {
            "BATCHSERVE_DEVICE": "cpu",
            "BATCHSERVE_TORCH_THREADS": "1",
            "BATCHSERVE_LOG_LEVEL": "warning",
            **settings,
        }
    )
    command = servers.batchserve_command()
    with servers.serving(command, env, scratch / f"{name}.log", ready_timeout_s=180) as server:
        parts = urlsplit(server.url)
        assert parts.hostname is not None
        assert parts.port is not None
        yield parts.hostname, parts.port, server.pid


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
    with serve({}, scratch, "headers") as (host, port, pid):
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
    with serve({}, scratch, "slowloris") as (host, port, _):
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
    with serve(settings, scratch, "handler-bomb") as (host, port, _):
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
