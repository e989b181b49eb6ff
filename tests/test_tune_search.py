"""The tuning search's pure parts: pruning by the model limit, the HTTP ceiling and the p99
target; the choice of a winner; the diagnosis when nothing meets the target; the budget."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from service import cpus
from service.config import Settings
from service.engine import runner
from service.server.tuning import tune
from service.server.tuning.bounds import what_bounds
from service.server.tuning.budget import (
    Plan,
    Progress,
    plan_budget,
    rounds_for,
    window_for,
)
from service.server.tuning.search import (
    Context,
    ModelLimit,
    Result,
    batch_sizes,
    best,
    coarser_edges,
    length_candidates,
    length_weights,
    process_candidates,
    stage_candidates,
    start_candidate,
    token_budget,
    wait_candidates,
)
from service.server.tuning.space import TUNED_FIELDS, Candidate, defaults_candidate

# A fixed-shape model whose batch of b rows takes 1 + 0.25 b ms: rows/s grows with b.
FIXED = ModelLimit(
    rows_per_s={None: {b: b / ((1 + 0.25 * b) / 1000) for b in (1, 2, 4, 8, 16, 32, 64)}}
)


def context(limit: ModelLimit = FIXED, **changes: object) -> Context:
    values: dict[str, object] = {
        "cores": 2,
        "concurrency": 64,
        "p99_ms": 30.0,
        "limit": limit,
        "weights": {None: 1.0},
        "ceiling_rps": {1: 5000.0},
    }
    return Context(**(values | changes))  # type: ignore[arg-type]


def result(candidate: Candidate, rps: float, p99_ms: float, errors: int = 0) -> Result:
    return Result(candidate, rps, p99_ms / 2, p99_ms, errors)


def test_the_defaults_candidate_is_settings_defaults() -> None:
    defaults = Settings.model_construct()
    candidate = defaults_candidate()
    assert candidate == Candidate()
    for name in TUNED_FIELDS:
        assert getattr(candidate, name) == getattr(defaults, name), name
    assert candidate.label() == "defaults"


def test_a_candidate_renders_as_valid_settings_variables() -> None:
    candidate = Candidate(max_batch_size=8, max_wait_ms=1.5, length_buckets=(16, 64))
    variables = candidate.environment()
    assert variables["BATCHSERVE_LENGTH_BUCKETS"] == "16,64"
    assert variables["BATCHSERVE_MAX_WAIT_MS"] == "1.5"
    settings = Settings(
        **{key.removeprefix("BATCHSERVE_").lower(): v for key, v in variables.items()}
    )  # type: ignore[arg-type]
    assert settings.max_batch_size == 8
    assert settings.length_buckets == (16, 64)
    assert candidate.label() == "batch=8 wait_ms=1.5 buckets=16,64"


def test_batch_sizes_stop_where_a_batch_would_take_more_than_a_third_of_the_p99() -> None:
    # 30 ms p99: batches up to 10 ms, so 32 rows (9 ms) fit and 64 (17 ms) do not.
    assert max(batch_sizes(context())) <= 32
    # 9 ms p99: 3 ms per batch at most, so 8 rows (3 ms) is the largest.
    assert batch_sizes(context(p99_ms=9.0)) == [4, 8]


def test_batch_sizes_never_exceed_what_the_concurrency_can_fill() -> None:
    assert max(batch_sizes(context(concurrency=3))) <= 4


def test_batch_sizes_fall_back_to_one_row_when_even_one_is_too_slow() -> None:
    assert batch_sizes(context(p99_ms=0.5)) == [1]


def test_unmeasured_batch_sizes_are_never_proposed() -> None:
    partial = ModelLimit(rows_per_s={None: {1: 1000.0, 2: 1900.0}})
    assert set(batch_sizes(context(partial))) <= {1, 2}
    assert batch_sizes(context(ModelLimit(rows_per_s={None: {}}))) == [1]


def test_the_search_starts_from_a_batch_size_the_model_limit_favours() -> None:
    start = start_candidate(context())
    assert start.max_batch_size in batch_sizes(context())
    assert start.max_wait_ms == 0


def test_waits_leave_the_p99_room() -> None:
    current = Candidate(max_batch_size=32)
    found = wait_candidates(context(p99_ms=9.0), current)
    assert found[0] == current.changed(max_wait_ms=0.0)
    assert all(candidate.max_wait_ms <= 3.0 for candidate in found)
    assert {candidate.batch_policy for candidate in found} == {"adaptive", "fixed"}


def test_front_ends_are_tried_only_when_http_bounds_below_the_model() -> None:
    slow_http = process_candidates(context(ceiling_rps={1: 100.0}), Candidate())
    fast_http = process_candidates(context(ceiling_rps={1: 1e9}), Candidate())
    assert any(candidate.engine_mode == "process" for candidate in slow_http)
    assert all(candidate.engine_mode == "in_process" for candidate in fast_http)
    assert {candidate.torch_threads for candidate in fast_http} == {1, 2}
    for candidate in slow_http:
        candidate.settings()  # valid: in_process always with one worker


def test_one_core_tries_one_process_with_one_thread() -> None:
    assert process_candidates(context(cores=1, ceiling_rps={1: 1.0}), Candidate()) == [
        Candidate(engine_mode="in_process", torch_threads=1)
    ]


# A variable-length model: a row costs its padded length in microseconds, plus 1 ms a batch.
EDGES = (8, 16, 32, 64, 128, 256, 512)
VARIABLE = ModelLimit(
    rows_per_s={
        length: {b: b / ((1 + b * length / 1000) / 1000) for b in (1, 2, 4, 8, 16, 32, 64)}
        for length in EDGES
    }
)


def test_coarser_edges_keep_every_other_edge_and_the_longest() -> None:
    assert coarser_edges(EDGES) == (8, 32, 128, 512)
    assert coarser_edges((16, 32, 64, 128, 256, 512)) == (32, 128, 512)
    assert coarser_edges((8, 512)) == (8, 512)


def test_the_token_budget_keeps_the_longest_batches_within_the_p99_share() -> None:
    # 30 ms p99: 10 ms a batch; at 512 a batch of 16 rows takes 9.2 ms, 32 take 17.4 ms.
    assert token_budget(context(VARIABLE), EDGES) == 16 * 512
    # Even one row too slow: one row's worth, never less.
    assert token_budget(context(VARIABLE, p99_ms=1.0), EDGES) == 512


def test_length_candidates_only_for_variable_length_models() -> None:
    assert length_candidates(context(), Candidate(), ()) == []
    weights = length_weights([8, 100, 500, 500], EDGES)
    assert weights == {8: 0.25, 128: 0.25, 512: 0.5}
    found = length_candidates(
        context(VARIABLE, weights=weights, max_length=512), Candidate(), EDGES
    )
    assert [candidate.length_buckets for candidate in found] == [(), (8, 32, 128, 512)]
    assert all(candidate.max_batch_tokens == 16 * 512 for candidate in found)
    for candidate in found:
        candidate.settings()


def test_mixed_rows_per_s_is_the_harmonic_mean_over_lengths() -> None:
    weights = {8: 0.5, 512: 0.5}
    mixed = VARIABLE.mixed_rows_per_s(1, weights)
    expected = 1 / (0.5 / VARIABLE.rows_per_s[8][1] + 0.5 / VARIABLE.rows_per_s[512][1])
    assert mixed == pytest.approx(expected)
    # Larger than measured: the largest measured batch's rate (the token budget caps it).
    assert VARIABLE.mixed_rows_per_s(1024, weights) == VARIABLE.mixed_rows_per_s(64, weights)
    assert VARIABLE.mixed_rows_per_s(1, {7: 1.0}) == 0.0


def test_a_variable_length_model_starts_with_a_token_budget() -> None:
    ctx = context(VARIABLE, weights={8: 0.5, 512: 0.5}, max_length=512)
    assert start_candidate(ctx, EDGES).max_batch_tokens == 16 * 512
    assert start_candidate(context()).max_batch_tokens == Candidate().max_batch_tokens


def test_every_stage_proposes_valid_settings() -> None:
    ctx = context(VARIABLE, weights={8: 0.5, 512: 0.5}, max_length=512, ceiling_rps={1: 10.0})
    for stage in ("batch", "wait", "processes", "lengths"):
        for candidate in stage_candidates(stage, ctx, Candidate(), EDGES):
            candidate.settings()
    with pytest.raises(ValueError, match="unknown stage 'grid'"):
        stage_candidates("grid", ctx, Candidate())


def test_the_winner_is_the_fastest_that_meets_the_target() -> None:
    a, b, c = Candidate(max_batch_size=1), Candidate(max_batch_size=2), Candidate()
    results = [result(a, 900, 10), result(b, 1500, 40), result(c, 1200, 20)]
    assert best(results, p99_ms=25) == results[2]
    assert best(results, p99_ms=50) == results[1]


def test_errors_disqualify_and_without_a_winner_the_lowest_p99_is_chosen() -> None:
    a, b = Candidate(max_batch_size=1), Candidate(max_batch_size=2)
    results = [result(a, 2000, 5, errors=3), result(b, 900, 70)]
    assert best(results, p99_ms=10) == results[0]  # the lowest p99 reached, flagged as missing
    assert not results[0].meets(10)
    assert best([result(a, 0, math.inf)], 10) is None
    assert best([], 10) is None


def test_the_model_bounds_when_one_row_alone_is_too_slow() -> None:
    bound = what_bounds(context(p99_ms=1.0), best_p99_ms=5.0)
    assert bound.kind == "model"
    assert "one row" in bound.reason


def test_the_model_bounds_when_its_limit_cannot_serve_the_concurrency_in_time() -> None:
    slow = ModelLimit(rows_per_s={None: {1: 200.0, 2: 300.0}})
    bound = what_bounds(context(slow, p99_ms=100.0, concurrency=64), best_p99_ms=300.0)
    assert bound.kind == "model"
    assert "300 rows/s" in bound.reason


def test_http_bounds_when_the_ceiling_cannot_serve_the_concurrency_in_time() -> None:
    bound = what_bounds(context(ceiling_rps={1: 1000.0, 2: 1500.0}, p99_ms=20.0), 80.0)
    assert bound.kind == "http"
    assert "1,500 requests/s" in bound.reason


def test_the_cores_bound_when_neither_alone_explains_it() -> None:
    bound = what_bounds(context(ceiling_rps={1: 6000.0}, p99_ms=20.0), best_p99_ms=25.0)
    assert bound.kind == "cores"
    assert "share 2 cores" in bound.reason


def test_the_budget_plan_grows_with_the_budget() -> None:
    short, default = plan_budget(30, cores=2), plan_budget(300, cores=2)
    assert short == Plan(limit_s=2.4, measure_s=1.0, warmup_s=0.3, rounds=2, ceiling_workers=(1,))
    assert default.measure_s == 5.0
    assert default.rounds == 3
    assert default.ceiling_workers == (1, 2)
    assert plan_budget(300, cores=1).ceiling_workers == (1,)


def test_tune_counts_a_containers_cpu_quota_as_the_engines_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a container limited to one CPU on a larger node, tune plans and searches one core
    (its engines size torch's threads by the same count), not the node's."""
    quota = tmp_path / "cpu.max"
    quota.write_text("100000 100000\n")
    monkeypatch.setattr(cpus, "CPU_QUOTA_FILE", quota)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert cpus.usable_cpus() == 1
    quota.write_text("250000 100000\n")
    assert cpus.usable_cpus() == 3
    quota.write_text("max 100000\n")
    assert cpus.usable_cpus() == 4
    assert tune.usable_cpus is runner.usable_cpus is cpus.usable_cpus


def test_progress_stops_trials_that_would_leave_no_time_to_re_measure() -> None:
    progress = Progress(60.0, plan_budget(60.0, cores=2))
    progress.started_in(10.0)
    progress.trial_took(12.0)
    # left 60: a 12 s trial + 10 s start + 2 x 2 rounds x 1.3 s + 6 s to finish fits.
    assert progress.time_for_a_trial()
    progress.trial_took(40.0)
    assert not progress.time_for_a_trial()
    assert progress.rounds_left() == 2


def test_slow_models_get_longer_windows_within_bounds() -> None:
    plan = plan_budget(300, cores=2)
    assert window_for(plan, expected_rps=10_000).measure_s == plan.measure_s
    assert window_for(plan, expected_rps=25).measure_s == 8.0  # 200 answers at 25/s
    assert window_for(plan, expected_rps=1).measure_s == 2 * plan.measure_s
    assert window_for(plan, expected_rps=0).measure_s == 2 * plan.measure_s


def test_long_windows_leave_fewer_rounds_to_the_re_measurement() -> None:
    plan = plan_budget(300, cores=2)
    assert rounds_for(plan, 300).rounds == 3  # 3 x 2 x 6 s = 36 s of 300
    assert rounds_for(window_for(plan, 1), 300).rounds == 3  # 3 x 2 x 11 s = 66 s
    assert rounds_for(window_for(plan, 1), 120).rounds == 2  # never fewer than 2
