"""``/metrics``'s text when every process writes its values to files (multiprocess mode)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from service.metrics import MULTIPROCESS_DIR_ENV, render


def test_a_scrape_while_a_process_creates_its_metric_file_leaves_that_file_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process's file is empty from its creation until it is sized: an engine restarting
    just as ``/metrics`` was scraped made the scrape fail (500, ``struct.error``)."""
    monkeypatch.setenv(MULTIPROCESS_DIR_ENV, str(tmp_path))
    written = MmapedDict(str(tmp_path / "counter_1.db"))
    key = mmap_key(
        "batchserve_requests",
        "batchserve_requests_total",
        ["route", "status"],
        ["/predict", "200"],
        "HTTP requests answered, by route and status code.",
    )
    written.write_value(key, 3.0, 0.0)
    written.close()
    (tmp_path / "counter_2.db").touch()  # another process's, being created
    text = render(CollectorRegistry()).decode()
    assert 'batchserve_requests_total{route="/predict",status="200"} 3.0' in text
