"""Just enough PromQL reading for the tests: which metric names an expression uses.

Syntax itself is checked by ``promtool``; this only has to find the series names, so it drops
strings, label matchers, ranges, grouping clauses, keywords, numbers and durations, and
function and aggregation names (an identifier followed by ``(``).
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# Not preceded by a word character, dot or colon (so the "m" of "5m" is no name), and not a
# function call.
_NAMES = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = frozenset(
    {
        "and", "or", "unless", "bool", "by", "without", "on", "ignoring",
        "group_left", "group_right", "offset", "inf", "nan",
    }
)  # fmt: skip


def metric_names(expression: str) -> set[str]:
    """The series names ``expression`` selects."""
    text = _STRINGS.sub('""', expression)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {name for name in _NAMES.findall(text) if name.lower() not in _KEYWORDS}


def exported_names(exposition: str) -> set[str]:
    """Every series name a Prometheus text exposition offers, including the ones a family
    declares but has no sample of yet (a labelled counter nobody incremented)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names
