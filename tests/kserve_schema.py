"""Validates KServe resources against the ``kserve`` package's API models, in a process of
its own: ``python -m tests.kserve_schema FILE...`` prints one line per problem and exits 1 if
there is any. (Importing ``kserve`` registers its own copy of the V2 gRPC proto, which clashes
with tritonclient's in the test process: one process cannot hold both.)"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import kserve.models
import kubernetes.client.models as kubernetes_models
import yaml

KINDS = {"ServingRuntime": "V1alpha1ServingRuntime", "InferenceService": "V1beta1InferenceService"}
_PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "object": (object,),
}


def model_class(name: str) -> type:
    found = getattr(kserve.models, name, None) or getattr(kubernetes_models, name, None)
    assert found is not None, f"no API model {name}"
    return found  # type: ignore[no-any-return]


def build(value: Any, type_name: str, path: str) -> Any:
    """``value`` checked against ``type_name`` and built as the API models build it."""
    # kserve writes list[T] and dict(str, T); the Kubernetes client List[T] and Dict[str, T].
    if type_name.lower().startswith("list["):
        assert isinstance(value, list), f"{path}: expected a list"
        return [build(item, type_name[5:-1], f"{path}[{i}]") for i, item in enumerate(value)]
    if type_name.lower().startswith(("dict(", "dict[")):
        assert isinstance(value, dict), f"{path}: expected a mapping"
        inner = type_name[5:-1].split(", ", 1)[1]
        return {key: build(item, inner, f"{path}.{key}") for key, item in value.items()}
    if type_name in _PRIMITIVES:
        assert isinstance(value, _PRIMITIVES[type_name]), f"{path}: expected {type_name}"
        return value
    cls = model_class(type_name)
    assert isinstance(value, dict), f"{path}: expected an object ({type_name})"
    attributes = {key: attribute for attribute, key in cls.attribute_map.items()}  # type: ignore[attr-defined]
    unknown = sorted(set(value) - set(attributes))
    assert not unknown, f"{path}: unknown field(s) {unknown} in {type_name}"
    arguments = {
        attributes[key]: build(item, cls.openapi_types[attributes[key]], f"{path}.{key}")  # type: ignore[attr-defined]
        for key, item in value.items()
    }
    return cls(**arguments)


def problems(path: Path) -> list[str]:
    """What is wrong with each resource of ``path`` (nothing: an empty list)."""
    found = []
    for document in yaml.safe_load_all(path.read_text()):
        try:
            build(document, KINDS[document["kind"]], path.name)
        except (AssertionError, ValueError, TypeError, KeyError) as error:
            found.append(f"{path.name}: {type(error).__name__}: {error}")
    return found


def main(paths: list[str]) -> int:
    found = [problem for path in paths for problem in problems(Path(path))]
    print("\n".join(found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
