"""The KServe manifests (``k8s/kserve/``) against KServe's own API models, offline.

The ``kserve`` package's generated models (and the Kubernetes client's, for the pod fields)
give every field's type; each document is walked against them, refusing unknown fields and
wrong types, then built, which refuses missing required fields. And the runtime must fit the
server: its port, its probes, its arguments.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes.client.models as kubernetes_models
import pytest
import yaml

from service.config import Settings
from service.server.cli import build_parser

KSERVE = Path(__file__).resolve().parent.parent / "k8s" / "kserve"
_PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "object": (object,),
}


def kserve_models() -> Any:
    import kserve.models

    return kserve.models


def model_class(name: str) -> type:
    found = getattr(kserve_models(), name, None) or getattr(kubernetes_models, name, None)
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


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(KSERVE.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            found.append((path.name, document))
    return found


KINDS = {"ServingRuntime": "V1alpha1ServingRuntime", "InferenceService": "V1beta1InferenceService"}


@pytest.mark.parametrize(("name", "document"), documents(), ids=lambda value: str(value)[:40])
def test_each_manifest_is_a_valid_kserve_resource(name: str, document: dict[str, Any]) -> None:
    assert document["apiVersion"].startswith("serving.kserve.io/")
    build(document, KINDS[document["kind"]], name)


def test_a_misspelt_or_missing_field_is_caught() -> None:
    runtime = next(doc for _, doc in documents() if doc["kind"] == "ServingRuntime")
    misspelt = {**runtime, "spec": {**runtime["spec"], "protocolVersion": ["v2"]}}
    with pytest.raises(AssertionError, match=r"unknown field\(s\) \['protocolVersion'\]"):
        build(misspelt, KINDS["ServingRuntime"], "runtime")
    unnamed = {**runtime["spec"]["containers"][0]}
    del unnamed["name"]
    with pytest.raises(ValueError, match="name"):
        build(unnamed, "V1Container", "container")


def test_the_runtime_fits_the_server_and_the_services_fit_the_runtime() -> None:
    resources = documents()
    runtime = next(doc for _, doc in resources if doc["kind"] == "ServingRuntime")
    spec = runtime["spec"]
    assert set(spec["protocolVersions"]) == {"v2", "grpc-v2"}
    (container,) = spec["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    settings = Settings(
        **{key.removeprefix("BATCHSERVE_").lower(): value for key, value in env.items()}
    )
    assert settings.model_repository == Path("/mnt/models")  # where KServe puts storageUri
    assert container["ports"][0]["containerPort"] == settings.port
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == settings.port
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    arguments = [re.sub(r"\{\{\.Name\}\}", "digits", arg) for arg in container["args"]]
    assert build_parser().parse_args(arguments).model_name == "digits"

    formats = {entry["name"] for entry in spec["supportedModelFormats"]}
    services = [doc for _, doc in resources if doc["kind"] == "InferenceService"]
    assert len(services) == 2
    for service in services:
        model = service["spec"]["predictor"]["model"]
        assert model["runtime"] == runtime["metadata"]["name"]
        assert model["modelFormat"]["name"] in formats
        assert model["protocolVersion"] in spec["protocolVersions"]
        if model["protocolVersion"] == "grpc-v2":
            (port,) = model["ports"]
            assert (port["name"], port["containerPort"]) == (
                "h2c",
                int(env["BATCHSERVE_GRPC_PORT"]),
            )
