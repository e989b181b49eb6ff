"""``batchserve tune`` end to end on the bundled ``digits`` model with a short budget: the
settings it writes are valid ``Settings``, its report is complete, and a target no
configuration can meet gets a clear answer naming the best p99 and what bounds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.config import ENV_PREFIX, Settings
from service.server.env_file import read_env_file
from service.server.tuning.space import TUNED_FIELDS

#: Short: trial 0 (the defaults) and the re-measurement always run, which is what these
#: tests check; a longer budget only adds trials (40 s took about 30 s a test).
BUDGET_S = 20
#: A runaway search fails at this rather than hanging the suite; a loaded host is slow.
TIMEOUT_S = 240
#: What a whole run may report having taken, on a loaded host too.
ELAPSED_LIMIT_S = 120
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_tune(tmp_path: Path, p99_ms: float) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "tuned.env"
    environ = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    command = [
        sys.executable,
        "-m",
        "service.server.cli",
        "tune",
        "--model",
        "digits",
        "--concurrency",
        "4",
        "--p99-ms",
        str(p99_ms),
        "--budget-s",
        str(BUDGET_S),
        "--out",
        str(out),
    ]
    completed = subprocess.run(
        command,
        env=environ | {"BATCHSERVE_DEVICE": "cpu"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return completed, out


def settings_of(path: Path) -> Settings:
    variables = read_env_file(path)
    return Settings(**{key.removeprefix(ENV_PREFIX).lower(): v for key, v in variables.items()})  # type: ignore[arg-type]


@pytest.mark.slow
def test_tune_writes_valid_settings_and_a_complete_report(tmp_path: Path) -> None:
    completed, out = run_tune(tmp_path, p99_ms=5000)
    assert completed.returncode == 0, completed.stderr
    variables = read_env_file(out)
    assert {ENV_PREFIX + name.upper() for name in TUNED_FIELDS} <= set(variables)
    settings = settings_of(out)
    assert settings.model_name == "digits"
    assert settings.model_version == "dae3cd981a36"

    page = (tmp_path / "tuned.md").read_text()
    for heading in (
        "# Tuning digits@dae3cd981a36",
        "**Winner**",
        "## Winner against the defaults, interleaved",
        "| tuned |",
        "| defaults |",
        "## Candidates",
        "(winner)",
        "## Model limit and HTTP ceiling",
        "![throughput and p99 per candidate](tuned.png)",
    ):
        assert heading in page, heading
    assert (tmp_path / "tuned.png").read_bytes().startswith(PNG_MAGIC)
    data = json.loads((tmp_path / "tuned.json").read_text())
    assert data["trials"]
    assert data["ceiling_rps"]["1"] > 0
    assert data["model_limit_rps"] > 0
    assert data["elapsed_s"] < ELAPSED_LIMIT_S
    # Progress: what is measured and the time left, on stderr.
    assert "measuring the model limit" in completed.stderr
    assert "s left] trial 0 (defaults)" in completed.stderr
    assert "winner:" in completed.stderr


@pytest.mark.slow
def test_tune_answers_clearly_when_no_configuration_meets_the_target(tmp_path: Path) -> None:
    completed, out = run_tune(tmp_path, p99_ms=0.01)
    assert completed.returncode == 3, completed.stderr
    assert "no configuration met p99 0.01 ms: the lowest p99 reached was" in completed.stderr
    assert "bound by model: one row alone takes" in completed.stderr
    assert "NO configuration met p99 0.01 ms" in out.read_text()
    settings_of(out)  # the lowest p99 reached, still valid settings
    page = (tmp_path / "tuned.md").read_text()
    assert "**No configuration met p99 0.01 ms.**" in page
    assert "What bounds it: **model**" in page
