"""Soak test: steady open-loop load on ``/predict``, every answer checked against a reference.

Sends ``--rate`` requests per second for ``--duration-s`` seconds (one instance each, drawn
from a fixed pool: an 8x8 digit, or with ``--model textenc`` a sequence of ``--tokens`` token
ids), on a fixed schedule whatever the server does (open loop: a slow answer does not slow the
sender, and latency is counted from the scheduled send time, so queueing shows). Every 200 is
compared with the bundled model run in this process on that input alone
(``torch.inference_mode``, no batching; ``rtol = atol = 1e-5`` for digits, ``1e-4`` for the
deeper textenc) and must come from the same model version. It reports requests, errors by
kind (status codes, connection errors, timeouts), mismatches, p50/p99 latency per
``--window-s`` window, and the server's resident memory
(``batchserve_process_resident_memory_bytes`` from ``/metrics``, summed over the roles of its
processes) at the start, at the end of every window and at the end.

Without ``--url`` it starts ``batchserve serve`` (the console script beside this Python) on a
free 127.0.0.1 port, serving the bundled model on the CPU; ``--set NAME=VALUE`` adds
``BATCHSERVE_*`` settings. Only 127.0.0.1 is ever sent traffic; the run is bounded by
``rate x duration`` requests and by ``--max-backlog`` requests waiting to be sent.

    python -m loadtests.soak                                  # 200 req/s for 600 s
    python -m loadtests.soak --rate 200 --duration-s 120 --csv soak.csv
    python -m loadtests.soak --url http://127.0.0.1:8000      # a server already running
    python -m loadtests.soak --model textenc --overload --rate 30 --duration-s 120 \
        --set BATCHSERVE_MAX_QUEUE_SIZE=8 --set BATCHSERVE_REQUEST_TIMEOUT_MS=300

Writes a Markdown report to stdout; exit status 0 when there was no error and no mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import numpy.typing as npt
import orjson
import torch

from loadtests import servers
from service.config import BUNDLED_MODEL_REPOSITORY
from service.engine.model_store import ModelStore

MODELS = ("digits", "textenc")
#: Token ids drawn for textenc inputs: 1 up to its vocabulary (0 is padding).
TEXTENC_VOCABULARY = 1000
OK = "ok"
MISMATCH = "mismatch"
#: Requests not sent because ``--max-backlog`` scheduled ones were already waiting for a
#: sender: the client's own bound, so a stalled server cannot make it grow without limit.
BACKLOG = "not_sent_backlog"
#: Answers an overload soak expects: refused at once (429), not ready or busy (503), or past
#: the deadline (504). Answered, so nothing is lost; not computed, so nothing is wrong.
REFUSALS = frozenset({"status_429", "status_503", "status_504"})
#: One sample per process role (``{role="server"}``, or front ends and engines).
_RSS = re.compile(r"^batchserve_process_resident_memory_bytes(?:\{[^}]*\})? (\S+)$", re.MULTILINE)

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class SoakOptions:
    rate: float = 200.0
    duration_s: float = 600.0
    window_s: float = 30.0
    connections: int = 32
    request_timeout_s: float = 10.0
    max_backlog: int = 2000
    pool: int = 256
    seed: int = 0
    model: str = "digits"
    tokens: int = 512
    """Sequence length of each textenc input (ignored for digits)."""
    overload: bool = False
    """More than the server can take: refusals (``REFUSALS``) are expected, not errors."""

    @property
    def total(self) -> int:
        return int(self.rate * self.duration_s)


@dataclass(frozen=True)
class Outcome:
    scheduled_s: float  # from the start of the run
    kind: str  # OK, MISMATCH, status_<code>, timeout, connect_error, ... or BACKLOG
    latency_s: float | None  # scheduled send to complete answer; None without an answer


@dataclass
class SoakResult:
    options: SoakOptions
    url: str
    version: str
    outcomes: list[Outcome] = field(default_factory=list)
    #: (seconds from the start of the run, resident bytes); None where /metrics failed.
    rss: list[tuple[float, float | None]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def kinds(self) -> Counter[str]:
        return Counter(outcome.kind for outcome in self.outcomes)

    @property
    def mismatches(self) -> int:
        return self.kinds[MISMATCH]

    @property
    def errors(self) -> Counter[str]:
        """Every outcome other than a correct 200, a mismatch, or (in an overload soak) a
        refusal, by kind."""
        expected = {OK, MISMATCH} | (REFUSALS if self.options.overload else set())
        return Counter({kind: n for kind, n in self.kinds.items() if kind not in expected})

    @property
    def refusals(self) -> Counter[str]:
        return Counter({kind: n for kind, n in self.kinds.items() if kind in REFUSALS})

    @property
    def goodput_per_s(self) -> float:
        """Correct answers per second of the run."""
        return self.kinds[OK] / self.options.duration_s

    @property
    def passed(self) -> bool:
        return len(self.outcomes) == self.options.total and not self.errors and self.mismatches == 0

    def windows(self) -> list[Window]:
        width = self.options.window_s
        count = max(1, int(np.ceil(self.options.duration_s / width)))
        grouped: list[list[Outcome]] = [[] for _ in range(count)]
        for outcome in self.outcomes:
            grouped[min(count - 1, int(outcome.scheduled_s // width))].append(outcome)
        rss_at = dict(self.rss)
        ends = [min((index + 1) * width, self.options.duration_s) for index in range(count)]
        return [
            Window(index * width, end_s, members, rss_at.get(end_s))
            for index, (end_s, members) in enumerate(zip(ends, grouped, strict=True))
        ]


@dataclass
class Window:
    start_s: float
    end_s: float
    outcomes: list[Outcome]
    rss_bytes: float | None

    @property
    def latencies_ms(self) -> list[float]:
        return [o.latency_s * 1000 for o in self.outcomes if o.latency_s is not None]

    def percentile_ms(self, q: float) -> float | None:
        latencies = self.latencies_ms
        return float(np.percentile(latencies, q)) if latencies else None

    @property
    def errors(self) -> int:
        return sum(o.kind not in (OK, MISMATCH) for o in self.outcomes)

    @property
    def mismatches(self) -> int:
        return sum(o.kind == MISMATCH for o in self.outcomes)


# ------------------------------------------------------------------------------ the reference


class Reference:
    """A bundled model (digits or textenc), run in this process on each pool input alone."""

    def __init__(self, pool: int, seed: int, model: str = "digits", tokens: int = 512) -> None:
        if model not in MODELS:
            raise ValueError(f"the soak knows the models {MODELS}, not {model!r}")
        loaded = ModelStore(BUNDLED_MODEL_REPOSITORY).load(model)
        self.model = model
        self.version = loaded.manifest.version
        rng = np.random.default_rng(seed)
        inputs: list[npt.NDArray[np.generic]]
        if model == "digits":
            inputs = list(rng.random((pool, 8, 8), dtype=np.float32))
            self.tolerance = 1e-5
        else:
            inputs = list(rng.integers(1, TEXTENC_VOCABULARY, size=(pool, tokens), dtype=np.int64))
            self.tolerance = 1e-4  # four layers: batched and alone differ in the last bits
        module = loaded.module.eval()
        with torch.inference_mode():
            self.expected: list[FloatArray] = [
                module(torch.from_numpy(item[np.newaxis].copy()))[0].numpy().copy()
                for item in inputs
            ]
        self.bodies = [orjson.dumps({"instances": [item.tolist()]}) for item in inputs]

    def check(self, index: int, body: bytes) -> str:
        """OK if ``body`` is this model version's answer for pool input ``index``."""
        try:
            document = orjson.loads(body)
            if document.get("version") != self.version:
                return MISMATCH
            predictions = np.asarray(document["predictions"], dtype=np.float32)
        except (ValueError, TypeError, KeyError, AttributeError):
            return MISMATCH  # a 200 that is not a prediction at all
        expected = self.expected[index % len(self.expected)]
        if predictions.shape != (1, *expected.shape):
            return MISMATCH
        close = np.allclose(predictions[0], expected, rtol=self.tolerance, atol=self.tolerance)
        return OK if close else MISMATCH


# ------------------------------------------------------------------------------ the load


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


class ProtocolError(Exception):
    """The answer was not an HTTP/1.x response with a ``Content-Length``."""


class HttpConnection:
    """One keep-alive HTTP/1.1 connection: a minimal client, light enough for soak rates.

    httpx took about 1.6 ms of CPU per request on the project's 2-core machine, this about
    0.07 ms: at 200 req/s that is a third of a core the load generator no longer takes from the
    server it measures (or falls behind without). It understands what batchserve sends:
    responses with a ``Content-Length``. After an error, a timeout or a cancellation the
    connection is dropped, and the next request opens a new one.
    """

    #: Reconnect rather than reuse a connection idle this long: uvicorn closes idle keep-alive
    #: connections after 5 s, and a request written just as it closes one would be lost.
    MAX_IDLE_S = 2.0

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._idle_since_s = 0.0

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> RawResponse:
        if (
            self._reader is None
            or self._writer is None
            or self._reader.at_eof()
            or time.monotonic() - self._idle_since_s > self.MAX_IDLE_S
        ):
            self._drop()
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._reader, self._writer
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        head += [f"{name}: {value}" for name, value in (headers or {}).items()]
        head.append(f"Content-Length: {len(body)}")
        try:
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
            status_line, *lines = (
                (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            )
            version, _, rest = status_line.partition(" ")
            status = rest[:3]
            if not version.startswith("HTTP/1.") or not status.isdigit():
                raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
            fields: dict[str, str] = {}
            for line in lines:
                name, _, value = line.partition(":")
                if name:
                    fields[name.strip().lower()] = value.strip()
            length = fields.get("content-length", "")
            if not length.isdigit():
                raise ProtocolError(f"no valid Content-Length in the answer: {length[:20]!r}")
            content = await reader.readexactly(int(length))
        except BaseException:
            self._drop()  # its state is unknown: part of an answer may still arrive
            raise
        if fields.get("connection", "").lower() == "close":
            self._drop()
        self._idle_since_s = time.monotonic()
        return RawResponse(int(status), fields, content)

    def _drop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def close(self) -> None:
        writer = self._writer
        self._drop()
        if writer is not None:
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def error_kind(error: BaseException) -> str:
    """How a request that got no answer failed, for the report."""
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, ConnectionRefusedError):
        return "connect_error"
    if isinstance(error, asyncio.IncompleteReadError | ConnectionResetError | BrokenPipeError):
        return "connection_closed"
    if isinstance(error, ProtocolError | asyncio.LimitOverrunError):
        return "protocol_error"
    return type(error).__name__


async def _resident_bytes(client: httpx.AsyncClient) -> float | None:
    try:
        found = _RSS.findall((await client.get("/metrics")).text)
    except httpx.HTTPError:
        return None
    return sum(float(value) for value in found) if found else None


async def soak(url: str, options: SoakOptions, reference: Reference) -> SoakResult:
    """Send ``options.total`` requests on schedule; check each answer; sample RSS per window."""
    url = servers.check_loopback(url)
    address = urlsplit(url)
    host, port = address.hostname or "127.0.0.1", address.port or 80
    result = SoakResult(options=options, url=url, version=reference.version)
    headers = {"Content-Type": "application/json"}
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=url, timeout=options.request_timeout_s) as probe:
        result.rss.append((0.0, await _resident_bytes(probe)))
        # Scheduled requests wait in this queue for one of ``connections`` senders.
        backlog: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
        started = loop.time()

        async def sender() -> None:
            connection = HttpConnection(host, port)
            while (item := await backlog.get()) is not None:
                index, scheduled = item
                body = reference.bodies[index % len(reference.bodies)]
                try:
                    async with asyncio.timeout(options.request_timeout_s):
                        response = await connection.request("POST", "/predict", body, headers)
                except (OSError, TimeoutError, ProtocolError, asyncio.IncompleteReadError) as error:
                    result.outcomes.append(Outcome(scheduled - started, error_kind(error), None))
                    continue
                latency_s = loop.time() - scheduled
                if response.status == 200:
                    kind = reference.check(index, response.body)
                else:
                    kind = f"status_{response.status}"
                result.outcomes.append(Outcome(scheduled - started, kind, latency_s))
            await connection.close()

        async def sample_rss() -> None:
            for window in range(1, len(result.windows())):
                boundary = window * options.window_s
                await asyncio.sleep(max(0.0, started + boundary - loop.time()))
                result.rss.append((boundary, await _resident_bytes(probe)))

        sampler = asyncio.create_task(sample_rss())
        senders = [asyncio.create_task(sender()) for _ in range(options.connections)]
        for index in range(options.total):
            scheduled = started + index / options.rate
            delay = scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if backlog.qsize() >= options.max_backlog:
                result.outcomes.append(Outcome(scheduled - started, BACKLOG, None))
            else:
                backlog.put_nowait((index, scheduled))
        for _ in senders:
            backlog.put_nowait(None)
        await asyncio.gather(*senders)
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        result.wall_s = loop.time() - started
        result.rss.append((options.duration_s, await _resident_bytes(probe)))
    result.outcomes.sort(key=lambda outcome: outcome.scheduled_s)
    return result


# ------------------------------------------------------------------------------ the report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def report_markdown(result: SoakResult, note: str = "") -> str:
    options = result.options
    answered = [o for o in result.outcomes if o.latency_s is not None]
    everything = Window(0.0, options.duration_s, result.outcomes, None)
    rss_values = [value for _, value in result.rss if value is not None]
    lines = [
        "## Soak test",
        "",
        f"{options.rate:g} req/s for {options.duration_s:g} s against {result.url} "
        f"(model {options.model}@{result.version}); open loop, {options.connections} connections, "
        f"request timeout {options.request_timeout_s:g} s. Latency is counted from each "
        f"request's scheduled send time. Wall time {result.wall_s:.1f} s.",
    ]
    if note:
        lines += ["", note]
    if options.overload:
        refused = ", ".join(f"{kind} {n}" for kind, n in sorted(result.refusals.items()))
        lines += [
            "",
            f"Overload soak: goodput {result.goodput_per_s:.1f} correct answers/s "
            f"({result.goodput_per_s / options.rate:.0%} of the offered rate); refused: "
            f"{refused or 'none'}.",
        ]
    lines += [
        "",
        "| requests | answered | correct 200 | errors | mismatches | p50 ms | p99 ms | result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {len(result.outcomes)} of {options.total} | {len(answered)} | {result.kinds[OK]} "
        f"| {sum(result.errors.values())} | {result.mismatches} "
        f"| {_ms(everything.percentile_ms(50))} | {_ms(everything.percentile_ms(99))} "
        f"| {'PASS' if result.passed else 'FAIL'} |",
        "",
        "Errors by kind: "
        + (", ".join(f"{kind} {n}" for kind, n in sorted(result.errors.items())) or "none")
        + ".",
        "",
        "| window s | requests | errors | mismatches | p50 ms | p99 ms | RSS MiB at end |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for window in result.windows():
        lines.append(
            f"| {window.start_s:g}-{window.end_s:g} | {len(window.outcomes)} | {window.errors} "
            f"| {window.mismatches} | {_ms(window.percentile_ms(50))} "
            f"| {_ms(window.percentile_ms(99))} | {_mib(window.rss_bytes)} |"
        )
    start_rss, end_rss = result.rss[0][1], result.rss[-1][1]
    growth = None if start_rss is None or end_rss is None else end_rss - start_rss
    lines += [
        "",
        f"Server RSS: {_mib(start_rss)} MiB at the start, {_mib(end_rss)} MiB at the end "
        f"(growth {'-' if growth is None else f'{growth / 2**20:+.1f}'} MiB), "
        f"max {_mib(max(rss_values, default=None))} MiB.",
    ]
    return "\n".join(lines) + "\n"


def write_csv(result: SoakResult, path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(
            ["window_start_s", "window_end_s", "requests", "errors", "mismatches", "p50_ms",
             "p99_ms", "rss_bytes"]
        )  # fmt: skip
        for window in result.windows():
            writer.writerow(
                [window.start_s, window.end_s, len(window.outcomes), window.errors,
                 window.mismatches, window.percentile_ms(50), window.percentile_ms(99),
                 window.rss_bytes]
            )  # fmt: skip


# ------------------------------------------------------------------------------ running it


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = SoakOptions()
    parser.add_argument("--rate", type=float, default=defaults.rate, help="requests per second")
    parser.add_argument("--duration-s", type=float, default=defaults.duration_s)
    parser.add_argument("--window-s", type=float, default=defaults.window_s)
    parser.add_argument("--connections", type=int, default=defaults.connections)
    parser.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s)
    parser.add_argument(
        "--max-backlog",
        type=int,
        default=defaults.max_backlog,
        help="scheduled requests waiting for a free connection past this many are not sent "
        f"(counted as {BACKLOG})",
    )
    parser.add_argument("--pool", type=int, default=defaults.pool, help="distinct inputs")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--model", choices=MODELS, default=defaults.model)
    parser.add_argument(
        "--tokens", type=int, default=defaults.tokens, help="token ids per textenc input"
    )
    parser.add_argument("--url", help="a running server on 127.0.0.1 (default: start one)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a BATCHSERVE_* setting for the server this starts (repeatable)",
    )
    parser.add_argument(
        "--overload",
        action="store_true",
        help="offer more than the server can take: 429, 503 and 504 answers are expected "
        "refusals, reported with the goodput, not errors",
    )
    parser.add_argument("--csv", type=Path, help="also write one row per window to this file")
    parser.add_argument("--note", default="", help="a line added to the report, e.g. the machine")
    args = parser.parse_args(argv)
    for name, value, low in (
        ("--rate", args.rate, 0.0),
        ("--duration-s", args.duration_s, 0.0),
        ("--window-s", args.window_s, 0.0),
        ("--request-timeout-s", args.request_timeout_s, 0.0),
    ):
        if not value > low:
            parser.error(f"{name} must be above {low:g}, got {value}")
    for name, value in (
        ("--connections", args.connections),
        ("--max-backlog", args.max_backlog),
        ("--pool", args.pool),
        ("--tokens", args.tokens),
    ):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    if args.rate * args.duration_s > 1_000_000:
        parser.error("at most 1,000,000 requests per run (rate x duration)")
    for setting in args.set:
        if "=" not in setting or not setting.startswith("BATCHSERVE_"):
            parser.error(f"--set takes BATCHSERVE_NAME=VALUE, got {setting!r}")
    return args


def run(argv: Sequence[str] | None = None) -> SoakResult:
    """Parse ``argv``, start a server unless ``--url``, soak it; the result, not yet printed."""
    args = parse_args(argv)
    options = SoakOptions(
        rate=args.rate,
        duration_s=args.duration_s,
        window_s=args.window_s,
        connections=args.connections,
        request_timeout_s=args.request_timeout_s,
        max_backlog=args.max_backlog,
        pool=args.pool,
        seed=args.seed,
        model=args.model,
        tokens=args.tokens,
        overload=args.overload,
    )
    torch.set_num_threads(1)  # the reference is computed once, before the load
    reference = Reference(options.pool, options.seed, options.model, options.tokens)
    if args.url:
        return asyncio.run(soak(args.url, options, reference))
    overrides = dict(setting.split("=", 1) for setting in args.set)
    env = servers.server_env(
        {"BATCHSERVE_DEVICE": "cpu", "BATCHSERVE_MODEL_NAME": options.model} | overrides
    )
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
        log = Path(scratch) / "server.log"
        with servers.running(servers.batchserve_command(), env, log, 120.0) as url:
            return asyncio.run(soak(url, options, reference))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started_s = time.monotonic()
    result = run(argv)
    sys.stdout.write(report_markdown(result, note=args.note))
    if args.csv is not None:
        write_csv(result, args.csv)
    print(f"\n(total run time {time.monotonic() - started_s:.0f} s)", file=sys.stderr)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
