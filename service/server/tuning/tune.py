"""``batchserve tune``: measure the model limit and the HTTP ceiling, search, re-measure the
pick against the defaults in interleaved rounds, and report.

The defaults' server, the first trial, keeps running (idle) until the re-measurement, so that
only the pick's has to start again. A trial starts only while the time left holds it and
the re-measurement (``budget.Progress``). Every server is one of ``children``: it dies with
``tune``.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from service.buckets import manifest_length_edges
from service.config import ENV_PREFIX, Settings, load_settings
from service.cpus import usable_cpus
from service.repository import ModelRepository
from service.server.tuning import search, trials
from service.server.tuning.bodies import Workload, workload
from service.server.tuning.bounds import what_bounds, what_bounds_throughput
from service.server.tuning.budget import Progress, rounds_for, window_for
from service.server.tuning.children import Children
from service.server.tuning.comparison import compare
from service.server.tuning.model_limit import measure_limit
from service.server.tuning.report import Trial, TuneReport
from service.server.tuning.search import STAGES, Context, Result
from service.server.tuning.space import TUNED_FIELDS, Candidate, defaults_candidate

EXIT_TARGET_MISSED = 3


def base_environment(environ: Mapping[str, str], settings: Settings) -> dict[str, str]:
    """The environment trial servers start in: this one without the tuned settings (so
    "defaults" are ``Settings``' defaults), naming the repository, model and version tuned."""
    tuned = {ENV_PREFIX + name.upper() for name in TUNED_FIELDS}
    kept = {key: value for key, value in environ.items() if key not in tuned}
    kept.pop(ENV_PREFIX + "MODELS", None)
    return kept | {
        ENV_PREFIX + "MODEL_REPOSITORY": str(settings.model_repository.resolve()),
        ENV_PREFIX + "MODEL_NAME": settings.model_name,
        ENV_PREFIX + "MODEL_VERSION": settings.model_version,
    }


def describe(result: Result, target_ms: float) -> str:
    verdict = "meets" if result.meets(target_ms) else "misses"
    errors = f", {result.errors} errors" if result.errors else ""
    return (
        f"{result.throughput_rps:,.0f} requests/s, p50 {result.p50_ms:.1f} ms, "
        f"p99 {result.p99_ms:.1f} ms{errors}: {verdict} {target_ms:g} ms"
    )


def medians(candidate: Candidate, results: Sequence[Result]) -> Result:
    """One result holding the medians of ``results`` (rounds of ``candidate``)."""
    return Result(
        candidate,
        statistics.median(result.throughput_rps for result in results),
        statistics.median(result.p50_ms for result in results),
        statistics.median(result.p99_ms for result in results),
        errors=sum(result.errors for result in results),
        memory_bytes=max(result.memory_bytes for result in results),
        answered=sum(result.answered for result in results),
    )


class Tuning:
    """One run: what was measured so far, and the servers it keeps."""

    def __init__(
        self,
        report: TuneReport,
        environ: Mapping[str, str],
        load: Workload,
        logs: Path,
        children: Children,
    ) -> None:
        self.report = report
        self.environ = environ
        self.load = load
        self.logs = logs
        self.children = children
        self.defaults_server: trials.Server | None = None

    def measurement(self, progress: Progress) -> trials.Measurement:
        plan = progress.plan
        return trials.Measurement(
            self.report.concurrency, plan.measure_s, plan.warmup_s, progress.ready_timeout_s()
        )

    async def serve(self, candidate: Candidate, progress: Progress, log: str) -> trials.Server:
        started_s = time.monotonic()
        environ = dict(self.environ) | candidate.environment()
        server = await trials.start_ready(
            self.children,
            trials.serve_command(),
            environ,
            progress.ready_timeout_s(),
            self.logs / log,
        )
        progress.started_in(time.monotonic() - started_s)
        return server

    async def start_defaults(self, progress: Progress) -> None:
        """Start the defaults' server, kept until the re-measurement (a failure is noted,
        and the defaults' trial will try again)."""
        try:
            self.defaults_server = await self.serve(defaults_candidate(), progress, "defaults.log")
        except trials.TrialError as error:
            self.report.notes.append(f"the defaults' server failed to start: {error}")

    async def trial(self, stage: str, candidate: Candidate, progress: Progress) -> None:
        """Serve and measure ``candidate`` once (not again if it was measured)."""
        if any(trial.result.candidate == candidate for trial in self.report.trials):
            return
        index = len(self.report.trials)
        progress.say(f"trial {index} ({stage}): {candidate.label()}")
        started_s = time.monotonic()
        target = self.report.p99_target_ms
        keep = candidate == defaults_candidate()
        try:
            server = self.defaults_server if keep else None
            if server is None:
                server = await self.serve(candidate, progress, f"trial-{index}.log")
        except trials.TrialError as error:
            self.report.notes.append(f"trial {index} ({candidate.label()}) failed: {error}")
            result = Result(candidate, 0.0, float("inf"), float("inf"), errors=1)
        else:
            try:
                result = await trials.measure_candidate(
                    candidate, server, self.load.bodies, self.measurement(progress)
                )
            finally:
                if keep:
                    self.defaults_server = server
                else:
                    await trials.stop(self.children, server)
        progress.trial_took(time.monotonic() - started_s)
        self.report.trials.append(Trial(stage, result))
        progress.say(f"trial {index}: {describe(result, target)}")

    async def remeasure(self, progress: Progress) -> None:
        """The pick and the defaults side by side, measured in alternate rounds; the pick is
        written only when it is better beyond the noise (``comparison``), else the defaults."""
        report = self.report
        assert report.winner is not None
        winner, defaults = report.winner.candidate, defaults_candidate()
        try:
            if self.defaults_server is None:
                self.defaults_server = await self.serve(defaults, progress, "defaults-2.log")
            # The defaults won: their one server is measured in every round as both.
            tuned_server = (
                self.defaults_server
                if winner == defaults
                else await self.serve(winner, progress, "tuned.log")
            )
        except trials.TrialError as error:
            report.notes.append(f"the re-measurement failed: {error}")
            return
        try:
            rounds = progress.rounds_left()
            progress.say(f"re-measuring the pick against the defaults: {rounds} rounds")
            served = [(defaults, self.defaults_server)]
            if tuned_server is not self.defaults_server:
                served.append((winner, tuned_server))
            runs = await trials.interleaved(
                served, self.load.bodies, self.measurement(progress), rounds
            )
            default_runs, tuned_runs = runs[0], runs[-1]
        finally:
            if tuned_server is not self.defaults_server:
                await trials.stop(self.children, tuned_server)
        report.remeasured = {"tuned": tuned_runs, "defaults": default_runs}
        tuned, defaults_median = medians(winner, tuned_runs), medians(defaults, default_runs)
        progress.say(
            f"tuned: {tuned.throughput_rps:,.0f} requests/s, p99 {tuned.p99_ms:.1f} ms; "
            f"defaults: {defaults_median.throughput_rps:,.0f} requests/s, p99 "
            f"{defaults_median.p99_ms:.1f} ms (medians)"
        )
        if winner == defaults:
            report.notes.append(
                "the defaults won the search: the re-measurement measured their server alone, "
                "so both rows are the same runs"
            )
            report.final = defaults_median
            return
        report.comparison = compare(tuned_runs, default_runs, report.p99_target_ms)
        if report.comparison.pick_is_better:
            report.final = tuned
            return
        report.notes.append(
            f"the defaults are within the noise of the search's pick `{winner.label()}`: "
            f"{report.comparison.reason}; so the defaults are written"
        )
        progress.say(f"keeping the defaults: {report.comparison.reason}")
        measured = [t.result for t in report.trials if t.result.candidate == defaults]
        report.winner = measured[0] if measured else default_runs[0]
        report.final = defaults_median

    async def close(self) -> None:
        if self.defaults_server is not None:
            await trials.stop(self.children, self.defaults_server)
            self.defaults_server = None


async def tune(
    *,
    model: str,
    version: str,
    concurrency: int,
    p99_ms: float,
    logs: Path,
    progress: Progress,
    children: Children,
    repository: Path | None = None,
    samples: Sequence[Path] = (),
) -> TuneReport:
    """Run the whole tuning within ``progress``'s budget; the report of what was found."""
    plan = progress.plan
    located = {} if repository is None else {"model_repository": repository}
    configured = load_settings(**located)
    manifest = ModelRepository(configured.model_repository).resolve(model, version)
    load = workload(manifest, configured, samples)
    cap = min(4096, search.power_of_two_at_least(math.ceil(concurrency * load.rows_per_request)))
    # The model alone, as one process serving alone loads it, with the tuned settings at
    # their defaults (an environment's own values for them are what tune replaces).
    settings = load_settings(
        **located,
        model_name=model,
        model_version=manifest.version,
        models=(),
        engine_mode="in_process",
        workers=1,
        torch_threads=0,
        length_buckets=(),
        max_batch_size=cap,
        warmup_batch_sizes=(1,),
    )
    environ = base_environment(os.environ, settings)
    cores = usable_cpus()
    edges = manifest_length_edges(manifest, ())
    weights = search.length_weights(load.lengths, edges)
    progress.say(f"requests: {load.description}")

    progress.say(f"measuring the model limit of {manifest.label} ({plan.limit_s:.0f} s at most)")
    limit, _ = await measure_limit(
        settings,
        lengths=sorted(weights, key=lambda length: length or 0),
        largest_batch=cap,
        slowest_batch_ms=p99_ms * search.BATCH_SHARE_OF_P99,
        budget_s=plan.limit_s,
        progress=progress.say,
    )
    model_rows_per_s = limit.best_rows_per_s(weights)
    report = TuneReport(
        model=model,
        version=manifest.version,
        version_asked=version,
        repository=settings.model_repository.resolve(),
        requests=load.description,
        rows_per_request=load.rows_per_request,
        cores=cores,
        concurrency=concurrency,
        p99_target_ms=p99_ms,
        budget_s=progress.budget_s,
        limit=limit,
        model_limit_rps=model_rows_per_s,
        ceiling_rps={},
    )
    tuning = Tuning(report, environ, load, logs, children)
    try:
        model_rps = model_rows_per_s / load.rows_per_request
        await _measure_ceilings(tuning, model_rps, progress)
        expected_rps = min(model_rps, max(report.ceiling_rps.values(), default=math.inf))
        progress.plan = rounds_for(window_for(progress.plan, expected_rps), progress.budget_s)
        report.window_s = progress.plan.measure_s
        progress.say(f"each trial measures {progress.plan.measure_s:.1f} s")
        variable = manifest.variable_input
        context = Context(
            cores=cores,
            concurrency=concurrency,
            p99_ms=p99_ms,
            limit=limit,
            weights=weights,
            ceiling_rps=report.ceiling_rps,
            max_length=variable.max_length if variable is not None else None,
            rows_per_request=load.rows_per_request,
        )
        await _search(tuning, context, edges, progress)
        report.winner = search.best([trial.result for trial in report.trials], p99_ms)
        report.pick = report.winner
        if report.winner is not None:
            await tuning.remeasure(progress)
            tried = [trial.result for trial in report.trials]
            if report.met and report.decisive is not None:
                report.bound = what_bounds_throughput(context, report.decisive, tried)
            else:
                best_p99_ms = report.decisive.p99_ms if report.decisive else math.inf
                report.bound = what_bounds(context, best_p99_ms)
    finally:
        with contextlib.suppress(Exception):
            await tuning.close()
    report.elapsed_s = progress.elapsed_s()
    return report


async def _measure_ceilings(tuning: Tuning, model_rps: float, progress: Progress) -> None:
    """The HTTP ceiling with one front end (and with one per core when the budget allows
    and HTTP bounds below the model). The defaults' server starts beside the first."""
    plan, ceiling = progress.plan, tuning.report.ceiling_rps
    for workers in plan.ceiling_workers:
        if workers > 1 and ceiling[1] >= model_rps:
            break  # more front ends cannot help a model slower than one front end
        progress.say(f"measuring the HTTP ceiling with {workers} front end(s)")
        measurement = tuning.measurement(progress)
        load = await trials.ceiling_load(
            tuning.children,
            workers,
            tuning.environ,
            tuning.load.bodies,
            measurement,
            tuning.logs / f"ceiling-{workers}.log",
            meanwhile=tuning.start_defaults(progress) if workers == 1 else None,
        )
        ceiling[workers] = load.throughput_rps
        if load.errors:
            tuning.report.notes.append(
                f"the HTTP ceiling with {workers} front end(s) answered {load.errors} requests "
                "with an error: see its log"
            )
        progress.say(f"HTTP ceiling, {workers} front end(s): {ceiling[workers]:,.0f} requests/s")


async def _search(
    tuning: Tuning, context: Context, edges: tuple[int, ...], progress: Progress
) -> None:
    """The defaults, the model limit's starting point, then each stage around the best."""
    await tuning.trial("defaults", defaults_candidate(), progress)
    if progress.time_for_a_trial():
        await tuning.trial("start", search.start_candidate(context, edges), progress)
    for stage in STAGES:
        results = [trial.result for trial in tuning.report.trials]
        current = search.best(results, context.p99_ms)
        base = current.candidate if current is not None else defaults_candidate()
        for candidate in search.stage_candidates(stage, context, base, edges):
            if not progress.time_for_a_trial():
                tuning.report.notes.append(
                    "the budget ended the search; a longer --budget-s tries more"
                )
                return
            await tuning.trial(stage, candidate, progress)
