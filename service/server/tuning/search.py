"""The guided search: which candidates are worth serving, pruned by what was measured.

Pure functions of the measurements (no clock, no server), so they are tested alone. The
search is a coordinate descent over a few stages; each stage varies one group of settings
around the best configuration so far and keeps the candidates the model limit and the HTTP
ceiling leave open. A batch that alone takes more than a third of the p99 target cannot meet
it (a request may wait for the batch ahead of it, then run in its own), so larger batches,
longer waits and longer padded batches are never served.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from service.buckets import bucket_of
from service.server.tuning.space import Candidate

#: The share of the p99 target one batch may take: queued behind one batch, then its own.
BATCH_SHARE_OF_P99 = 1 / 3
#: A batch size is big enough once it reaches this share of the best feasible rows/s.
NEAR_BEST_SHARE = 0.9
STAGES = ("batch", "wait", "processes", "lengths")


@dataclass(frozen=True)
class ModelLimit:
    """Rows/s of the model alone per padded length (None: fixed-shape inputs) and batch size."""

    rows_per_s: Mapping[int | None, Mapping[int, float]]
    memory_bytes: int = 0
    torch_threads: int = 1

    def rate(self, batch: int, length: int | None) -> float:
        """Rows/s at ``batch``; where ``batch`` was too slow to measure at this length, the
        largest measured batch's (the token budget keeps long batches that small)."""
        rates = self.rows_per_s.get(length, {})
        sizes = [size for size in rates if size <= batch]
        return rates[max(sizes)] if sizes else 0.0

    def mixed_rows_per_s(self, batch: int, weights: Mapping[int | None, float]) -> float:
        """Rows/s at ``batch`` over the workload's mix of lengths (weights sum to 1): the
        harmonic mean, as each row costs its own bucket's time. 0 if a length lacks it."""
        seconds_per_row = 0.0
        for length, weight in weights.items():
            rate = self.rate(batch, length)
            if rate <= 0:
                return 0.0
            seconds_per_row += weight / rate
        return 1 / seconds_per_row if seconds_per_row > 0 else 0.0

    def batch_ms(self, batch: int, length: int | None) -> float:
        """Milliseconds one batch takes (infinite when not measured: too slow to try)."""
        rate = self.rows_per_s.get(length, {}).get(batch, 0.0)
        return batch / rate * 1000 if rate > 0 else math.inf

    def best_rows_per_s(self, weights: Mapping[int | None, float]) -> float:
        sizes = {size for rates in self.rows_per_s.values() for size in rates}
        return max((self.mixed_rows_per_s(size, weights) for size in sizes), default=0.0)


@dataclass(frozen=True)
class Context:
    """What the search knows before serving anything."""

    cores: int
    concurrency: int
    p99_ms: float
    limit: ModelLimit
    weights: Mapping[int | None, float]
    """Share of the workload's requests per padded length (``{None: 1.0}`` for fixed shapes)."""
    ceiling_rps: Mapping[int, float] = field(default_factory=dict)
    """HTTP ceiling (requests/s) per number of front ends."""
    max_length: int | None = None
    rows_per_request: float = 1.0
    """Rows (instances) a request holds, on average over the workload."""

    @property
    def model_rows_per_s(self) -> float:
        """The model limit over the workload's lengths, at its best batch size."""
        return self.limit.best_rows_per_s(self.weights)

    @property
    def model_rps(self) -> float:
        """The model limit in requests/s, to set beside the HTTP ceiling."""
        return self.model_rows_per_s / self.rows_per_request

    @property
    def batch_ms_allowed(self) -> float:
        return self.p99_ms * BATCH_SHARE_OF_P99

    def mixed_batch_ms(self, batch: int) -> float:
        rate = self.limit.mixed_rows_per_s(batch, self.weights)
        return batch / rate * 1000 if rate > 0 else math.inf


@dataclass(frozen=True)
class Result:
    """One candidate served under load."""

    candidate: Candidate
    throughput_rps: float
    p50_ms: float
    p99_ms: float
    errors: int = 0
    memory_bytes: int = 0
    answered: int = 0
    """Requests answered in the measurement window (the p99's sample)."""

    def meets(self, p99_ms: float) -> bool:
        return self.errors == 0 and self.throughput_rps > 0 and self.p99_ms <= p99_ms


def best(results: Sequence[Result], p99_ms: float) -> Result | None:
    """The highest throughput whose p99 meets the target; else the lowest p99 reached."""
    meeting = [result for result in results if result.meets(p99_ms)]
    if meeting:
        return max(meeting, key=lambda result: result.throughput_rps)
    served = [result for result in results if result.throughput_rps > 0]
    return min(served, key=lambda result: result.p99_ms, default=None)


def power_of_two_at_least(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def batch_sizes(context: Context) -> list[int]:
    """Batch sizes worth serving: those whose batch fits the p99 share, up to the smallest
    that reaches ``NEAR_BEST_SHARE`` of the best such rows/s, and that one doubled. A batch
    cannot hold more rows than ``concurrency`` requests send, so none above that is tried."""
    cap = power_of_two_at_least(math.ceil(context.concurrency * context.rows_per_request))
    sizes = sorted({size for rates in context.limit.rows_per_s.values() for size in rates})
    # The mix is what the row budget limits; the longest batches are the token budget's.
    feasible = [
        size
        for size in sizes
        if size <= cap and context.mixed_batch_ms(size) <= context.batch_ms_allowed
    ]
    if not feasible:
        return [1]
    rates = {size: context.limit.mixed_rows_per_s(size, context.weights) for size in feasible}
    top = max(rates.values())
    enough = min(size for size in feasible if rates[size] >= NEAR_BEST_SHARE * top)
    chosen = [size for size in feasible if size in {enough // 2, enough, enough * 2}]
    return chosen or [enough]


def start_candidate(context: Context, default_edges: Sequence[int] = ()) -> Candidate:
    """Where the search starts: the batch size the model limit favours, no extra wait, and
    for a variable-length model the token budget that keeps its longest batches in time."""
    sizes = batch_sizes(context)
    middle = sizes[len(sizes) // 2] if len(sizes) > 2 else sizes[-1]
    start = Candidate(max_batch_size=middle, max_wait_ms=0.0)
    if context.max_length is not None and default_edges:
        tokens = max(token_budget(context, default_edges), max(default_edges))
        start = start.changed(max_batch_tokens=tokens)
    return start


def wait_candidates(context: Context, current: Candidate) -> list[Candidate]:
    """Adaptive with no wait, with half a batch's time, and fixed with a batch's time: only
    waits that leave the p99 target room (a wait adds to every waiting request)."""
    batch_ms = context.mixed_batch_ms(current.max_batch_size)
    allowed = context.batch_ms_allowed
    options = [("adaptive", 0.0)]
    if math.isfinite(batch_ms):
        half = round(min(batch_ms / 2, allowed), 1)
        whole = round(min(batch_ms, allowed), 1)
        options += [("adaptive", half), ("fixed", whole)]
    return [
        current.changed(batch_policy=policy, max_wait_ms=wait)
        for policy, wait in dict.fromkeys(options)
        if wait <= allowed
    ]


def process_candidates(context: Context, current: Candidate) -> list[Candidate]:
    """Torch threads and front ends. One process with each useful thread count; front ends
    plus an engine only when the HTTP ceiling of one process is below the model limit (more
    front ends can only help when HTTP is what bounds) and there are cores to give them."""
    cores = max(1, context.cores)
    found = [
        current.changed(engine_mode="in_process", workers=1, torch_threads=threads)
        for threads in sorted({1, max(1, cores - 1), cores})
    ]
    one_front_end = context.ceiling_rps.get(1, math.inf)
    if cores >= 2 and one_front_end < context.model_rps:
        for workers in sorted({1, max(1, cores // 2), max(1, cores - 1)}):
            threads = max(1, cores - workers)
            found.append(
                current.changed(engine_mode="process", workers=workers, torch_threads=threads)
            )
    return found


def coarser_edges(edges: Sequence[int]) -> tuple[int, ...]:
    """Every other bucket edge, keeping the longest: fewer, fuller groups, more padding."""
    if len(edges) <= 2:
        return tuple(edges)
    kept = list(edges[-1::-2])[::-1]
    return tuple(kept)


def token_budget(context: Context, edges: Sequence[int]) -> int:
    """Most padded positions such that a batch at the longest bucket fits the p99 share."""
    longest = max(edges)
    allowed = context.batch_ms_allowed
    rates = context.limit.rows_per_s.get(longest, {})
    fitting = [size for size in rates if context.limit.batch_ms(size, longest) <= allowed]
    return longest * max(fitting, default=1)


def length_candidates(
    context: Context, current: Candidate, default_edges: Sequence[int]
) -> list[Candidate]:
    """For variable-length models: a token budget that keeps the longest batches within the
    p99 share, with the default buckets and with coarser ones."""
    if context.max_length is None or not default_edges:
        return []
    found = []
    for edges in dict.fromkeys([tuple(default_edges), coarser_edges(default_edges)]):
        tokens = max(token_budget(context, edges), max(edges))
        configured = () if edges == tuple(default_edges) else edges
        found.append(current.changed(length_buckets=configured, max_batch_tokens=tokens))
    return found


def stage_candidates(
    stage: str, context: Context, current: Candidate, default_edges: Sequence[int] = ()
) -> list[Candidate]:
    """The candidates of one stage around ``current`` (the best so far)."""
    if stage == "batch":
        return [current.changed(max_batch_size=size) for size in batch_sizes(context)]
    if stage == "wait":
        return wait_candidates(context, current)
    if stage == "processes":
        return process_candidates(context, current)
    if stage == "lengths":
        return length_candidates(context, current, default_edges)
    raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")


def length_weights(lengths: Sequence[int | None], edges: Sequence[int]) -> dict[int | None, float]:
    """The share of requests per padded length (their bucket edge)."""
    if not lengths:
        return {None: 1.0}
    counts: dict[int | None, int] = {}
    for length in lengths:
        key = None if length is None or not edges else bucket_of(length, edges)
        counts[key] = counts.get(key, 0) + 1
    return {key: count / len(lengths) for key, count in counts.items()}
