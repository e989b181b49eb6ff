"""The KServe manifests (``k8s/kserve/``) against KServe's own API models, offline.

The ``kserve`` package's generated models (and the Kubernetes client's, for the pod fields)
give every field's type; each document is walked against them, refusing unknown fields and
wrong types, then built, which refuses missing required fields. And the runtime must fit the
server: its port, its probes, its arguments.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from service.config import Settings
from service.server.cli import build_parser

KSERVE = Path(__file__).resolve().parent.parent / "k8s" / "kserve"


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(KSERVE.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            found.append((path.name, document))
    return found


def validated(*paths: Path) -> str:
    """``tests.kserve_schema``'s report on ``paths`` (empty when all are valid)."""
    run = subprocess.run(
        [sys.executable, "-m", "tests.kserve_schema", *map(str, paths)],
        capture_output=True,
        text=True,
        cwd=KSERVE.parent.parent,
        timeout=120,
    )
    assert run.returncode in (0, 1), run.stderr
    return run.stdout.strip()


def test_each_manifest_is_a_valid_kserve_resource() -> None:
    paths = sorted(KSERVE.glob("*.yaml"))
    assert len(paths) == 3
    assert all(doc["apiVersion"].startswith("serving.kserve.io/") for _, doc in documents())
    assert validated(*paths) == ""


def test_a_misspelt_or_missing_field_is_caught(tmp_path: Path) -> None:
    runtime = next(doc for _, doc in documents() if doc["kind"] == "ServingRuntime")
    misspelt = {**runtime, "spec": {**runtime["spec"], "protocolVersion": ["v2"]}}
    (tmp_path / "misspelt.yaml").write_text(yaml.safe_dump(misspelt))
    container = {**runtime["spec"]["containers"][0]}
    del container["name"]
    unnamed = {**runtime, "spec": {**runtime["spec"], "containers": [container]}}
    (tmp_path / "unnamed.yaml").write_text(yaml.safe_dump(unnamed))
    report = validated(tmp_path / "misspelt.yaml", tmp_path / "unnamed.yaml")
    assert (
        "misspelt.yaml: AssertionError: misspelt.yaml.spec: unknown field(s) ['protocolVersion']"
        in report
    )
    assert "unnamed.yaml: ValidationError: 1 validation error for V1Container\nname\n" in report
    assert "Field required" in report


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
