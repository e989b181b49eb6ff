"""Summarise a ``py-spy record -f raw`` profile: each function's inclusive and self share.

``python -m loadtests.pyspy_summary PROFILE [--top 45] [--only FRAME] [--by-line 30]``: one
line per function (``name (file)``, site-packages and checkout prefixes cut), inclusive share
of the samples first, then the top self shares. ``--only`` keeps the stacks that contain
``FRAME`` (e.g. ``measure.<locals>.client`` for ``loadtests/frontend_asgi_cost.py``: its
request path without the start-up imports). ``--by-line`` adds the top self shares by line.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_FRAME = re.compile(r"(.*) \((.*?):\d+\)$")
_FRAME_LINE = re.compile(r"(.*) \((.*?):(\d+)\)$")


def short(frame: str) -> str:
    found = _FRAME.match(frame)
    if found is None:
        return frame
    path = found.group(2).split("site-packages/")[-1]
    path = re.sub(r"^.*?/(service|loadtests|tests)/", r"\1/", path)
    return f"{found.group(1)} ({path})"


def summarise(profile: Path, top: int, only: str | None, by_line: int = 0) -> str:
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    own_lines: collections.Counter[str] = collections.Counter()
    total = 0
    for line in profile.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or (only is not None and only not in stack):
            continue
        count = int(count_text)
        frames = [short(frame) for frame in stack.split(";")]
        total += count
        for frame in set(frames):
            inclusive[frame] += count
        own[frames[-1]] += count
        own_lines[short_line(stack.rpartition(";")[2])] += count
    lines = [f"# {total} samples", "## inclusive"]
    lines += [f"{100 * n / total:5.1f}% {name}" for name, n in inclusive.most_common(top)]
    lines += ["## self (top 25)"]
    lines += [f"{100 * n / total:5.1f}% {name}" for name, n in own.most_common(25)]
    if by_line:
        lines += [f"## self by line (top {by_line})"]
        lines += [f"{100 * n / total:5.1f}% {name}" for name, n in own_lines.most_common(by_line)]
    return "\n".join(lines)


def short_line(frame: str) -> str:
    """A frame as ``short`` names it, its line number kept (where a GC pause or a C call
    that one line makes shows)."""
    found = _FRAME_LINE.match(frame)
    if found is None:
        return frame
    return f"{short(f'{found.group(1)} ({found.group(2)}:0)').rpartition(')')[0]}:{found.group(3)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--only", default=None)
    parser.add_argument("--by-line", type=int, default=0, help="also the top self lines")
    args = parser.parse_args()
    print(summarise(args.profile, args.top, args.only, args.by_line))


if __name__ == "__main__":
    main()
