"""Every third-party module the service imports is a dependency it declares (or one of its
extras'), never only a development one: the container installs the runtime set alone, and a
CLI that imported a test client (httpx) once failed to start there."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Regenerates the gRPC code from its .proto: a maintainer's tool, run with the dev set.
MAINTAINERS_TOOLS = {ROOT / "service/frontend/oip/proto/generate.py"}


def _names(requirements: list[str]) -> set[str]:
    return {
        re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower().replace("_", "-")
        for spec in requirements
    }


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {
        name: specs for name, specs in project["optional-dependencies"].items() if name != "dev"
    }
    return _names(project["dependencies"]) | {
        name for specs in extras.values() for name in _names(specs)
    }


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_every_third_party_import_of_the_service_is_declared_outside_dev() -> None:
    declared = _declared()
    distributions = packages_distributions()
    undeclared: list[str] = []
    for path in sorted(set((ROOT / "service").rglob("*.py")) - MAINTAINERS_TOOLS):
        for root in sorted(_imported_roots(path)):
            if root == "service" or root in sys.stdlib_module_names or root == "__future__":
                continue
            owners = {name.lower().replace("_", "-") for name in distributions.get(root, [])}
            if not owners & declared:
                owner = ", ".join(sorted(owners)) or "not installed"
                undeclared.append(f"{path.relative_to(ROOT)}: {root} ({owner})")
    assert not undeclared, "imported but not a runtime dependency or extra:\n" + "\n".join(
        undeclared
    )
