"""How evenly a front end serves its connections at saturation: latencies per connection.

    python -m loadtests.frontend_fairness --url http://127.0.0.1:8098 --seconds 4

``--connections`` closed-loop clients (64), each on its own kept-alive connection, POST the
MLP's bodies (one 256-float JSON instance) to ``/predict`` for ``--seconds``; every answer's
latency is recorded by connection. Prints the overall percentiles, then how the answers and
the slow ones (over the overall p99) spread over the connections: whether the tail is every
connection now and then, or a few connections kept waiting. The client is raw asyncio on
uvloop (one process), so it stays cheaper than the server it loads.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from urllib.parse import urlsplit

import numpy as np

from loadtests import bodies, servers


async def one_connection(
    host: str,
    port: int,
    requests: list[bytes],
    until_s: float,
    latencies_s: list[float],
    slowest: list[tuple[float, int, float]],
) -> None:
    """Closed loop on one connection until ``until_s``: send, read the whole answer, repeat.
    ``slowest`` gets this connection's slowest answer: (latency, its index on the
    connection, when it was sent, seconds after the connection was asked for)."""
    opened_s = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    index = 0
    try:
        while time.monotonic() < until_s:
            started_s = time.monotonic()
            writer.write(requests[index % len(requests)])
            index += 1
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"answered {head.splitlines()[0]!r}")
            latencies_s.append(time.monotonic() - started_s)
            if not slowest or latencies_s[-1] > slowest[0][0]:
                slowest[:] = [(latencies_s[-1], index - 1, started_s - opened_s)]
    finally:
        writer.close()


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def measure(url: str, connections: int, seconds: float) -> str:
    parts = urlsplit(servers.check_loopback(url))
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    requests = [
        b"POST /predict HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body)
        for body in bodies.mlp_bodies(np.random.default_rng(0), 64)
    ]
    latencies_s: list[list[float]] = [[] for _ in range(connections)]
    slowest: list[list[tuple[float, int, float]]] = [[] for _ in range(connections)]
    until_s = time.monotonic() + seconds
    await asyncio.gather(
        *(
            one_connection(host, port, requests, until_s, mine, worst)
            for mine, worst in zip(latencies_s, slowest, strict=True)
        )
    )
    every = [value for mine in latencies_s for value in mine]
    p99 = percentile(every, 0.99)
    counts = sorted(len(mine) for mine in latencies_s)
    slow = sorted((sum(value > p99 for value in mine) for mine in latencies_s), reverse=True)
    worst = sorted((found[0] for found in slowest if found), reverse=True)
    lines = [
        f"answers {len(every)} ({len(every) / seconds:,.0f}/s) over {connections} connections",
        f"latency ms: p50 {percentile(every, 0.5) * 1e3:.1f},"
        f" p90 {percentile(every, 0.9) * 1e3:.1f}, p99 {p99 * 1e3:.1f},"
        f" max {max(every) * 1e3:.1f}",
        f"answers per connection: min {counts[0]}, median {statistics.median(counts):.0f},"
        f" max {counts[-1]}",
        f"answers over p99 by connection (most first): {slow[:10]}; connections with any:"
        f" {sum(1 for count in slow if count)}",
        "each connection's slowest answer, ms (its index on the connection, sent at s): "
        + ", ".join(
            f"{value * 1e3:.0f} (#{index}, {at_s:.2f})" for value, index, at_s in worst[:10]
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", required=True)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args(argv)
    if not 1 <= args.seconds <= 30 or not 1 <= args.connections <= 1024:
        parser.error(
            f"--seconds 1-30, --connections 1-1024 (got {args.seconds}, {args.connections})"
        )
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    print(runner(measure(args.url, args.connections, args.seconds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
