"""The front-end cost harness's pure parts: the py-spy summary and the table of medians."""

from __future__ import annotations

from pathlib import Path

from loadtests.frontend_cost import Sample, _table
from loadtests.pyspy_summary import summarise


def test_a_raw_profile_is_summarised_as_inclusive_and_self_shares(tmp_path: Path) -> None:
    profile = tmp_path / "raw.txt"
    profile.write_text(
        "main (/x/loadtests/a.py:3);serve (/x/site-packages/pkg/b.py:9) 3\n"
        "main (/x/loadtests/a.py:3) 1\n"
        "other (/x/c.py:1) 4\n"
    )
    summary = summarise(profile, top=5, only="main (")
    assert summary.splitlines()[:4] == [
        "# 4 samples",
        "## inclusive",
        "100.0% main (loadtests/a.py)",
        " 75.0% serve (pkg/b.py)",
    ]
    assert " 75.0% serve (pkg/b.py)" in summary.split("## self")[1]


def test_the_table_gives_medians_and_the_median_of_round_ratios() -> None:
    def sample(rate: float, frontend_us: float) -> Sample:
        return Sample(rate, 1000, 0, {"frontend": frontend_us, "engine": 0.0, "all": frontend_us})

    table = _table(
        {
            ("workers2", "baseline"): [sample(100, 200), sample(100, 400), sample(100, 300)],
            ("workers2", "this"): [sample(110, 100), sample(90, 400), sample(100, 150)],
        },
        ["workers2"],
    )
    assert "| workers2 | baseline | 100 | 300 | 0 | 300 |" in table
    assert "| workers2 | this | 100 | 150 | 0 | 150 |" in table
    assert "req/s 1.00x, front-end CPU 0.50x" in table
