"""Sweep batchserve configurations under closed-loop wrk load and report against two limits.

For each named configuration it starts ``batchserve serve`` (the console script next to this
Python) on a free 127.0.0.1 port with that configuration's ``BATCHSERVE_*`` variables, checks
that the workload's requests are answered 200, warms up, then runs wrk (one thread, ``-c``
connections, closed loop) at each concurrency, ``--repeats`` times; the median is reported.
Mean rows per batch come from ``/metrics`` (``batchserve_batch_size_rows`` sum and count)
before and after each run, and CPU per request from ``/proc``: the user and system time all
the server's processes used during the run, over the requests answered. With ``--url`` it
measures a server that is already running (no CPU figures then).

Beside the served rates it measures, in the same run:
  - the model limit: in-process forward rows/s at batch sizes 1, 2, 4 ... max_batch_size
    (``loadtests.model_limit``, same precision, compile mode and threads);
  - the HTTP ceiling: the service's HTTP stack answering without a model
    (``service.server.tuning.ceiling``, as ``batchserve tune`` runs it), under the same wrk
    load, per workload;
  - the load generator's ceiling: wrk against a fixed-response server
    (``python -m loadtests.wrk``).

The HTTP ceiling of a configuration with gunicorn front ends (``BATCHSERVE_WORKERS`` above 1,
or ``BATCHSERVE_ENGINE_MODE=process``) is measured with as many front ends. After the warm-up
the resident memory of each process of the server is read from /proc.

With ``--baseline-checkout PATH`` each configuration is also run as ``<name>@baseline``
right after it, against the server of another checkout of this project (a git worktree of an
older commit), started with this Python in PATH; the report sets the two side by side.

With ``--interleave`` every server (baselines too) is started first, each on its own port, and
warmed up once; they then take turns, in rounds: for each of the ``--repeats`` rounds, for each
concurrency, one wrk run on each server in turn (the order reversed every other round). A
machine whose speed drifts within minutes then slows all servers of a round alike, and the
report gives, for each pair compared (``name`` against ``name@baseline``, and the pairs of
``configs.COMPARISONS``), the ratio of req/s and of CPU per request in each round and the
median of those ratios. It also reports the CPU the waiting servers used. The ceilings and
model limits are measured separately, after the rounds.

Each wrk run is capped at ``--duration-s`` seconds and ``--max-requests`` requests. Only
127.0.0.1 is ever sent traffic. Outputs (results.csv, runs.csv, http_ceiling.csv,
model_limits.csv, memory.csv, report.md, throughput.png, latency.png, logs/) go to ``--out``,
by default loadtests/results/<timestamp>/ (git-ignored).

    python -m loadtests.sweep                              # every configuration, defaults
    python -m loadtests.sweep --configs 'digits-*' --skip-heavy --duration-s 5 --repeats 1
    python -m loadtests.sweep --url http://127.0.0.1:8000 --configs digits-batched
    python -m loadtests.sweep --configs 'mlp-*' --baseline-checkout ../baseline
    python -m loadtests.sweep --configs mlp-single mlp-w2 --interleave --baseline-checkout ../b
    python -m loadtests.sweep --list

Exit status 1 if a selected configuration could not be measured (the reason is in the
report and on stderr), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib.metadata import version
from pathlib import Path

import httpx

from loadtests import configs, servers
from loadtests.configs import Configuration, PackagedModel, Workload
from loadtests.report import (
    BASELINE_SUFFIX,
    IDLE_CPU_FLAG_CORES,
    IdleCpu,
    ModelLimit,
    Point,
    SweepResult,
    write_all,
)
from loadtests.servers import ProcessMemory
from loadtests.wrk import WrkResult, run_wrk, write_script, wrk_path, wrk_version

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_ROOT = REPO_ROOT / "loadtests" / "results"
SETTINGS_FIELDS_SCRIPT = (
    "import json; from service.config import Settings; "
    "print(json.dumps(sorted(Settings.model_fields)))"
)
DEFAULT_CONCURRENCY = (1, 4, 16, 64, 256)
GENERATOR_CONCURRENCY = 64
WARMUP_CONCURRENCY = 8
PROBE_BODIES = 3
IDLE_SETTLE_S = 2.0
"""How long every interleaved server is watched idle, together, before the rounds."""


_STARTED_S = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED_S:7.1f} s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["*"],
        metavar="NAME",
        help="configuration names or shell patterns (default: all; see --list)",
    )
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument(
        "--skip-heavy", action="store_true", help="leave out the torch.compile configurations"
    )
    parser.add_argument(
        "--url", help="measure this running server (127.0.0.1 only) with the one --configs named"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY), metavar="C"
    )
    parser.add_argument("--duration-s", type=float, default=10.0, help="time cap per wrk run")
    parser.add_argument(
        "--max-requests",
        type=int,
        default=1_000_000,
        help="request cap per wrk run, on top of the time cap (0: time only)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="wrk runs per point; median kept")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="wrk warm-up per server")
    parser.add_argument("--request-timeout-s", type=float, default=10.0, help="wrk --timeout")
    parser.add_argument(
        "--model-limit-s",
        type=float,
        default=1.0,
        help="time cap per batch size in the model-limit measurement",
    )
    parser.add_argument("--no-model-limit", action="store_true")
    parser.add_argument("--no-http-ceiling", action="store_true")
    parser.add_argument("--no-generator-ceiling", action="store_true")
    parser.add_argument(
        "--generator-duration-s", type=float, default=None, help="default: --duration-s"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="BATCHSERVE_X=VALUE",
        help="extra server setting for every configuration (inherited BATCHSERVE_* are dropped)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default loadtests/results/<time>)"
    )
    parser.add_argument(
        "--baseline-checkout",
        type=Path,
        default=None,
        metavar="PATH",
        help="also run each configuration as <name>@baseline against the checkout at PATH",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="start every server first, then measure them in rounds, one run each in turn "
        "(--repeats rounds); reports the ratio of each compared pair per round",
    )
    args = parser.parse_args(argv)
    if args.interleave and args.url:
        parser.error("--interleave starts its own servers; it cannot go with --url")
    if args.baseline_checkout is not None:
        if args.url:
            parser.error("--baseline-checkout starts its own servers; it cannot go with --url")
        args.baseline_checkout = args.baseline_checkout.resolve()
        try:
            servers.checkout_command(args.baseline_checkout)
        except FileNotFoundError as error:
            parser.error(str(error))
    if any(c < 1 for c in args.concurrency):
        parser.error(f"--concurrency values must be at least 1, got {args.concurrency}")
    if args.duration_s < 1 or args.repeats < 1 or args.max_requests < 0:
        parser.error(
            "--duration-s must be >= 1, --repeats >= 1 and --max-requests >= 0, got "
            f"{args.duration_s}, {args.repeats}, {args.max_requests}"
        )
    for item in args.set:
        if "=" not in item or not item.startswith("BATCHSERVE_"):
            parser.error(f"--set takes BATCHSERVE_NAME=VALUE, got {item!r}")
    return args


class Baseline:
    """The other checkout of ``--baseline-checkout``: how to start it and what it supports."""

    def __init__(self, checkout: Path) -> None:
        self.checkout = checkout
        self.command = servers.checkout_command(checkout)
        # Its settings, asked of its own code: the fields may differ from this checkout's.
        completed = subprocess.run(
            [sys.executable, "-c", SETTINGS_FIELDS_SCRIPT],
            cwd=checkout,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if completed.returncode != 0:
            raise RuntimeError(
                f"cannot read the settings of {checkout}: {completed.stderr[-2000:]}"
            )
        self.settings_fields = frozenset(json.loads(completed.stdout))

    def describe(self) -> str:
        """The checkout, its commit, and whether its packaged-model modules match ours."""
        commit = subprocess.run(
            ["git", "-C", str(self.checkout), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.strip()
        text = f"baseline: {self.checkout} at {commit or 'an unknown commit'}, "
        text += f"started as `{' '.join(self.command[1:])}` with this Python in that folder"
        for packaged in (configs.MLP_MODEL, configs.IMAGE_MODEL):
            ours, theirs = packaged.module_file(REPO_ROOT), packaged.module_file(self.checkout)
            if not theirs.is_file():
                continue
            same = ours.is_file() and ours.read_bytes() == theirs.read_bytes()
            text += (
                f"; its {theirs.relative_to(self.checkout)} "
                + ("is identical to this checkout's" if same else "DIFFERS from this checkout's")
                + ("" if _tracked(theirs) else " (untracked there: a copy, not part of its commit)")
            )
        return text


def _tracked(path: Path) -> bool:
    completed = subprocess.run(
        ["git", "-C", str(path.parent), "ls-files", "--error-unmatch", path.name],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return completed.returncode == 0


@dataclass
class Contender:
    """One server of an interleaved sweep, running from its start to the end of the rounds."""

    configuration: Configuration
    label: str
    server: servers.RunningServer
    points: list[Point]
    """One per concurrency, in ``--concurrency`` order; run i of each is round i + 1."""
    processes: list[ProcessMemory]
    """Its processes' memory after the warm-up."""
    failure: str | None = None
    settled_cpu_s: float = 0.0
    waiting_cpu_s: float = 0.0
    """CPU its processes used while another server had its turn, and how long that was."""
    waiting_s: float = 0.0


class Sweep:
    """Holds the options and the scratch folder; each method measures one kind of thing."""

    def __init__(self, args: argparse.Namespace, out: Path, scratch: Path) -> None:
        self.args = args
        self.out = out
        self.scratch = scratch
        self.extra_env = dict(item.split("=", 1) for item in args.set)
        self.scripts: dict[str, Path] = {}
        self.bodies: dict[str, list[bytes]] = {}
        self.repositories: dict[str, Path] = {}
        self.package_errors: dict[str, str] = {}

    def _bodies(self, workload: Workload) -> list[bytes]:
        if workload.name not in self.bodies:
            self.bodies[workload.name] = workload.bodies()
        return self.bodies[workload.name]

    def script(self, workload: Workload) -> Path:
        if workload.name not in self.scripts:
            self.scripts[workload.name] = write_script(
                self.scratch / "scripts" / workload.name,
                self._bodies(workload),
                workload.headers(),
                max_requests=self.args.max_requests,
            )
        return self.scripts[workload.name]

    def env_for(self, configuration: Configuration) -> dict[str, str]:
        env = {"BATCHSERVE_LOG_LEVEL": "warning"} | self.extra_env | dict(configuration.env)
        if configuration.workload.packaged is not None:
            repository = self.ensure_repository(configuration.workload.packaged)
            env["BATCHSERVE_MODEL_REPOSITORY"] = str(repository)
        return servers.server_env(env)

    def ensure_repository(self, model: PackagedModel) -> Path:
        """Package ``model`` once per sweep; every server (baselines too) reads the same."""
        if model.name not in self.repositories and model.name not in self.package_errors:
            try:
                self.repositories[model.name] = model.package(self.scratch / model.name)
            except RuntimeError as error:
                self.package_errors[model.name] = str(error)
        if model.name in self.package_errors:
            raise servers.ServerError(self.package_errors[model.name])
        return self.repositories[model.name]

    def repository_for(self, configuration: Configuration, checkout: Path | None = None) -> Path:
        from service.config import BUNDLED_MODEL_REPOSITORY

        value = self.extra_env.get("BATCHSERVE_MODEL_REPOSITORY")
        if value:
            return Path(value)
        return BUNDLED_MODEL_REPOSITORY if checkout is None else checkout / "models"

    def ceiling_label(self, configuration: Configuration) -> str:
        return configs.ceiling_label(configs.front_ends(self.extra_env | dict(configuration.env)))

    def measure_points(
        self,
        url: str,
        label: str,
        workload: Workload,
        *,
        ceiling: str = "http-ceiling",
        limit_of: str | None = None,
        pid: int | None = None,
    ) -> list[Point]:
        """wrk at each concurrency, ``repeats`` times, with /metrics batch deltas if exported
        and the CPU of ``pid``'s process tree if given."""
        script = self.script(workload)
        points = []
        for concurrency in self.args.concurrency:
            point = Point(
                label=label,
                workload=workload.name,
                concurrency=concurrency,
                ceiling=ceiling,
                limit_of=limit_of,
            )
            for _ in range(self.args.repeats):
                self.measure_run(url, script, point, pid)
            rows = point.mean_rows_per_batch
            log(
                f"  {label} c={concurrency}: {point.requests_per_s:,.0f} req/s, "
                f"p50 {point.p50_ms:.2f} ms, p99 {point.p99_ms:.2f} ms, {point.errors} errors"
                + (f", {rows:.1f} rows/batch" if rows is not None else "")
            )
            points.append(point)
        return points

    def measure_run(
        self, url: str, script: Path, point: Point, pid: int | None = None
    ) -> tuple[WrkResult, float | None]:
        """One wrk run at ``point``'s concurrency, added to ``point`` with the batch rows
        /metrics counted meanwhile and the CPU ``pid``'s process tree used (if given);
        returns the run and its mean rows per batch, if exported."""
        before = servers.batch_counters(url)
        cpu_before = None if pid is None else servers.trees_cpu_seconds([pid])[pid]
        result = run_wrk(
            url + "/predict",
            script,
            concurrency=point.concurrency,
            duration_s=self.args.duration_s,
            request_timeout_s=self.args.request_timeout_s,
        )
        cpu_after = None if pid is None else servers.trees_cpu_seconds([pid])[pid]
        after = servers.batch_counters(url)
        rows_per_batch = None
        if before is not None and after is not None:
            point.has_batch_metrics = True
            point.batch_rows += after[0] - before[0]
            point.batches += after[1] - before[1]
            if after[1] > before[1]:
                rows_per_batch = (after[0] - before[0]) / (after[1] - before[1])
        point.runs.append(result)
        cpu_used = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
        point.cpu_s.append(cpu_used)
        return result, rows_per_batch

    def prepare(self, url: str, workload: Workload) -> None:
        bodies = self._bodies(workload)
        servers.check_answers(url, bodies[:PROBE_BODIES], workload.headers())
        if self.args.warmup_s > 0:
            run_wrk(
                url + "/predict",
                self.script(workload),
                concurrency=min(WARMUP_CONCURRENCY, max(self.args.concurrency)),
                duration_s=self.args.warmup_s,
                request_timeout_s=self.args.request_timeout_s,
            )

    def configuration(
        self, configuration: Configuration, baseline: Baseline | None = None
    ) -> tuple[list[Point], list[ProcessMemory]]:
        """Served rates of ``configuration`` (on ``baseline``'s code if given), and the memory
        of each of the server's processes after the warm-up."""
        workload = configuration.workload
        ceiling = self.ceiling_label(configuration)
        if self.args.url:
            url = servers.check_loopback(self.args.url)
            self.prepare(url, workload)
            return self.measure_points(url, configuration.name, workload, ceiling=ceiling), []
        label, command, cwd = self.server_command(configuration, baseline)
        env = self.env_for(configuration)
        log_path = self.out / "logs" / f"{label}.log"
        with servers.serving(
            command, env, log_path, configuration.ready_timeout_s, cwd=cwd
        ) as server:
            self.prepare(server.url, workload)
            processes = servers.settled_tree_memory(server.pid)
            points = self.measure_points(
                server.url,
                label,
                workload,
                ceiling=ceiling,
                limit_of=configuration.name,
                pid=server.pid,
            )
            return points, processes

    def server_command(
        self, configuration: Configuration, baseline: Baseline | None
    ) -> tuple[str, list[str], Path | None]:
        """The label, command and folder of ``configuration``'s server (``baseline``'s if given)."""
        if baseline is None:
            return configuration.name, servers.batchserve_command(), None
        return configuration.name + BASELINE_SUFFIX, baseline.command, baseline.checkout

    def start_contender(
        self, pool: servers.ServerPool, configuration: Configuration, baseline: Baseline | None
    ) -> Contender:
        """Start ``configuration``'s server in ``pool``, check and warm it up once, and read
        its memory; it then idles until its turns. Stopped again if it fails."""
        label, command, cwd = self.server_command(configuration, baseline)
        log_path = self.out / "logs" / f"{label}.log"
        env = self.env_for(configuration)
        server = pool.start(command, env, log_path, configuration.ready_timeout_s, cwd=cwd)
        try:
            self.prepare(server.url, configuration.workload)
        except BaseException:
            pool.stop(server)
            raise
        points = [
            Point(
                label=label,
                workload=configuration.workload.name,
                concurrency=concurrency,
                ceiling=self.ceiling_label(configuration),
                limit_of=configuration.name,
            )
            for concurrency in self.args.concurrency
        ]
        return Contender(
            configuration, label, server, points, servers.settled_tree_memory(server.pid)
        )

    def http_ceiling(self, configuration: Configuration) -> list[Point]:
        """The front end alone, answering zeros, with as many front ends as ``configuration``."""
        workload = configuration.workload
        label = self.ceiling_label(configuration)
        env = self.env_for(configuration)
        log_path = self.out / "logs" / f"{label}-{workload.name}.log"
        command = servers.module_command("service.server.tuning.ceiling")
        with servers.running(command, env, log_path, ready_timeout_s=120) as url:
            self.prepare(url, workload)
            return self.measure_points(url, label, workload)

    def generator_ceiling(self) -> Point:
        log_path = self.out / "logs" / "fixed-server.log"
        command = servers.module_command("loadtests.wrk")
        with servers.running(command, servers.server_env({}), log_path, 30) as url:
            point = Point(
                label="load-generator", workload="fixed", concurrency=GENERATOR_CONCURRENCY
            )
            duration_s = self.args.generator_duration_s or self.args.duration_s
            for _ in range(self.args.repeats):
                point.runs.append(
                    run_wrk(
                        url + "/predict",
                        self.script(configs.DIGITS),
                        concurrency=GENERATOR_CONCURRENCY,
                        duration_s=duration_s,
                    )
                )
        return point

    def model_limit(self, configuration: Configuration) -> dict[str, object]:
        command = [
            sys.executable,
            "-m",
            "loadtests.model_limit",
            "--max-seconds-per-size",
            str(self.args.model_limit_s),
        ]
        if configuration.workload.limit_length is not None:
            command += ["--length", str(configuration.workload.limit_length)]
        log_path = self.out / "logs" / f"model-limit-{configuration.name}.log"
        with log_path.open("wb") as errors:
            completed = subprocess.run(
                command,
                env=self.env_for(configuration),
                stdout=subprocess.PIPE,
                stderr=errors,
                timeout=configs.COMPILED_READY_TIMEOUT_S + 600,
                check=False,
            )
        if completed.returncode != 0:
            raise RuntimeError(
                f"model limit failed (status {completed.returncode}); see {log_path}:\n"
                + log_path.read_text(errors="replace")[-2000:]
            )
        result: dict[str, object] = json.loads(completed.stdout)
        return result


def environment(args: argparse.Namespace) -> dict[str, str]:
    load = os.getloadavg()
    runs = (
        f"interleaved, {args.repeats} round(s) of one run per server and concurrency "
        "(median over rounds)"
        if args.interleave
        else f"{args.repeats} run(s) per point (median)"
    )
    return {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs",
        "software": f"Python {platform.python_version()}, torch {version('torch')}, "
        f"{wrk_version()}",
        "load": f"one thread of wrk, closed loop; {args.duration_s:g} s and at most "
        f"{args.max_requests or 'unlimited'} requests per run, {runs}, "
        f"{args.warmup_s:g} s warm-up per server",
        "load average at start": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
    }


MEASUREMENT_ERRORS = (servers.ServerError, RuntimeError, subprocess.TimeoutExpired, httpx.HTTPError)


def run(
    args: argparse.Namespace, sweep: Sweep, selected: Sequence[Configuration], result: SweepResult
) -> None:
    """Measure everything selected into ``result``; failures are recorded, not raised."""
    if args.url:
        result.notes.append(
            f"served rates are of the running server at {args.url}, assumed to run "
            f"{selected[0].name}; the model limit is computed for that configuration"
        )
    baseline = None
    if args.baseline_checkout is not None:
        try:
            baseline = Baseline(args.baseline_checkout)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
            result.notes.append(f"baseline not measured: {error}")
            log(f"baseline not measured: {error}")
        else:
            result.notes.append(baseline.describe())
            result.notes.append(
                "a baseline row is compared with this checkout's HTTP ceiling and model limit"
            )
    if not args.no_generator_ceiling:
        log("load generator ceiling (fixed-response server)")
        try:
            result.generator = sweep.generator_ceiling()
            log(f"  {result.generator.requests_per_s:,.0f} req/s at c={GENERATOR_CONCURRENCY}")
        except MEASUREMENT_ERRORS as error:
            result.notes.append(f"load generator ceiling failed: {error}")
            log(f"  failed: {error}")

    names = {configuration.name for configuration in selected}
    if baseline is not None:
        result.comparisons += [(name, name + BASELINE_SUFFIX) for name in sorted(names)]
    result.comparisons += [(a, b) for a, b in configs.COMPARISONS if {a, b} <= names]

    limits_by_key: dict[tuple[object, ...], dict[str, object]] = {}
    if args.interleave:
        measured = run_interleaved(args, sweep, selected, baseline, result)
        if not args.no_model_limit:
            for configuration in measured:
                log(f"{configuration.name}: model limit")
                model_limit(sweep, configuration, limits_by_key, result)
    else:
        measured = []
        for configuration in selected:
            log(f"{configuration.name}: {configuration.description}")
            if not measure_configuration(args, sweep, configuration, None, result):
                continue
            measured.append(configuration)
            if baseline is not None:
                log(f"{configuration.name}{BASELINE_SUFFIX}: the same on {baseline.checkout}")
                measure_configuration(args, sweep, configuration, baseline, result)
            if not args.no_model_limit:
                model_limit(sweep, configuration, limits_by_key, result)

    ceiling_for: dict[tuple[str, str], Configuration] = {}
    for configuration in measured:
        key = (configuration.workload.name, sweep.ceiling_label(configuration))
        ceiling_for.setdefault(key, configuration)
    if args.no_http_ceiling:
        return
    for (workload_name, label), configuration in ceiling_for.items():
        log(f"HTTP ceiling for {workload_name}: {label}")
        try:
            result.ceilings += sweep.http_ceiling(configuration)
        except MEASUREMENT_ERRORS as error:
            result.notes.append(f"{label} for {workload_name} failed: {error}")
            log(f"  HTTP ceiling failed: {error}")


def measure_configuration(
    args: argparse.Namespace,
    sweep: Sweep,
    configuration: Configuration,
    baseline: Baseline | None,
    result: SweepResult,
) -> bool:
    """Measure ``configuration`` (on ``baseline``'s code if given) into ``result``; False,
    with the reason recorded, if it could not be."""
    label = configuration.name + (BASELINE_SUFFIX if baseline is not None else "")
    if not runnable(args, sweep, configuration, baseline, result):
        return False
    try:
        points, processes = sweep.configuration(configuration, baseline)
    except MEASUREMENT_ERRORS as error:
        not_measured(result, label, str(error))
        return False
    result.points += points
    if processes:
        record_memory(result, label, processes)
    return True


def runnable(
    args: argparse.Namespace,
    sweep: Sweep,
    configuration: Configuration,
    baseline: Baseline | None,
    result: SweepResult,
) -> bool:
    """Whether the checkout (``baseline``'s if given) can run ``configuration``; if not, the
    reason is recorded: as unavailable, or as a note for a setting older code lacks."""
    label = configuration.name + (BASELINE_SUFFIX if baseline is not None else "")
    reason = None
    if baseline is not None:
        missing = configs.missing_setting(
            configuration, baseline.settings_fields, str(baseline.checkout)
        )
        if missing is not None:
            # Older code lacking a newer setting is expected, not a failure of the sweep.
            result.notes.append(f"{label} not run: {missing}")
            log(f"  not run: {missing}")
            return False
        reason = configs.unavailable_reason(
            configuration,
            sweep.repository_for(configuration, baseline.checkout),
            settings_fields=baseline.settings_fields,
            checkout=baseline.checkout,
        )
    elif not args.url:
        reason = configs.unavailable_reason(configuration, sweep.repository_for(configuration))
    if reason is not None:
        not_measured(result, label, reason)
        return False
    return True


def not_measured(result: SweepResult, label: str, reason: str) -> None:
    result.unavailable[label] = reason
    log(f"  NOT MEASURED: {reason}")


def record_memory(result: SweepResult, label: str, processes: list[ProcessMemory]) -> None:
    result.memory[label] = processes
    log(
        "  resident memory: "
        + ", ".join(f"{p.role} {p.rss_bytes / 2**20:,.0f} MiB" for p in processes)
    )


def run_interleaved(
    args: argparse.Namespace,
    sweep: Sweep,
    selected: Sequence[Configuration],
    baseline: Baseline | None,
    result: SweepResult,
) -> list[Configuration]:
    """Start every server first (a configuration's baseline right after it), then measure
    them in rounds; returns the configurations whose own server was measured to the end.

    A server that does not start, or fails during the rounds, is reported unavailable and
    the others go on. Every server is stopped when this returns or raises (Ctrl-C too).
    """
    contenders: list[Contender] = []
    with servers.ServerPool() as pool:
        for configuration in selected:
            targets = [None] if baseline is None else [None, baseline]
            for target in targets:
                label = configuration.name + (BASELINE_SUFFIX if target is not None else "")
                where = configuration.description if target is None else target.checkout
                log(f"start {label}: {where}")
                if not runnable(args, sweep, configuration, target, result):
                    break  # without its own server, its baseline has nothing to compare with
                try:
                    contender = sweep.start_contender(pool, configuration, target)
                except MEASUREMENT_ERRORS as error:
                    not_measured(result, label, str(error))
                    break
                contenders.append(contender)
                record_memory(result, label, contender.processes)
        if not contenders:
            return []
        result.notes.append(
            f"served rows interleaved: {len(contenders)} server(s) started first and kept "
            f"running, idle but for their turns; {args.repeats} round(s), each one wrk run per "
            "concurrency on each server in turn (order reversed every other round); HTTP "
            "ceilings and model limits measured separately, after the rounds"
        )
        try:
            watch_idle(contenders)
            measure_rounds(args, sweep, pool, contenders, result)
        finally:
            # What the rounds measured is kept, even when they were cut short.
            for contender in contenders:
                if contender.failure is not None:
                    continue
                result.points += [point for point in contender.points if point.runs]
                waited_s = contender.waiting_s
                result.idle_cpu[contender.label] = IdleCpu(
                    settled_cores=contender.settled_cpu_s / IDLE_SETTLE_S,
                    settled_s=IDLE_SETTLE_S,
                    between_turns_cores=contender.waiting_cpu_s / waited_s if waited_s else None,
                    between_turns_s=waited_s,
                )
    return [
        c.configuration for c in contenders if c.failure is None and c.label == c.configuration.name
    ]


def watch_idle(contenders: Sequence[Contender]) -> None:
    """CPU of every server over ``IDLE_SETTLE_S`` with all of them idle: a server that keeps
    working when nobody asks would take CPU from each of the others' turns."""
    pids = [contender.server.pid for contender in contenders]
    before = servers.trees_cpu_seconds(pids)
    time.sleep(IDLE_SETTLE_S)
    after = servers.trees_cpu_seconds(pids)
    for contender in contenders:
        contender.settled_cpu_s = max(
            0.0, after[contender.server.pid] - before[contender.server.pid]
        )
        share = contender.settled_cpu_s / IDLE_SETTLE_S
        flag = "  (more than a waiting server should use)" if share > IDLE_CPU_FLAG_CORES else ""
        log(f"  {contender.label} idle: {share:.2%} of a core{flag}")


def measure_rounds(
    args: argparse.Namespace,
    sweep: Sweep,
    pool: servers.ServerPool,
    contenders: Sequence[Contender],
    result: SweepResult,
) -> None:
    """``--repeats`` rounds: per concurrency, one run of each server in turn, in the given
    order in odd rounds and reversed in even ones, so that no server always goes first."""
    for round_index in range(args.repeats):
        result.rounds = round_index + 1
        order = list(contenders) if round_index % 2 == 0 else list(reversed(contenders))
        log(f"round {round_index + 1} of {args.repeats}")
        for index in range(len(args.concurrency)):
            for contender in order:
                if contender.failure is None:
                    take_turn(sweep, pool, contenders, contender, index, round_index, result)
        if all(contender.failure is not None for contender in contenders):
            return


def take_turn(
    sweep: Sweep,
    pool: servers.ServerPool,
    contenders: Sequence[Contender],
    contender: Contender,
    index: int,
    round_index: int,
    result: SweepResult,
) -> None:
    """One wrk run of ``contender`` at its ``index``-th concurrency, counting the CPU the
    others use meanwhile; a server that fails is stopped and reported unavailable."""
    point = contender.points[index]
    waiting = [c for c in contenders if c is not contender and c.failure is None]
    pids = [c.server.pid for c in waiting]
    before, started_s = servers.trees_cpu_seconds(pids), time.monotonic()
    try:
        status = contender.server.exit_status()
        if status is not None:
            raise servers.ServerError(f"the server exited with status {status}")
        run, rows = sweep.measure_run(
            contender.server.url,
            sweep.script(contender.configuration.workload),
            point,
            contender.server.pid,
        )
    except MEASUREMENT_ERRORS as error:
        contender.failure = f"failed in round {round_index + 1}, c={point.concurrency}: {error}"
        not_measured(result, contender.label, contender.failure)
        result.memory.pop(contender.label, None)
        pool.stop(contender.server)
        return
    elapsed_s = time.monotonic() - started_s
    after = servers.trees_cpu_seconds(pids)
    for other in waiting:
        pid = other.server.pid
        other.waiting_cpu_s += max(0.0, after[pid] - before[pid])
        other.waiting_s += elapsed_s
    log(
        f"  c={point.concurrency} {contender.label}: {run.requests_per_s:,.0f} req/s, "
        f"p50 {run.p50_ms:.2f} ms, p99 {run.p99_ms:.2f} ms, {run.errors} errors"
        + (f", {rows:.1f} rows/batch" if rows is not None else "")
    )


def model_limit(
    sweep: Sweep,
    configuration: Configuration,
    limits_by_key: dict[tuple[object, ...], dict[str, object]],
    result: SweepResult,
) -> None:
    """The model limit of ``configuration``, measured once per model and forward settings."""
    key = configuration.model_limit_key()
    try:
        if key not in limits_by_key:
            log("  model limit (in-process forward)")
            limits_by_key[key] = sweep.model_limit(configuration)
    except MEASUREMENT_ERRORS as error:
        result.notes.append(f"model limit of {configuration.name} failed: {error}")
        log(f"  model limit failed: {error}")
        return
    details = limits_by_key[key]
    raw = details["rows_per_s"]
    assert isinstance(raw, dict)
    limit = ModelLimit(
        configuration.name, {int(size): float(v) for size, v in raw.items()}, details
    )
    result.model_limits[configuration.name] = limit
    size, best = limit.best
    log(f"  model limit: {best:,.0f} rows/s at batch {size}")


def plan(args: argparse.Namespace, selected: Sequence[Configuration]) -> str:
    """The served measurement as it will run, and the most time its load can take."""
    count = len(selected) * (1 if args.baseline_checkout is None else 2)
    runs = count * len(args.concurrency) * args.repeats
    load_s = count * args.warmup_s + runs * args.duration_s
    if args.interleave:
        text = (
            f"interleaved: {count} server(s) started first and kept running, then "
            f"{args.repeats} round(s) x {len(args.concurrency)} concurrencies x {count} "
            f"server(s) = {runs} wrk runs, each server's turn every {count * args.duration_s:g} s "
            f"at most"
        )
        load_s += IDLE_SETTLE_S
    else:
        text = (
            f"{count} server(s) one after another x {len(args.concurrency)} concurrencies x "
            f"{args.repeats} run(s) = {runs} wrk runs"
        )
    return (
        f"{text}: at most about {load_s / 60:.1f} min of load (warm-ups included), plus "
        "ceilings, model limits and start-ups"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, configuration in configs.CONFIGURATIONS.items():
            heavy = " [heavy]" if configuration.heavy else ""
            workload = configuration.workload.description
            print(f"{name:28} {configuration.description} ({workload}){heavy}")
        return 0
    try:
        wrk_path()
        selected = configs.select(args.configs, skip_heavy=args.skip_heavy)
        if args.url:
            servers.check_loopback(args.url)
            if len(selected) != 1:
                raise ValueError(
                    f"--url measures one running server: name its configuration with --configs "
                    f"(got {len(selected)} matches)"
                )
    except (RuntimeError, ValueError) as error:
        print(f"loadtests.sweep: {error}", file=sys.stderr)
        return 2

    out = args.out or RESULTS_ROOT / datetime.now().strftime("%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    log(f"{plan(args, selected)}; writing to {out}")
    result = SweepResult(
        points=[],
        ceilings=[],
        generator=None,
        model_limits={},
        unavailable={},
        notes=[],
        environment=environment(args),
    )
    started_s = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="batchserve-loadtests-") as scratch:
            run(args, Sweep(args, out, Path(scratch)), selected, result)
    finally:
        # Whatever was measured is written, even after Ctrl-C.
        result.notes.append(f"sweep took {(time.monotonic() - started_s) / 60:.1f} min")
        paths = write_all(result, out)
        for name, path in paths.items():
            log(f"{name}: {path}")
    if result.unavailable:
        log("not measured: " + ", ".join(result.unavailable))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
