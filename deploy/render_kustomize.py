"""Render a kustomization the way ``kubectl kustomize`` does, for the few features k8s/ uses.

CI validates the rendered manifests offline; this renderer lets it do so where no kustomize
binary exists (the tests compare it with ``kubectl kustomize`` where one does). It supports
``resources`` (files and kustomization folders), strategic-merge ``patches`` by path,
``images``, ``namespace`` and ``labels`` without selectors, and refuses anything else rather
than render it differently from kustomize.

    python -m deploy.render_kustomize k8s/overlays/gpu
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "patches", "images", "namespace", "labels"}
CLUSTER_SCOPED_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass"}
# The patchMergeKey of the Kubernetes API's lists that the overlays patch; any other list is
# replaced whole, as strategic merge does for lists without a merge key (and for CRDs).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}
PORT_MERGE_KEYS = ("containerPort", "port")  # container ports, then Service ports


class KustomizeError(Exception):
    """A kustomization this renderer cannot render exactly as kustomize would."""


def render(directory: Path) -> list[Resource]:
    """The resources of the kustomization in ``directory``, with its transformations applied."""
    path = directory / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    unsupported = set(kustomization) - SUPPORTED_FIELDS
    if unsupported:
        raise KustomizeError(f"{path}: unsupported fields {sorted(unsupported)}")

    resources: list[Resource] = []
    for entry in kustomization.get("resources", []):
        target = directory / entry
        if target.is_dir():
            resources.extend(render(target))
        else:
            resources.extend(doc for doc in yaml.safe_load_all(target.read_text()) if doc)

    for patch_entry in kustomization.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise KustomizeError(f"{path}: only `patches: - path: FILE` is supported")
        patch = yaml.safe_load((directory / patch_entry["path"]).read_text())
        target_resource = _find(resources, patch["kind"], patch["metadata"]["name"], path)
        merged = strategic_merge(target_resource, patch)
        resources[resources.index(target_resource)] = merged

    for image in kustomization.get("images", []):
        for resource in resources:
            _set_image(resource, image)

    namespace = kustomization.get("namespace")
    for resource in resources:
        if namespace and resource["kind"] not in CLUSTER_SCOPED_KINDS:
            resource.setdefault("metadata", {})["namespace"] = namespace
        for label_set in kustomization.get("labels", []):
            if set(label_set) != {"pairs"}:
                raise KustomizeError(f"{path}: only `labels: - pairs: ...` is supported")
            resource["metadata"].setdefault("labels", {}).update(label_set["pairs"])
    return resources


def strategic_merge(original: Any, patch: Any) -> Any:
    """Merge ``patch`` into a copy of ``original``: maps recursively, ``null`` deletes a key,
    lists with a merge key element by element, other lists are replaced."""
    if not isinstance(original, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    merged = copy.deepcopy(original)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, list) and isinstance(merged.get(key), list):
            merged[key] = _merge_list(key, merged[key], value)
        else:
            merged[key] = strategic_merge(merged.get(key), value)
    return merged


def _merge_list(field: str, original: list[Any], patch: list[Any]) -> list[Any]:
    merge_key = MERGE_KEYS.get(field)
    if field == "ports":
        merge_key = next((key for key in PORT_MERGE_KEYS if all(key in p for p in patch)), None)
    if merge_key is None:
        return copy.deepcopy(patch)
    merged = copy.deepcopy(original)
    for item in patch:
        index = next(
            (i for i, old in enumerate(merged) if old.get(merge_key) == item[merge_key]), None
        )
        if index is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[index] = strategic_merge(merged[index], item)
    return merged


def _find(resources: list[Resource], kind: str, name: str, source: Path) -> Resource:
    for resource in resources:
        if resource["kind"] == kind and resource["metadata"]["name"] == name:
            return resource
    raise KustomizeError(f"{source}: a patch targets {kind}/{name}, which is not a resource")


def _set_image(resource: Resource, image: dict[str, str]) -> None:
    pod_spec = resource.get("spec", {}).get("template", {}).get("spec", {})
    for container in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
        name, tag = _split_image(container["image"])
        if name != image["name"]:
            continue
        new_name = image.get("newName", name)
        new_tag = image.get("newTag", tag)
        container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name
        if "digest" in image:
            container["image"] = f"{new_name}@{image['digest']}"


def _split_image(reference: str) -> tuple[str, str | None]:
    name, _, tag = reference.rpartition(":")
    if not name or "/" in tag:  # no tag, or the colon belonged to a registry's port
        return reference, None
    return name, tag


def main(argv: Sequence[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else list(argv)
    if len(arguments) != 1:
        print("usage: python -m deploy.render_kustomize KUSTOMIZATION_DIR", file=sys.stderr)
        return 2
    try:
        resources = render(Path(arguments[0]))
    except KustomizeError as error:
        print(f"render_kustomize: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(resources, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
