"""Embeddings served by batchserve, measured (``python -m loadtests.embeddings``; prints a
Markdown report). Needs the dev extra (transformers, sentence-transformers).

The folder: a sentence-transformers folder (a BERT with random weights, mean pooling,
``Normalize``) over a WordPiece tokenizer built here (``tests/hf_folders.py``): ``--model
tiny`` (2 layers, 16 wide) or ``bert6`` (6 layers, 384 wide, 12 heads, 1,536 intermediate:
all-MiniLM-L6-v2's shape). Texts of 5 to 200 tokens.

Two measures:

1. ``padding``, in this process (no HTTP server; the app through httpx's ASGI transport): a
   request of 256 texts beside 64 one-text requests, ``--rounds`` times: batches, padding
   (``batchserve_batch_tokens_total``) and embeddings per second. Run it with another
   checkout first on ``PYTHONPATH`` to compare two versions of the batcher.
2. ``compare``: batchserve (``batchserve serve``, one process) and infinity (``infinity_emb
   v2`` from the virtual environment ``--infinity``, its own dependencies, never this one's)
   on the same folder, started once each and measured in one interleaved run: for each
   round, each load, each server, ``--duration-s`` of closed-loop clients on OpenAI's
   ``/v1/embeddings`` (infinity's ``/embeddings``): 1, 16 and 64 clients sending one text a
   request, and ``--big-clients`` clients sending 256 texts a request. Reports embeddings per
   second and request latency p50/p99, medians over rounds, and batchserve's over infinity's
   in each round (the two measured one after the other), medians over rounds: on a shared
   host the ratios say more than either server's own figures. The load average before and
   after is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from loadtests import servers

BIG_REQUEST = 256
SMALL_REQUESTS = 64
#: Layers, width, attention heads.
SHAPES = {"tiny": (2, 16, 2), "bert6": (6, 384, 12)}
SERVED_NAME = "emb"
FORWARD_SECONDS = "batchserve_inference_duration_seconds_sum"
MAX_SEQ_LENGTH = 256
#: How long a client waits for an answer (both servers), and batchserve's request timeout:
#: a 256-text request to the 6-layer model takes minutes on a busy 2-core host.
REQUEST_TIMEOUT_S = 600


def texts(count: int, seed: int, shortest: int = 5, longest: int = 200) -> list[str]:
    """``count`` texts of ``shortest`` to ``longest`` tokens (two of them ``[CLS]`` and
    ``[SEP]``; each word of the corpus is one token)."""
    from tests.hf_folders import CORPUS

    rng = np.random.default_rng(seed)
    words = " ".join(CORPUS).lower().replace(",", "").split()
    return [
        " ".join(rng.choice(words, size=int(rng.integers(shortest, longest + 1)) - 2))
        for _ in range(count)
    ]


def save_folder(root: Path, model: str) -> Path:
    """The sentence-transformers folder of ``model`` (``SHAPES``), saved under ``root``."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Normalize,
        Pooling,
        Transformer,
    )
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    from tests.hf_folders import tokenizer

    layers, width, heads = SHAPES[model]
    trained = tokenizer()
    config = BertConfig(
        vocab_size=trained.get_vocab_size(),
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    bert = root / "bert"
    BertModel(config).eval().save_pretrained(bert)  # type: ignore[no-untyped-call]
    PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=trained,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
    ).save_pretrained(bert)
    encoder = Transformer(str(bert), max_seq_length=MAX_SEQ_LENGTH)
    pooled = Pooling(encoder.get_embedding_dimension(), pooling_mode="mean")
    folder = root / "st"
    SentenceTransformer(modules=[encoder, pooled, Normalize()], device="cpu").save(str(folder))
    return folder


def package(folder: Path, repository: Path) -> None:
    from service.server.cli import main as cli

    command = ["package", "--repository", str(repository), "--name", SERVED_NAME]
    if cli([*command, "--hf", str(folder)]) != 0:
        raise SystemExit(f"batchserve package --hf {folder} failed")


# ------------------------------------------------------------------ padding, in process


@dataclass(frozen=True)
class PaddingRound:
    batches: int
    padding: float
    """Padded positions over all positions computed."""
    embeddings_per_s: float
    forward_s: float
    """The batches' forward passes (collation and splitting included), added up: the device
    time the workload took, less sensitive than the wall time to a busy host's waits."""


async def padding_round(repository: Path, seed: int, max_batch_tokens: int) -> PaddingRound:
    """A 256-text request beside 64 one-text requests, all sent at once."""
    from asgi_lifespan import LifespanManager

    from service.config import Settings
    from service.server.single import create_app
    from tests.apps import registry_of
    from tests.fixtures import sample_total

    app = create_app(
        Settings(
            model_repository=repository,
            model_name=SERVED_NAME,
            device="cpu",
            max_batch_tokens=max_batch_tokens,
            warmup_batch_sizes=(1,),
            request_timeout_ms=300_000.0,
        )
    )
    many, singles = texts(BIG_REQUEST, seed), texts(SMALL_REQUESTS, seed + 1)
    async with LifespanManager(app, startup_timeout=300, shutdown_timeout=60):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            runner = app.state.engine.served.runner  # counts every batch once warmed up
            batches: list[tuple[int, int]] = []
            counted = runner.count_positions

            def record(real: int, padded: int) -> None:
                batches.append((real, padded))
                if counted is not None:
                    counted(real, padded)

            runner.count_positions = record
            registry = registry_of(app)
            forward_s = -sample_total(registry, FORWARD_SECONDS)
            started_s = time.perf_counter()
            answers = await asyncio.gather(
                client.post("/predict", json={"instances": many}, timeout=300),
                *(client.post("/predict", json={"instances": [t]}, timeout=300) for t in singles),
            )
            elapsed_s = time.perf_counter() - started_s
            forward_s += sample_total(registry, FORWARD_SECONDS)
    if any(answer.status_code != 200 for answer in answers):
        raise SystemExit(f"a request failed: {answers[0].text[:300]}")
    real = sum(real for real, _ in batches)
    padded = sum(padded for _, padded in batches)
    count = BIG_REQUEST + SMALL_REQUESTS
    return PaddingRound(len(batches), 1 - real / padded, count / elapsed_s, forward_s)


def padding_report(repository: Path, rounds: int, max_batch_tokens: int) -> list[str]:
    results = [
        asyncio.run(padding_round(repository, seed, max_batch_tokens)) for seed in range(rounds)
    ]
    import service

    lines = [
        "## Padding: a request of 256 texts beside 64 one-text requests, in process",
        "",
        f"`{Path(service.__file__).parent.parent}`; `max_batch_tokens` {max_batch_tokens}; "
        f"{rounds} round(s), each its own texts.",
        "",
        "| round | batches | padding | embeddings/s | forward passes, s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for index, result in enumerate(results):
        lines.append(
            f"| {index} | {result.batches} | {result.padding:.1%} | "
            f"{result.embeddings_per_s:,.1f} | {result.forward_s:.1f} |"
        )
    return lines


# ------------------------------------------------------------------ compare, two servers


@dataclass(frozen=True)
class Load:
    clients: int
    texts_per_request: int

    @property
    def name(self) -> str:
        return f"{self.clients} clients x {self.texts_per_request} text(s)"


@dataclass(frozen=True)
class LoadResult:
    embeddings_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int


async def closed_loop(
    url: str, model: str, load: Load, pool: list[str], duration_s: float
) -> LoadResult:
    """``load.clients`` clients, each sending its next request when its last is answered,
    for ``duration_s``; the texts drawn in turn from ``pool``."""
    latencies: list[float] = []
    errors = 0
    embedded = 0
    limits = httpx.Limits(max_connections=load.clients, max_keepalive_connections=load.clients)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
        end_s = time.perf_counter() + duration_s

        async def one_client(offset: int) -> None:
            nonlocal errors, embedded
            turn = offset
            while time.perf_counter() < end_s:
                start = turn * load.texts_per_request % len(pool)
                batch = (pool * 2)[start : start + load.texts_per_request]
                turn += load.clients
                sent_s = time.perf_counter()
                try:
                    response = await client.post(url, json={"model": model, "input": batch})
                except httpx.TimeoutException:
                    print(f"{url}: no answer in {REQUEST_TIMEOUT_S} s", file=sys.stderr)
                    errors += 1
                    continue
                if response.status_code != 200:
                    if not errors:
                        print(
                            f"{url}: {response.status_code} {response.text[:300]}", file=sys.stderr
                        )
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - sent_s)
                embedded += len(batch)

        started_s = time.perf_counter()
        await asyncio.gather(*(one_client(offset) for offset in range(load.clients)))
        elapsed_s = time.perf_counter() - started_s
    if not latencies:
        return LoadResult(0.0, float("nan"), float("nan"), errors)
    p50, p99 = np.percentile(np.array(latencies) * 1000, [50, 99])
    return LoadResult(embedded / elapsed_s, float(p50), float(p99), errors)


@contextlib.contextmanager
def batchserve(repository: Path, scratch: Path) -> Iterator[str]:
    env = servers.server_env(
        {
            "BATCHSERVE_DEVICE": "cpu",
            "BATCHSERVE_LOG_LEVEL": "warning",
            "BATCHSERVE_MODEL_REPOSITORY": str(repository),
            "BATCHSERVE_MODEL_NAME": SERVED_NAME,
            "BATCHSERVE_REQUEST_TIMEOUT_MS": str(REQUEST_TIMEOUT_S * 1000),
        }
    )
    command = servers.batchserve_command()
    with servers.serving(command, env, scratch / "batchserve.log", ready_timeout_s=300) as server:
        yield server.url + "/v1/embeddings"


def legacy_copy(folder: Path, target: Path) -> Path:
    """``folder`` as sentence-transformers 3 and transformers 4 saved such folders (the
    versions infinity-emb installs with): the module classes, settings and tokenizer class
    under their older names, the same weights and tokenizer."""
    import orjson

    shutil.copytree(folder, target)
    width = orjson.loads((folder / "1_Pooling" / "config.json").read_bytes())
    modules = orjson.loads((folder / "modules.json").read_bytes())
    for module in modules:
        module["type"] = "sentence_transformers.models." + module["type"].rsplit(".", 1)[1]
    (target / "modules.json").write_bytes(orjson.dumps(modules))
    (target / "sentence_bert_config.json").write_bytes(
        orjson.dumps({"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})
    )
    pooling = {
        "word_embedding_dimension": width["embedding_dimension"],
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (target / "1_Pooling" / "config.json").write_bytes(orjson.dumps(pooling))
    tokenizer = orjson.loads((folder / "tokenizer_config.json").read_bytes())
    tokenizer["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4's name
    (target / "tokenizer_config.json").write_bytes(orjson.dumps(tokenizer))
    return target


@contextlib.contextmanager
def infinity(venv: Path, folder: Path, scratch: Path) -> Iterator[str]:
    """``infinity_emb v2`` serving ``folder`` on CPU with its torch engine, at most 64 texts a
    batch (batchserve's ``max_batch_size``)."""
    folder = legacy_copy(folder, scratch / "st-legacy")
    command = [
        str(venv / "bin" / "infinity_emb"), "v2", "--model-id", str(folder),
        "--served-model-name", SERVED_NAME, "--engine", "torch", "--device", "cpu",
        "--port", "{port}", "--url-prefix", "", "--no-model-warmup", "--batch-size", "64",
        "--no-bettertransformer", "--log-level", "warning",
    ]  # fmt: skip
    # No telemetry: its client retries in the background, and nothing outside is reachable.
    env = servers.server_env({"DO_NOT_TRACK": "1"})
    server = servers.start(command, env, scratch / "infinity.log")
    assert server.process is not None
    try:
        servers.wait_ready(
            server.process, server.url, scratch / "infinity.log", 300, path="/health"
        )
        yield server.url + "/embeddings"
    finally:
        servers.stop(server.process)


def compare_report(
    folder: Path,
    repository: Path,
    venv: Path | None,
    scratch: Path,
    rounds: int,
    duration_s: float,
    big_clients: int,
) -> list[str]:
    loads = [Load(1, 1), Load(16, 1), Load(64, 1), Load(big_clients, BIG_REQUEST)]
    pool = texts(4096, seed=7)
    results: dict[tuple[str, str], list[LoadResult]] = {}
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        urls = {"batchserve": stack.enter_context(batchserve(repository, scratch))}
        if venv is not None:
            urls["infinity"] = stack.enter_context(infinity(venv, folder, scratch))
        for name, url in urls.items():  # warm up: every length bucket, every batch size
            asyncio.run(closed_loop(url, SERVED_NAME, Load(16, 16), pool, 2.0))
            print(f"{name}: warmed up", file=sys.stderr, flush=True)
        for round_index in range(rounds):
            for load in loads:
                for name, url in urls.items():
                    result = asyncio.run(closed_loop(url, SERVED_NAME, load, pool, duration_s))
                    results.setdefault((name, load.name), []).append(result)
                    print(
                        f"round {round_index} {name} {load.name}: "
                        f"{result.embeddings_per_s:,.0f}/s p50 {result.p50_ms:.0f} ms "
                        f"p99 {result.p99_ms:.0f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
    load_after = os.getloadavg()
    lines = [
        "## batchserve and infinity, one interleaved run",
        "",
        f"{rounds} round(s) of {duration_s:.0f} s per load and server, medians over rounds; "
        "closed-loop clients on 127.0.0.1 (one Python process), texts of 5 to 200 tokens. "
        f"Load average (1, 5, 15 min) before: {_load(load_before)}; after: {_load(load_after)}.",
        "",
        "| load | server | embeddings/s | p50 ms | p99 ms | errors |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for load in loads:
        for name in ("batchserve", "infinity"):
            runs = results.get((name, load.name))
            if not runs:
                continue
            lines.append(
                f"| {load.name} | {name} | "
                f"{statistics.median(r.embeddings_per_s for r in runs):,.1f} | "
                f"{statistics.median(r.p50_ms for r in runs):.0f} | "
                f"{statistics.median(r.p99_ms for r in runs):.0f} | "
                f"{sum(r.errors for r in runs)} |"
            )
    if venv is None:
        return lines
    lines += [
        "",
        "batchserve over infinity, each round's pair (measured one after the other), median "
        "and range over rounds: above 1 batchserve embeds more; below 1 it answers sooner.",
        "",
        "| load | embeddings/s | p50 | p99 |",
        "|---|---:|---:|---:|",
    ]
    for load in loads:
        ours, theirs = results[("batchserve", load.name)], results[("infinity", load.name)]
        pairs = list(zip(ours, theirs, strict=True))
        cells = [
            _ratios([_ratio(a.embeddings_per_s, b.embeddings_per_s) for a, b in pairs]),
            _ratios([_ratio(a.p50_ms, b.p50_ms) for a, b in pairs]),
            _ratios([_ratio(a.p99_ms, b.p99_ms) for a, b in pairs]),
        ]
        lines.append(f"| {load.name} | {' | '.join(cells)} |")
    return lines


def _load(averages: tuple[float, float, float]) -> str:
    return ", ".join(f"{average:.1f}" for average in averages)


def _ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs > 0 else float("nan")


def _ratios(ratios: list[float]) -> str:
    """The median of ``ratios``, and their range when there are several."""
    median = f"{statistics.median(ratios):.2f}"
    if len(ratios) < 2:
        return median
    return f"{median} ({min(ratios):.2f}-{max(ratios):.2f})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measure", choices=("padding", "compare"))
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=16_384)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--big-clients", type=int, default=4)
    parser.add_argument(
        "--infinity", type=Path, default=None, help="a virtual environment with infinity-emb"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batchserve-embeddings-") as scratch_name:
        scratch = Path(scratch_name)
        folder = save_folder(scratch, args.model)
        package(folder, scratch / "repository")
        if args.measure == "padding":
            lines = padding_report(scratch / "repository", args.rounds, args.max_batch_tokens)
        else:
            lines = compare_report(
                folder,
                scratch / "repository",
                args.infinity,
                scratch,
                args.rounds,
                args.duration_s,
                args.big_clients,
            )
    print("\n".join([f"# Embeddings ({args.model})", "", *lines]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
