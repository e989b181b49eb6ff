"""The documentation site: its reference tables come from the code and the deploy files
(scripts/docs_pages.py, the build hook), so every setting, metric, dashboard panel and alert
is on its page, including ones added after the page was written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from scripts.docs_pages import (
    ALERTS,
    DASHBOARD,
    errors_markdown,
    render_markers,
    setting_variables,
    settings_markdown,
)
from service.config import Settings
from service.errors import documented_errors, grpc_status_name
from service.metrics import EngineMetrics, FrontendMetrics, ProcessMetrics

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"


def _page(name: str) -> str:
    return render_markers((DOCS / name).read_text())


def test_the_configuration_page_names_every_setting() -> None:
    page = _page("configuration.md")
    missing = [name for name in Settings.model_fields if f"`BATCHSERVE_{name.upper()}`" not in page]
    assert missing == []


def test_every_setting_has_a_meaning_on_the_page() -> None:
    rows = settings_markdown().splitlines()[2:]
    assert len(rows) == len(setting_variables())
    assert [row for row in rows if row.rstrip().endswith("|  |")] == []


class _Tracing(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    endpoint: str = "http://127.0.0.1:4318"
    """Where spans are sent."""

    sample_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """Share of requests traced."""


class _LaterSettings(Settings):
    device_memory_budget_mb: int = Field(default=0, ge=0, le=1_000_000)
    """Device memory the models may hold, in MiB; 0 means no budget."""

    tracing: _Tracing = _Tracing()
    """Tracing."""


def test_a_setting_added_later_is_rendered_with_its_default_range_and_docstring() -> None:
    table = settings_markdown(_LaterSettings)
    row = next(line for line in table.splitlines() if "BATCHSERVE_DEVICE_MEMORY_BUDGET_MB" in line)
    assert "`0`" in row
    assert "integer, 0 to 1000000" in row
    assert "Device memory the models may hold, in MiB; 0 means no budget." in row
    assert "BATCHSERVE_TRACING__ENDPOINT" in setting_variables(_LaterSettings)
    nested = next(line for line in table.splitlines() if "BATCHSERVE_TRACING__SAMPLE_RATIO" in line)
    assert "number, 0.0 to 1.0" in nested
    assert "Share of requests traced." in nested


def test_the_monitoring_page_names_every_metric_alert_and_panel() -> None:
    page = _page("monitoring.md")
    metrics = [
        f"`{family.name}{'_total' if family.type == 'counter' else ''}`"
        for owner in (FrontendMetrics(), EngineMetrics(), ProcessMetrics("server"))
        for registry in [owner.registry]
        for family in registry.collect()
    ]
    alerts = [
        f"`{rule['alert']}`"
        for group in yaml.safe_load(ALERTS.read_text())["groups"]
        for rule in group["rules"]
    ]
    panels = [
        panel["title"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        if panel["type"] != "row"
    ]
    assert len(metrics) > 10
    assert [name for name in metrics + alerts + panels if name not in page] == []


def test_the_api_page_gives_every_error_its_code_and_statuses_from_the_code() -> None:
    """The table is rendered from ``service/errors.py``: a status changed there changes the
    page (it said 504 for a request that cannot finish by its deadline, the code 422)."""
    page = _page("api.md")
    assert "<!-- batchserve:errors -->" not in page
    rows = {
        line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| `")
    }
    for error in documented_errors():
        row = rows[f"`{error.code}`"]
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        assert cells[1:3] == [str(error.status_code), f"`{grpc_status_name(error)}`"], row
        assert cells[4], f"{error.__name__} needs a docstring saying when it is answered"
    assert "| `deadline_unreachable` | 422 | `DEADLINE_EXCEEDED` |" in errors_markdown()
    assert "| `version_switched` | 503 | `UNAVAILABLE` | yes |" in errors_markdown()


def test_an_unknown_marker_fails_the_build() -> None:
    with pytest.raises(ValueError, match="unknown docs marker 'setings'"):
        render_markers("# Page\n\n<!-- batchserve:setings -->\n")


@pytest.mark.slow
def test_the_site_builds_strictly_and_its_configuration_page_names_every_setting(
    tmp_path: Path,
) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    page = (tmp_path / "configuration" / "index.html").read_text()
    missing = [
        name for name in Settings.model_fields if f">BATCHSERVE_{name.upper()}</code>" not in page
    ]
    assert missing == []


def test_the_configuration_source_states_the_admin_token_minimum() -> None:
    """The markdown source holds only a marker for the table: the minimum a reader of the file
    needs is stated in its prose, and it is the minimum the settings enforce."""
    field = Settings.model_fields["admin_token"]
    minimum = next(getattr(item, "min_length", None) for item in field.metadata)
    source = (DOCS / "configuration.md").read_text()
    assert f"- `admin_token`: at least {minimum} characters" in source
