"""What the HTTP server itself costs per request: uvicorn against granian, each serving a bare
ASGI app and batchserve's real front end without a model.

    python -m loadtests.http_servers --rounds 5 --duration-s 4 --output /tmp/http-servers.json

Servers (``--servers``; the first four by default), each one process serving (a supervisor
above it idles and is counted too), all started at once on 127.0.0.1 and loaded in turn, round
after round, the order rotated each round, so a busy shared machine weighs on every one alike:

- ``uvicorn-bare``: uvicorn 0.x, httptools and uvloop (what a front end runs), one process, the
  app ``bare_app``: reads the body, answers a fixed JSON body. The floor of uvicorn.
- ``granian-bare``: granian, ASGI interface, one worker, its default runtime, the same app.
- ``uvicorn-ceiling``: ``service.server.tuning.ceiling`` as a ``--workers`` front end runs it:
  gunicorn, ``BatchserveWorker`` (``DrainingServer``, the limited httptools protocol, uvloop),
  one worker; batchserve's front end answering ``/predict`` with zero rows (``ZeroEngine``).
- ``granian-ceiling``: the same app (``create_app_from_environment``) under granian.
- ``uvicorn-starlette``, ``granian-starlette``: a bare Starlette app (one route reading the
  body, a ``Response``): what the framework adds before batchserve's own code.
- ``uvicorn-limited-bare``: the bare app on uvicorn with our ``LimitedHttpToolsProtocol``.
- ``uvicorn-ceiling-plain``: the ceiling's app on plain uvicorn (uvicorn's own httptools
  protocol, no gunicorn, no ``DrainingServer``): what our worker and protocol add to it.
- ``granian-bare-st``, ``granian-ceiling-st``: granian's single-threaded runtime
  (``--runtime-mode st``); ``granian-bare-rust``, ``granian-ceiling-rust``: its Rust task
  implementation (``--task-impl rust``, experimental); ``granian-bare-t2``: two runtime threads.

Load: wrk, one thread, ``--concurrency`` connections (64), POST of the MLP's bodies (one
256-float JSON instance each, ``loadtests.bodies.mlp_bodies``). CPU per request: ``utime +
stime`` of every process of the server's tree over the run (``/proc``), divided by the requests
answered. Each run also records the 1-minute load average. Prints every run, then a Markdown
table of medians and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from loadtests import bodies, configs, servers, wrk
from loadtests.frontend_cost import cpu_ticks, process_tree
from loadtests.frontend_http_gap import ceiling_env

TICKS_PER_S = os.sysconf("SC_CLK_TCK")

#: The ceiling's answer to one MLP instance (10 zero logits), so both apps write as much.
BARE_ANSWER = orjson.dumps(
    {"model": "mlp", "version": "0" * 12, "predictions": [[0.0] * configs.MLP_MODEL.classes]}
)
_BARE_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(BARE_ANSWER)).encode()),
]


async def bare_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The least an ASGI app can do: read the whole body, answer ``BARE_ANSWER``; lifespan
    acknowledged."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    more_body = True
    while more_body:
        message = await receive()
        more_body = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": _BARE_HEADERS})
    await send({"type": "http.response.body", "body": BARE_ANSWER})


def starlette_app() -> Any:
    """Starlette's least: one route for every path, ``await request.body()``, a ``Response``
    of ``BARE_ANSWER``: what the framework adds to the bare app, before our middleware."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def answer(request: Request) -> Response:
        await request.body()
        return Response(BARE_ANSWER, media_type="application/json")

    return Starlette(routes=[Route("/{path:path}", answer, methods=["GET", "POST"])])


def ceiling_app() -> Any:
    """batchserve's front end over ``ZeroEngine``, from the ``BATCHSERVE_*`` variables."""
    from service.server.tuning.ceiling import create_app_from_environment

    return create_app_from_environment()


APPS: dict[str, Callable[[], Any]] = {
    "bare": lambda: bare_app,
    "starlette": starlette_app,
    "ceiling": ceiling_app,
}


def serve_uvicorn(port: int, app: str, *, limited: bool) -> None:
    """uvicorn as a front end runs it (httptools, uvloop, no access log, no Server header)."""
    import uvicorn

    from service.config import load_settings
    from service.server.http_limits import limited_protocol

    http: Any = limited_protocol(load_settings()) if limited else "httptools"
    config = uvicorn.Config(
        APPS[app](),
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http=http,
        log_config=None,
        access_log=False,
        server_header=False,
        lifespan="on",
    )
    uvicorn.Server(config).run()


def granian_command(target: str, *, factory: bool, extra: Sequence[str] = ()) -> list[str]:
    """granian on 127.0.0.1 and ``{port}``, ASGI, one worker, its access log off."""
    command = [
        sys.executable,
        "-m",
        "granian",
        "--interface",
        "asgi",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--workers",
        "1",
        "--log-level",
        "warning",
        "--no-access-log",
    ]
    if factory:
        command.append("--factory")
    return [*command, *extra, target]


_SELF = "loadtests.http_servers"
_BARE = f"{_SELF}:bare_app"
_STARLETTE = f"{_SELF}:starlette_app"
_CEILING = "service.server.tuning.ceiling:create_app_from_environment"
#: name -> (command, whether it serves batchserve's front end).
SERVERS: dict[str, tuple[list[str], bool]] = {
    "uvicorn-bare": ([sys.executable, "-m", _SELF, "serve-uvicorn", "--port", "{port}"], False),
    "granian-bare": (granian_command(_BARE, factory=False), False),
    "uvicorn-ceiling": (
        [sys.executable, "-m", "service.server.tuning.ceiling", "--port", "{port}"],
        True,
    ),
    "granian-ceiling": (granian_command(_CEILING, factory=True), True),
    "uvicorn-starlette": (
        [sys.executable, "-m", _SELF, "serve-uvicorn", "--app", "starlette", "--port", "{port}"],
        False,
    ),
    "granian-starlette": (granian_command(_STARLETTE, factory=True), False),
    "uvicorn-ceiling-plain": (
        [sys.executable, "-m", _SELF, "serve-uvicorn", "--app", "ceiling", "--port", "{port}"],
        True,
    ),
    "uvicorn-limited-bare": (
        [sys.executable, "-m", _SELF, "serve-uvicorn", "--limited", "--port", "{port}"],
        False,
    ),
    "granian-bare-st": (
        granian_command(_BARE, factory=False, extra=["--runtime-mode", "st"]),
        False,
    ),
    "granian-ceiling-st": (
        granian_command(_CEILING, factory=True, extra=["--runtime-mode", "st"]),
        True,
    ),
    "granian-bare-rust": (
        granian_command(_BARE, factory=False, extra=["--task-impl", "rust"]),
        False,
    ),
    "granian-ceiling-rust": (
        granian_command(_CEILING, factory=True, extra=["--task-impl", "rust"]),
        True,
    ),
    "granian-bare-t2": (
        granian_command(_BARE, factory=False, extra=["--runtime-threads", "2"]),
        False,
    ),
}
DEFAULT_SERVERS = ("uvicorn-bare", "granian-bare", "uvicorn-ceiling", "granian-ceiling")
#: Ratios reported, numerator over denominator, where both were measured.
PAIRS = (
    ("granian-bare", "uvicorn-bare"),
    ("granian-ceiling", "uvicorn-ceiling"),
    ("granian-starlette", "uvicorn-starlette"),
    ("granian-bare-st", "uvicorn-bare"),
    ("granian-ceiling-st", "uvicorn-ceiling"),
    ("granian-bare-rust", "uvicorn-bare"),
    ("granian-ceiling-rust", "uvicorn-ceiling"),
    ("granian-bare-t2", "uvicorn-bare"),
    ("uvicorn-limited-bare", "uvicorn-bare"),
    ("uvicorn-ceiling", "uvicorn-ceiling-plain"),
)


@dataclass(frozen=True)
class Run:
    """One wrk run against one server."""

    server: str
    round: int
    requests_per_s: float
    answered: int
    errors: int
    cpu_us: float
    """CPU per answered request (µs), every process of the server's tree."""
    top_cpu_us: float
    """The same for the busiest process alone (the one serving)."""
    p99_ms: float
    load_1m: float


def per_request_us(ticks: Mapping[int, int], answered: int, ticks_per_s: int) -> float:
    """CPU ticks spent (by process) as µs per answered request; nothing answered counts as 1."""
    return sum(ticks.values()) / ticks_per_s / max(1, answered) * 1e6


def spent_ticks(before: Mapping[int, int], after: Mapping[int, int]) -> dict[int, int]:
    """Ticks each process spent between two readings; one that started in between counts from
    zero, one that ended in between is lost (none does in a steady run)."""
    return {pid: ticks - before.get(pid, 0) for pid, ticks in after.items()}


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` rotated by the round, so no server is always loaded first or last."""
    shift = round_index % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def median_ratio(
    runs: Sequence[Run], numerator: str, denominator: str, value: Callable[[Run], float]
) -> tuple[float, list[float]] | None:
    """The median over rounds of ``value(numerator's run) / value(denominator's run)`` in the
    same round, and each round's ratio; None when no round has both."""
    by_round: dict[int, dict[str, Run]] = {}
    for run in runs:
        by_round.setdefault(run.round, {})[run.server] = run
    ratios = [
        value(pair[numerator]) / value(pair[denominator])
        for _, pair in sorted(by_round.items())
        if numerator in pair and denominator in pair and value(pair[denominator]) > 0
    ]
    if not ratios:
        return None
    return statistics.median(ratios), ratios


def summary(runs: Sequence[Run]) -> str:
    """Markdown: medians per server, then the ratios of ``PAIRS``."""
    names = list(dict.fromkeys(run.server for run in runs))
    lines = [
        "| server | req/s | CPU µs/request (tree) | serving process | p99 ms | load 1 min "
        "| rounds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in names:
        mine = [run for run in runs if run.server == name]
        rounds = " · ".join(f"{run.cpu_us:.0f}" for run in mine)
        lines.append(
            f"| {name} | {statistics.median(r.requests_per_s for r in mine):,.0f} "
            f"| {statistics.median(r.cpu_us for r in mine):.0f} "
            f"| {statistics.median(r.top_cpu_us for r in mine):.0f} "
            f"| {statistics.median(r.p99_ms for r in mine):.1f} "
            f"| {statistics.median(r.load_1m for r in mine):.2f} | {rounds} |"
        )
    lines += ["", "| ratio (median of rounds) | CPU per request | req/s | rounds (CPU) |"]
    lines.append("| --- | --- | --- | --- |")
    for numerator, denominator in PAIRS:
        cpu = median_ratio(runs, numerator, denominator, lambda run: run.cpu_us)
        rate = median_ratio(runs, numerator, denominator, lambda run: run.requests_per_s)
        if cpu is None or rate is None:
            continue
        rounds = " · ".join(f"{ratio:.2f}" for ratio in cpu[1])
        lines.append(f"| {numerator} / {denominator} | {cpu[0]:.2f}x | {rate[0]:.2f}x | {rounds} |")
    return "\n".join(lines)


def measure(
    name: str,
    server: servers.RunningServer,
    script: Path,
    concurrency: int,
    duration_s: float,
    round_index: int,
) -> Run:
    pids = process_tree(server.pid)
    before = cpu_ticks(pids)
    result = wrk.run_wrk(
        server.url + "/predict", script, concurrency=concurrency, duration_s=duration_s
    )
    spent = spent_ticks(before, cpu_ticks(pids))
    answered = result.requests - result.errors
    busiest = max(spent.values(), default=0)
    return Run(
        server=name,
        round=round_index,
        requests_per_s=answered / result.duration_s if result.duration_s > 0 else 0.0,
        answered=answered,
        errors=result.errors,
        cpu_us=per_request_us(spent, answered, TICKS_PER_S),
        top_cpu_us=per_request_us({0: busiest}, answered, TICKS_PER_S),
        p99_ms=result.p99_ms,
        load_1m=os.getloadavg()[0],
    )


def _environment(repository: Path, metrics_dir: Path) -> dict[str, str]:
    """One gunicorn front end and no engine (the ceiling's front end of ``--workers``), this
    checkout's code."""
    return ceiling_env(Path(__file__).resolve().parents[1], repository, metrics_dir)


def run_rounds(args: argparse.Namespace) -> list[Run]:
    request_bodies = bodies.mlp_bodies(np.random.default_rng(0), 64)
    headers = {"Content-Type": "application/json"}
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="http-servers-") as folder:
        root = Path(folder)
        repository = configs.MLP_MODEL.package(root / "package")
        script = wrk.write_script(root / "wrk", request_bodies, headers)
        with servers.ServerPool() as pool:
            started: dict[str, servers.RunningServer] = {}
            for name in args.servers:
                command, _ = SERVERS[name]
                metrics_dir = root / f"metrics-{name}"
                metrics_dir.mkdir()
                env = _environment(repository, metrics_dir)
                started[name] = pool.start(command, env, root / f"{name}.log", 120.0)
            for server in started.values():
                servers.check_answers(server.url, request_bodies[:2], headers)
                wrk.run_wrk(
                    server.url + "/predict", script, concurrency=args.concurrency, duration_s=2
                )
            for round_index in range(args.rounds):
                for name in round_order(list(started), round_index):
                    run = measure(
                        name,
                        started[name],
                        script,
                        args.concurrency,
                        args.duration_s,
                        round_index,
                    )
                    runs.append(run)
                    print(
                        f"round {round_index + 1} {name}: {run.requests_per_s:,.0f} req/s, "
                        f"{run.cpu_us:.0f} µs CPU/request (serving process {run.top_cpu_us:.0f}), "
                        f"errors {run.errors}, p99 {run.p99_ms:.1f} ms, load {run.load_1m:.2f}",
                        flush=True,
                    )
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command")
    uvicorn_command = commands.add_parser(
        "serve-uvicorn", help="(used by the harness) plain uvicorn serving one of the apps"
    )
    uvicorn_command.add_argument("--port", type=int, required=True)
    uvicorn_command.add_argument("--app", choices=list(APPS), default="bare")
    uvicorn_command.add_argument(
        "--limited", action="store_true", help="with batchserve's LimitedHttpToolsProtocol"
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--duration-s", type=float, default=4.0, help="seconds of each wrk run (default 4)"
    )
    parser.add_argument("--concurrency", type=int, default=64, help="connections (default 64)")
    parser.add_argument(
        "--servers", nargs="+", default=list(DEFAULT_SERVERS), choices=list(SERVERS)
    )
    parser.add_argument("--output", type=Path, help="write every run here as JSON")
    args = parser.parse_args(argv)
    if args.command == "serve-uvicorn":
        serve_uvicorn(args.port, args.app, limited=args.limited)
        return 0
    if not 1 <= args.rounds <= 20 or not 1 <= args.duration_s <= 30:
        parser.error(
            f"--rounds must be 1-20 and --duration-s 1-30 (got {args.rounds}, {args.duration_s})"
        )
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    runs = run_rounds(args)
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(summary(runs))
    if args.output is not None:
        args.output.write_text(json.dumps([asdict(run) for run in runs], indent=1))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
