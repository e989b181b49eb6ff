"""A real Prometheus scraping a real ``batchserve serve --workers 2``, both on 127.0.0.1.

After a burst of predictions, Prometheus's own query API must report every one of them, the
batch-size histogram, the target up, and the alerting rules loaded and healthy.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.processes import (
    BATCHSERVE,
    REPOSITORY_ROOT,
    Running,
    answers,
    batchserve_environment,
    free_port,
    require_tool,
    running,
    wait_for,
)

pytestmark = pytest.mark.slow

BURST = 120
CONCURRENCY = 16
#: Scrapes run every second; this bounds how long the test waits for them to catch up.
SCRAPED_WITHIN_S = 30.0
ALERTS = REPOSITORY_ROOT / "deploy" / "prometheus" / "alerts.yml"


def prometheus_config(target_port: int) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {
                "job_name": "batchserve",
                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}],
            }
        ],
    }


def query(prometheus: Running, promql: str) -> list[dict[str, Any]]:
    """The instant vector ``promql`` gives now ([] while it has no data or on a hiccup)."""
    try:
        response = httpx.get(
            prometheus.url + "/api/v1/query", params={"query": promql}, timeout=5.0
        )
    except httpx.TransportError:
        return []
    body = response.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def scalar(prometheus: Running, promql: str) -> float | None:
    result = query(prometheus, promql)
    return float(result[0]["value"][1]) if len(result) == 1 else None


async def burst(url: str) -> list[int]:
    body = {"instances": [[[0.25] * 8] * 8]}
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=10.0, limits=limits) as client:
        responses = await asyncio.gather(
            *(client.post("/predict", json=body) for _ in range(BURST))
        )
    return [response.status_code for response in responses]


def test_prometheus_sees_every_request_of_a_burst(tmp_path: Path) -> None:
    prometheus_binary = require_tool("prometheus")
    port = free_port()
    env = batchserve_environment(port, BATCHSERVE_WORKERS="2")
    batchserve_url = f"http://127.0.0.1:{port}"
    with running([str(BATCHSERVE), "serve"], batchserve_url, tmp_path / "serve.log", env) as server:
        wait_for(lambda: answers(server.url + "/readyz"), "ready", server)

        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(port)))
        prometheus_port = free_port()
        command = [
            prometheus_binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
        ]
        prometheus_url = f"http://127.0.0.1:{prometheus_port}"
        with running(command, prometheus_url, tmp_path / "prometheus.log", env) as prometheus:
            wait_for(lambda: answers(prometheus.url + "/-/ready"), "ready", prometheus)
            wait_for(
                lambda: scalar(prometheus, 'up{job="batchserve"}') == 1.0,
                "scraping batchserve",
                prometheus,
            )

            assert asyncio.run(burst(server.url)) == [200] * BURST

            predictions = 'batchserve_requests_total{route="/predict", status="200"}'
            wait_for(
                lambda: scalar(prometheus, predictions) == BURST,
                f"showing {BURST} predictions",
                prometheus,
                timeout_s=SCRAPED_WITHIN_S,
            )
            batches = scalar(prometheus, "batchserve_batch_size_rows_count")
            rows = scalar(prometheus, "batchserve_batch_size_rows_sum")
            assert batches is not None
            assert 1 <= batches <= BURST
            assert rows == BURST
            buckets = query(prometheus, "batchserve_batch_size_rows_bucket")
            assert len(buckets) > 1
            assert max(float(bucket["value"][1]) for bucket in buckets) == batches

            alerts = len(yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"])
            wait_for(
                lambda: rule_health(prometheus) == ["ok"] * alerts,
                f"evaluating {alerts} healthy alerting rules",
                prometheus,
            )


def rule_health(prometheus: Running) -> list[str]:
    """The health of every rule Prometheus loaded ("unknown" until first evaluated)."""
    rules = httpx.get(prometheus.url + "/api/v1/rules", timeout=5.0).json()
    return [rule["health"] for group in rules["data"]["groups"] for rule in group["rules"]]
