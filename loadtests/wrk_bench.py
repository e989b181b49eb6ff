"""Superseded by ``python -m loadtests.sweep``; kept so the README's old command still works.

Runs the sweep on the ``digits-batched`` and ``digits-unbatched`` configurations only (no
model limit or ceilings) and prints its Markdown report:

    python -m loadtests.wrk_bench --concurrency 1 64 --duration-s 10 --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from loadtests import sweep


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", nargs="+", default=["1", "64"])
    parser.add_argument("--duration-s", default="10")
    parser.add_argument("--repeats", default="1", help="runs per point; the median is shown")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wrk-bench-") as out:
        status = sweep.main(
            [
                "--configs", "digits-batched", "digits-unbatched",
                "--concurrency", *args.concurrency,
                "--duration-s", args.duration_s,
                "--repeats", args.repeats,
                "--no-model-limit", "--no-http-ceiling", "--no-generator-ceiling",
                "--out", out,
            ]
        )  # fmt: skip
        report = Path(out) / "report.md"
        if report.exists():
            print(report.read_text().split("## Plots")[0].rstrip())  # the PNGs are not kept
    return status


if __name__ == "__main__":
    sys.exit(main())
