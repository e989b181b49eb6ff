"""The Grafana dashboard and the Prometheus alerts ask only for series the app really exports,
are valid PromQL (promtool), and the alerts fire when, and only when, their tests say."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from service.config import Settings
from service.server.single import create_app
from tests.fixtures import lifespan
from tests.processes import REPOSITORY_ROOT, require_tool
from tests.promql import exported_names, metric_names

DASHBOARD = REPOSITORY_ROOT / "deploy" / "grafana" / "batchserve-dashboard.json"
ALERTS = REPOSITORY_ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = REPOSITORY_ROOT / "deploy" / "prometheus" / "alerts_test.yml"
#: Series Prometheus records itself for every target, not exported by the app.
RECORDED_BY_PROMETHEUS = frozenset({"up"})
#: Grafana's variables, replaced by values PromQL accepts.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": ".+"}
PROMTOOL_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Series names on the real app's /metrics after one prediction (so histograms have data),
    with the response cache on (its series exist once a model has used it)."""
    return asyncio.run(scrape_after_one_prediction())


async def scrape_after_one_prediction() -> set[str]:
    app = create_app(
        Settings(device="cpu", max_wait_ms=1.0, response_cache_mb=1, response_cache_models=("*",))
    )
    async with lifespan(app):
        await app.state.loading
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post("/predict", json={"instances": [[[0.5] * 8] * 8]})
            assert response.status_code == 200, response.text
            exposition = (await client.get("/metrics")).text
    return exported_names(exposition)


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_queries() -> list[str]:
    """The PromQL of every panel target (rows hold no queries of their own here)."""
    return [
        target["expr"] for panel in dashboard()["panels"] for target in panel.get("targets", [])
    ]


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_promql_names_skip_functions_labels_keywords_and_durations() -> None:
    expression = (
        'histogram_quantile(0.99, sum by (job, le) (rate(a_bucket{route="/p", s=~"5.."}[5m])))'
        ' / on (job) group_left sum(rate(b_total{x="{y}"}[$__rate_interval] offset 1h)) > 0.5'
        " and absent(up) or c:recorded:rate5m * 1e3"
    )
    assert metric_names(expression) == {"a_bucket", "b_total", "up", "c:recorded:rate5m"}


def test_dashboard_shows_traffic_latency_batching_memory_and_model_version() -> None:
    used = set().union(*(metric_names(query) for query in dashboard_queries()))
    assert {
        "batchserve_requests_total",
        "batchserve_request_duration_seconds_bucket",
        "batchserve_queue_depth",
        "batchserve_queue_wait_seconds_bucket",
        "batchserve_batch_size_rows_bucket",
        "batchserve_inference_duration_seconds_bucket",
        "batchserve_device_memory_allocated_bytes",
        "batchserve_device_memory_reserved_bytes",
        "batchserve_in_flight_requests",
        "batchserve_model_info",
    } <= used
    latency = [query for query in dashboard_queries() if "request_duration" in query]
    assert {query.split(",")[0] for query in latency} == {
        "histogram_quantile(0.5",
        "histogram_quantile(0.95",
        "histogram_quantile(0.99",
    }


def test_every_dashboard_query_asks_for_series_the_app_exports(exported: set[str]) -> None:
    # A variable's label_values(metric, label) names its metric first.
    variables = [
        variable["definition"].removeprefix("label_values(").split(",")[0]
        for variable in dashboard()["templating"]["list"]
        if variable["type"] == "query"
    ]
    missing = {
        (name, query)
        for query in [*dashboard_queries(), *variables]
        for name in metric_names(query)
        if name not in exported and name not in RECORDED_BY_PROMETHEUS
    }
    assert missing == set()


def test_every_alert_asks_for_series_the_app_exports(exported: set[str]) -> None:
    missing = {
        (name, rule["alert"])
        for rule in alert_rules()
        for name in metric_names(rule["expr"])
        if name not in exported and name not in RECORDED_BY_PROMETHEUS
    }
    assert missing == set()


def promtool(*arguments: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool"), *arguments],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=PROMTOOL_TIMEOUT_S,
        check=False,
    )


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool checks PromQL in rule files, so each query becomes a recording rule."""
    rules = []
    for index, query in enumerate(dashboard_queries()):
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        rules.append({"record": f"dashboard:query_{index}", "expr": query})
    rule_file = tmp_path / "dashboard_rules.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(rule_file), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_alert_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", ALERTS.name, cwd=ALERTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_alert_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_missing_promtool_fails_in_ci_and_skips_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must have it"):
        require_tool("promtool")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        require_tool("promtool")


def test_latency_panels_show_exemplars_linked_to_the_chosen_trace_data_source() -> None:
    """Every latency and queue-wait query asks for exemplars, and the panels open an
    exemplar's trace in the data source the ``traces`` variable chooses."""
    loaded = dashboard()
    variables = {variable["name"]: variable for variable in loaded["templating"]["list"]}
    assert variables["traces"]["type"] == "datasource"
    traced = [
        panel
        for panel in loaded["panels"]
        if any(
            "request_duration" in target.get("expr", "") or "queue_wait" in target.get("expr", "")
            for target in panel.get("targets", [])
        )
    ]
    assert {panel["title"] for panel in traced} == {
        "Latency of successful predictions",
        "Queue wait",
    }
    for panel in traced:
        assert all(target["exemplar"] is True for target in panel["targets"])
        (link,) = panel["fieldConfig"]["defaults"]["links"]
        assert "${traces}" in link["url"]
        assert "${__data.fields.trace_id}" in link["url"]
