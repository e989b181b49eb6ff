"""The HTTP servers harness's pure parts (``loadtests/http_servers.py``): CPU per request,
round order, ratios of the same round, the summary, granian's command and the bare app."""

from __future__ import annotations

import httpx
import pytest

from loadtests.http_servers import (
    BARE_ANSWER,
    PAIRS,
    SERVERS,
    Run,
    bare_app,
    granian_command,
    median_ratio,
    per_request_us,
    round_order,
    spent_ticks,
    summary,
)


def run(server: str, round_index: int, cpu_us: float, requests_per_s: float = 1000.0) -> Run:
    return Run(
        server=server,
        round=round_index,
        requests_per_s=requests_per_s,
        answered=4000,
        errors=0,
        cpu_us=cpu_us,
        top_cpu_us=cpu_us,
        p99_ms=10.0,
        load_1m=1.5,
    )


def test_ticks_spent_by_every_process_are_divided_by_the_requests_answered() -> None:
    spent = spent_ticks({1: 100, 2: 10}, {1: 140, 2: 10, 3: 5})
    assert spent == {1: 40, 2: 0, 3: 5}  # a process started in between counts from zero
    assert per_request_us(spent, answered=4500, ticks_per_s=100) == pytest.approx(100.0)


def test_nothing_answered_counts_as_one_request_rather_than_dividing_by_zero() -> None:
    assert per_request_us({1: 1}, answered=0, ticks_per_s=100) == pytest.approx(10_000.0)


def test_each_round_starts_with_another_server() -> None:
    names = ["a", "b", "c"]
    assert [round_order(names, index)[0] for index in range(4)] == ["a", "b", "c", "a"]
    assert sorted(round_order(names, 2)) == names
    assert round_order([], 3) == []


def test_a_ratio_is_taken_within_each_round_then_the_median_over_rounds() -> None:
    runs = [
        run("fast", 0, 50),
        run("slow", 0, 100),
        run("fast", 1, 300),  # a loaded round: both sides slower, the ratio unchanged
        run("slow", 1, 400),
        run("fast", 2, 90),
        run("slow", 2, 100),
        run("fast", 3, 10),  # no partner in round 3: not counted
    ]
    found = median_ratio(runs, "fast", "slow", lambda r: r.cpu_us)
    assert found is not None
    median, ratios = found
    assert ratios == pytest.approx([0.5, 0.75, 0.9])
    assert median == pytest.approx(0.75)
    assert median_ratio(runs, "fast", "absent", lambda r: r.cpu_us) is None


def test_the_summary_gives_medians_per_server_and_the_ratios_of_the_pairs() -> None:
    numerator, denominator = PAIRS[0]
    runs = [
        run(denominator, 0, 100, 5000),
        run(numerator, 0, 80, 6000),
        run(denominator, 1, 120, 5000),
        run(numerator, 1, 120, 5000),
    ]
    table = summary(runs)
    assert f"| {denominator} | 5,000 | 110 | 110 | 10.0 | 1.50 | 100 · 120 |" in table
    assert f"| {numerator} / {denominator} | 0.90x | 1.10x | 0.80 · 1.00 |" in table


def test_granian_serves_on_loopback_with_one_asgi_worker_and_the_target_last() -> None:
    command = granian_command("pkg.module:factory", factory=True, extra=["--runtime-mode", "st"])
    joined = " ".join(command)
    assert "--interface asgi" in joined
    assert "--host 127.0.0.1" in joined
    assert "--workers 1" in joined
    assert "--port {port}" in joined
    assert command[-3:] == ["--runtime-mode", "st", "pkg.module:factory"]
    assert "--factory" in command
    assert "--factory" not in granian_command("pkg.module:app", factory=False)


def test_every_server_takes_the_port_the_harness_gives_it() -> None:
    for command, _ in SERVERS.values():
        assert "{port}" in command


async def test_the_bare_app_reads_the_body_and_answers_the_fixed_json() -> None:
    transport = httpx.ASGITransport(app=bare_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        response = await client.post("/predict", content=b'{"instances": [[1.0]]}')
    assert response.status_code == 200
    assert response.content == BARE_ANSWER
    assert response.headers["content-type"] == "application/json"
    assert response.json()["predictions"] == [[0.0] * 10]
