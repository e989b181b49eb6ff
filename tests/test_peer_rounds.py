"""The pure parts of the TorchServe comparison: ratios, round order, the report, the JVM's
warm-up rule and TorchServe's configuration (no TorchServe or Java needed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from loadtests import peer_rounds, torchserve_peer
from loadtests.peer_rounds import REFERENCE, Contender, PeerRun


def run(label: str, round_number: int, concurrency: int, requests_per_s: float) -> PeerRun:
    return PeerRun(
        label=label,
        round=round_number,
        concurrency=concurrency,
        requests_per_s=requests_per_s,
        p50_ms=1.0,
        p99_ms=2.0,
        errors=0,
        rows_per_batch=None,
        cpu_us_per_request=100.0,
    )


RUNS = [
    run(REFERENCE, 1, 64, 1000),
    run("mlp-w2", 1, 64, 3000),
    run(REFERENCE, 2, 64, 2000),
    run("mlp-w2", 2, 64, 5000),
    run(REFERENCE, 3, 64, 500),
    run("mlp-w2", 3, 64, 1000),
    run(REFERENCE, 1, 1, 100),
    run("mlp-w2", 1, 1, 800),
]


def test_a_ratio_divides_by_torchserve_in_the_same_round_only() -> None:
    assert peer_rounds.ratios_per_round(RUNS, "mlp-w2", 64) == [3.0, 2.5, 2.0]
    assert peer_rounds.ratios_per_round(RUNS, "mlp-w2", 1) == [8.0]


def test_a_round_without_torchserve_or_where_it_answered_nothing_gives_no_ratio() -> None:
    runs = [run("mlp-w2", 1, 64, 3000), run(REFERENCE, 2, 64, 0), run("mlp-w2", 2, 64, 10)]
    assert peer_rounds.ratios_per_round(runs, "mlp-w2", 64) == []


def test_every_other_round_runs_the_servers_in_reverse() -> None:
    contenders = [Contender(name, f"http://127.0.0.1/{name}", 1, None) for name in "abc"]
    orders = [[c.label for c in peer_rounds.round_order(contenders, i)] for i in range(3)]
    assert orders == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_the_report_gives_each_rounds_rate_its_median_and_the_median_ratio() -> None:
    report = peer_rounds.report_table(RUNS)
    assert report.index("### c=64") < report.index("### c=1")
    row = next(line for line in report.splitlines() if line.startswith("| mlp-w2 | 3,000"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1] == "3,000 · 5,000 · 1,000"
    assert cells[2] == "3,000"
    assert cells[8] == "3.00 · 2.50 · 2.00"
    assert cells[9] == "2.50"
    reference = next(line for line in report.splitlines() if line.startswith(f"| {REFERENCE} |"))
    assert reference.rstrip().endswith("| - | - |")


def test_every_report_row_has_as_many_cells_as_its_header() -> None:
    for table in peer_rounds.report_table(RUNS).split("### ")[1:]:
        rows = [line for line in table.splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in rows}) == 1


@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        ([], False),
        ([400.0], False),
        ([82.0, 133.0, 288.0], False),
        ([288.0, 393.0], False),
        ([393.0, 410.0], True),
        ([410.0, 393.0], True),
        ([10.0, 0.0], False),
    ],
)
def test_the_torchserve_warm_up_ends_once_two_rates_agree_within_ten_percent(
    rates: list[float], expected: bool
) -> None:
    assert peer_rounds.settled(rates) is expected


@pytest.mark.parametrize(
    ("text", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15\nOpenJDK Runtime', 17),
        ('java version "1.8.0_392"', 8),
        ('openjdk version "21" 2023-09-19', 21),
    ],
)
def test_the_java_major_version_is_read_from_java_version(text: str, major: int) -> None:
    assert torchserve_peer.java_major_version(text) == major


def test_java_version_text_without_a_version_is_refused_with_the_text() -> None:
    with pytest.raises(ValueError, match="no version"):
        torchserve_peer.java_major_version("command not found")


def test_torchserve_listens_on_loopback_only_and_batches_as_peers_md() -> None:
    ports = torchserve_peer.Ports(8101, 8102, 8103, 8104, 8105)
    text = torchserve_peer.config_properties(ports, Path("/tmp/store"))
    properties = dict(line.split("=", 1) for line in text.splitlines())
    addresses = [value for key, value in properties.items() if key.endswith("_address")]
    assert len(addresses) == 5
    assert all(re.fullmatch(r"(http://)?127\.0\.0\.1(:\d+)?", value) for value in addresses)
    assert {int(properties[f"{key}_port"]) for key in ("grpc_inference", "grpc_management")} == {
        8104,
        8105,
    }
    assert '"batchSize": 64' in properties["models"]
    assert '"maxBatchDelay": 5' in properties["models"]
    assert '"minWorkers": 1, "maxWorkers": 1' in properties["models"]


def test_the_run_arguments_are_bounded() -> None:
    with pytest.raises(SystemExit):
        peer_rounds.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):
        peer_rounds.parse_args(["--rounds", str(peer_rounds.MAX_ROUNDS + 1)])
    assert peer_rounds.parse_args(["--rounds", "3"]).rounds == 3


@pytest.mark.parametrize(
    "script",
    [
        "sleep 60 & sleep 60",  # a child that ends on SIGTERM
        "trap '' TERM; (trap '' TERM; sleep 60) & wait",  # a group that ignores SIGTERM
    ],
)
def test_stopping_torchserve_leaves_no_process_of_its_group(script: str) -> None:
    process = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    torchserve_peer.stop_group(process, timeout_s=0.5)
    assert process.returncode is not None
    assert not torchserve_peer.group_alive(process.pid)
