"""What bounds what ``tune`` found, from what it measured: the model limit (rows/s of the
model alone), the HTTP ceiling (requests/s of the front end with a model that costs nothing)
and the candidates served.

Pure functions of those figures, tested alone. Two questions: when no configuration met
the p99 target, why not (``what_bounds``); when one did, what keeps its throughput where it
is (``what_bounds_throughput``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from service.server.tuning.search import Context, Result

#: A limit is what bounds once the throughput reaches this share of it.
NEAR_LIMIT_SHARE = 0.8


@dataclass(frozen=True)
class Bound:
    """What bounds the result (``model``, ``http``, ``cores``, ``p99 target`` or ``latency``),
    and why, in figures."""

    kind: str
    reason: str


def what_bounds(context: Context, best_p99_ms: float) -> Bound:
    """Why no configuration met the target. By Little's law ``concurrency`` requests in
    flight at R requests/s wait ``concurrency / R`` on average, so a rate below
    ``concurrency / p99`` cannot meet it: the model limit alone, the HTTP ceiling alone, or
    both sharing the host's cores (their costs per request add up)."""
    smallest = min(context.weights, key=lambda length: length or 0)
    one_row_ms = context.limit.batch_ms(1, smallest)
    model_rps = context.model_rps
    http_rps = max(context.ceiling_rps.values(), default=math.inf)
    concurrency = context.concurrency
    if one_row_ms >= context.p99_ms:
        return Bound("model", f"one row alone takes {one_row_ms:.1f} ms in the model")
    model_ms = concurrency / model_rps * 1000 if model_rps > 0 else math.inf
    if model_ms >= context.p99_ms:
        return Bound(
            "model",
            f"{concurrency} requests in flight at the model limit of "
            f"{_model_limit(context)} wait {model_ms:.1f} ms on average",
        )
    http_ms = concurrency / http_rps * 1000
    if http_ms >= context.p99_ms:
        return Bound(
            "http",
            f"{concurrency} requests in flight at the HTTP ceiling of {http_rps:,.0f} "
            f"requests/s wait {http_ms:.1f} ms on average",
        )
    shared_ms = model_ms + http_ms
    return Bound(
        "cores",
        f"the model ({model_ms:.1f} ms) and HTTP ({http_ms:.1f} ms) share {context.cores} "
        f"cores: {concurrency} requests in flight wait about {shared_ms:.1f} ms on average, "
        f"and the best p99 reached was {best_p99_ms:.1f} ms",
    )


def what_bounds_throughput(context: Context, served: Result, tried: Sequence[Result]) -> Bound:
    """What keeps ``served`` (the written configuration, which met the target) at its
    throughput: the model limit or the HTTP ceiling once it reaches ``NEAR_LIMIT_SHARE`` of
    the lower; both, sharing the cores (their costs per request add up), once it reaches that
    share of what they allow together; else the p99 target, when a candidate ``tried``
    served more but missed it; else the time a request takes beyond the model's and HTTP's
    work (Little's law: ``concurrency`` requests in flight, each answered in about its p50)."""
    rps = served.throughput_rps
    model_rps = context.model_rps
    http_rps = max(context.ceiling_rps.values(), default=math.inf)
    together_rps = 1 / (1 / model_rps + 1 / http_rps) if model_rps > 0 else 0.0
    figures = (
        f"{rps:,.0f} requests/s is {_share(rps, model_rps)} of the model limit "
        f"({_model_limit(context)}) and {_share(rps, http_rps)} of the HTTP ceiling "
        f"({http_rps:,.0f} requests/s)"
    )
    lower_rps = min(model_rps, http_rps)
    if rps >= NEAR_LIMIT_SHARE * lower_rps:
        if model_rps <= http_rps:
            return Bound("model", f"{figures}: the model runs about as fast as it can here")
        return Bound("http", f"{figures}: the front end answers about as fast as it can here")
    if rps >= NEAR_LIMIT_SHARE * together_rps:
        return Bound(
            "cores",
            f"{figures}; the two share {context.cores} cores, and their costs per request "
            f"added up allow about {together_rps:,.0f} requests/s",
        )
    faster = [
        result
        for result in tried
        if result.throughput_rps > rps and result.errors == 0 and result.p99_ms > context.p99_ms
    ]
    if faster:
        fastest = max(faster, key=lambda result: result.throughput_rps)
        return Bound(
            "p99 target",
            f"{figures}; `{fastest.candidate.label()}` served {fastest.throughput_rps:,.0f} "
            f"requests/s in the search, with p99 {fastest.p99_ms:.1f} ms, over the target",
        )
    return Bound(
        "latency",
        f"{figures}, and {_share(rps, together_rps)} of the about {together_rps:,.0f} "
        f"requests/s they allow together on {context.cores} cores: {context.concurrency} "
        f"requests in flight, each answered in about {served.p50_ms:.1f} ms (p50), give "
        "about that many (Little's law); the time a request takes beyond the model's and "
        "HTTP's own work (waiting for batch-mates, the hop between processes, the load "
        "generator's share of the cores, other load on this host) bounds it; more requests "
        "in flight would serve more",
    )


def _model_limit(context: Context) -> str:
    rows = f"{context.model_rows_per_s:,.0f} rows/s"
    if context.rows_per_request == 1:
        return rows
    return f"{rows}, {context.model_rps:,.0f} requests/s of {context.rows_per_request:.3g} rows"


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole > 0 and math.isfinite(whole) else "-"
