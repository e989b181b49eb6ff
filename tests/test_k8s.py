"""The Kubernetes manifests under k8s/, rendered per overlay: they validate against the
Kubernetes API schemas, and they keep the promises docs/deployment.md makes (a GPU per pod in
the gpu overlay, probes on the right routes, a drain that fits the grace period, a non-root
pod, settings that the server accepts, and an autoscaler metric that really exists)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploy.render_kustomize import KustomizeError, render, strategic_merge
from service.config import ENV_PREFIX, Settings, load_settings
from service.metrics import FrontendMetrics
from service.server.gunicorn_setup import graceful_timeout_s

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
OVERLAYS = ("cpu", "gpu")
# The oldest release the manifests are meant for (PodDisruptionBudget's
# unhealthyPodEvictionPolicy is on by default from 1.27) and the newest the schemas know.
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())

# ServiceMonitor is a CRD, absent from the Kubernetes schemas. This is the part of the
# Prometheus Operator's monitoring.coreos.com/v1 schema that k8s/ uses, closed to unknown
# fields so that a misspelt one fails here rather than being dropped by the API server.
_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": _STRING_MAP,
                "annotations": _STRING_MAP,
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": _STRING_MAP},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                        },
                    },
                },
            },
        },
    },
}

Resources = dict[str, dict[str, Any]]


def by_kind(resources: list[dict[str, Any]]) -> Resources:
    kinds = [resource["kind"] for resource in resources]
    assert len(kinds) == len(set(kinds)), f"one resource of each kind expected, got {kinds}"
    return {resource["kind"]: resource for resource in resources}


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def rendered(overlay: str) -> Resources:
    return by_kind(render(K8S / "overlays" / overlay))


def server_container(resources: Resources) -> dict[str, Any]:
    containers = resources["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["server"]
    container: dict[str, Any] = containers[0]
    return container


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, f"expected a duration in seconds such as 15s, got {duration!r}"
    return float(match.group(1))


def configmap_settings(resources: Resources, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings a pod gets: the ConfigMap's variables and nothing else of this process."""
    for variable in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(variable)
    for key, value in resources["ConfigMap"]["data"].items():
        monkeypatch.setenv(key, value)
    return load_settings()


def dockerfile_instruction(name: str) -> str:
    lines = (REPO / "Dockerfile").read_text().splitlines()
    values = [line.split(maxsplit=1)[1] for line in lines if line.startswith(name + " ")]
    assert len(values) == 1, f"expected one {name} in the Dockerfile, got {values}"
    return values[0]


def test_every_document_validates_against_its_schema(rendered: Resources) -> None:
    assert set(rendered) == {
        "ConfigMap",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
    }
    for resource in rendered.values():
        if resource["apiVersion"].startswith("monitoring.coreos.com/"):
            jsonschema.validate(resource, SERVICE_MONITOR_SCHEMA)
            continue
        for version in KUBERNETES_VERSIONS:
            # strict: a field the API does not know (a typo) fails instead of being ignored.
            kubernetes_validate.validate(resource, version, strict=True)


def test_the_kubernetes_schemas_catch_a_misspelt_field(rendered: Resources) -> None:
    broken = strategic_merge(
        rendered["Deployment"], {"spec": {"template": {"spec": {"terminationGracePeriod": 45}}}}
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not found")
@pytest.mark.parametrize("kustomization", ["base", "overlays/cpu", "overlays/gpu"])
def test_the_renderer_matches_kubectl_kustomize(kustomization: str) -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(K8S / kustomization)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    expected = {(r["kind"], r["metadata"]["name"]): r for r in yaml.safe_load_all(built.stdout)}
    ours = {(r["kind"], r["metadata"]["name"]): r for r in render(K8S / kustomization)}
    assert ours == expected


def test_only_the_gpu_overlay_asks_for_a_gpu_and_cuda(overlay: str, rendered: Resources) -> None:
    resources = server_container(rendered)["resources"]
    device = rendered["ConfigMap"]["data"]["BATCHSERVE_DEVICE"]
    image = server_container(rendered)["image"]
    if overlay == "gpu":
        assert resources["limits"]["nvidia.com/gpu"] == 1
        assert device == "cuda"
        assert "cuda" in image
    else:
        assert "nvidia.com/gpu" not in resources.get("limits", {})
        assert "nvidia.com/gpu" not in resources.get("requests", {})
        assert device == "cpu"
        assert "cuda" not in image
    assert resources["requests"]["memory"]
    assert resources["limits"]["memory"]


def test_probes_use_readiness_and_liveness_routes(rendered: Resources) -> None:
    container = server_container(rendered)
    port_names = {port["name"] for port in container["ports"]}
    routes = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http_get = container[probe]["httpGet"]
        assert http_get["port"] in port_names
        routes[probe] = http_get["path"]
    assert routes == {
        "startupProbe": "/readyz",
        "readinessProbe": "/readyz",
        "livenessProbe": "/healthz",
    }
    startup = container["startupProbe"]
    # Loading, torch.compile and warm-up can take minutes before /readyz turns 200.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_grace_period_outlasts_pre_stop_and_drain(
    rendered: Resources, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    command = server_container(rendered)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    # After SIGTERM: the drain delay, every request in flight answered (up to its deadline),
    # then the device freed; gunicorn's graceful timeout is the longest of the two launchers.
    settings = configmap_settings(rendered, monkeypatch)
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + graceful_timeout_s(settings)


def test_pod_runs_as_the_images_non_root_user_on_a_read_only_root(rendered: Resources) -> None:
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    pod_security = pod["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert f"{pod_security['runAsUser']}:{pod_security['runAsGroup']}" == (
        dockerfile_instruction("USER")
    )
    assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
    container = server_container(rendered)
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert pod["automountServiceAccountToken"] is False
    # Service links would inject BATCHSERVE_PORT=tcp://... into the server's settings.
    assert pod["enableServiceLinks"] is False

    # What the read-only root leaves writable: /tmp and the metrics folder, both emptyDir.
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    env = {variable["name"]: variable["value"] for variable in container["env"]}
    for path in ("/tmp", env["PROMETHEUS_MULTIPROC_DIR"]):
        assert "emptyDir" in volumes[mounts[path]]
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"PROMETHEUS_MULTIPROC_DIR={env['PROMETHEUS_MULTIPROC_DIR']}" in dockerfile


def test_configmap_holds_only_settings_the_server_accepts(
    rendered: Resources, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = rendered["ConfigMap"]["data"]
    for key in data:
        assert key.startswith(ENV_PREFIX), key
        assert key.removeprefix(ENV_PREFIX).lower() in Settings.model_fields, (
            f"{key} is not a batchserve setting"
        )
    settings = configmap_settings(rendered, monkeypatch)
    assert settings.port == server_container(rendered)["ports"][0]["containerPort"]
    assert str(settings.port) == dockerfile_instruction("EXPOSE")
    assert settings.host == "0.0.0.0"


def test_names_and_selectors_line_up(rendered: Resources) -> None:
    deployment = rendered["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = server_container(rendered)
    service = rendered["Service"]

    def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return selector.items() <= labels.items()

    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    assert selects(service["spec"]["selector"], pod_labels)
    assert selects(rendered["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"], pod_labels)
    monitor = rendered["ServiceMonitor"]["spec"]
    assert selects(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    service_ports = {port["name"] for port in service["spec"]["ports"]}
    assert {endpoint["port"] for endpoint in monitor["endpoints"]} <= service_ports
    # The Prometheus Operator names the job after the Service (no jobLabel), and the alerts in
    # deploy/prometheus/ select job="batchserve".
    assert service["metadata"]["name"] == "batchserve"
    assert "jobLabel" not in monitor
    for endpoint in monitor["endpoints"]:
        assert endpoint["path"] == "/metrics"
        # Prometheus refuses a scrape timeout longer than the interval.
        assert seconds(endpoint["scrapeTimeout"]) <= seconds(endpoint["interval"])
    container_ports = {port["name"] for port in container["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= container_ports
    assert container["envFrom"] == [
        {"configMapRef": {"name": rendered["ConfigMap"]["metadata"]["name"]}}
    ]
    target = rendered["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    assert {r["metadata"]["namespace"] for r in rendered.values()} == {"batchserve"}


def test_autoscaler_metric_is_exported_and_served_by_the_adapter(rendered: Resources) -> None:
    hpa = rendered["HorizontalPodAutoscaler"]["spec"]
    assert hpa["minReplicas"] >= 2, "with one pod, the disruption budget would block drains"
    [metric] = hpa["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]

    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    rules = [rule for rule in adapter["rules"]["custom"] if rule["name"]["as"] == name]
    assert len(rules) == 1, f"no Prometheus Adapter rule serves {name}"
    [rule] = rules
    assert rule["seriesQuery"].startswith(name + "{")
    assert re.fullmatch(rule["name"]["matches"], name)
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert placeholder in rule["metricsQuery"]

    exported = {
        family.name for family in FrontendMetrics().registry.collect() if family.type == "gauge"
    }
    assert name in exported, f"the server exports no gauge named {name}"


def test_renderer_merges_lists_by_their_kubernetes_merge_key() -> None:
    original = {
        "containers": [
            {"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["--one"]},
            {"name": "b", "image": "b:1"},
        ],
        "tolerations": [{"key": "old"}],
        "drop": "me",
    }
    patch = {
        "containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["--two"]}],
        "tolerations": [{"key": "new"}],
        "drop": None,
    }
    assert strategic_merge(original, patch) == {
        "containers": [
            {
                "name": "a",
                "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}],
                "args": ["--two"],
            },
            {"name": "b", "image": "b:1"},
        ],
        "tolerations": [{"key": "new"}],
    }


def test_renderer_refuses_what_it_cannot_render_like_kustomize(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("namePrefix: prod-\nresources: []\n")
    with pytest.raises(KustomizeError, match="namePrefix"):
        render(tmp_path)
