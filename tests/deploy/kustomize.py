"""A kustomize renderer for the subset deploy/k8s uses, for machines without kubectl (a module, not
conftest, so the test file can import it).

Supported: ``resources`` (files and directories holding a kustomization.yaml), ``secretGenerator``
with ``files`` (``key=path`` or ``path``) under ``generatorOptions.disableNameSuffixHash: true``, and
``patches`` by ``path`` (strategic merge: maps merge, the lists below merge by their key, other lists
are replaced). Anything else is refused, so that a manifest change beyond the subset fails loudly
instead of rendering differently from ``kubectl kustomize``.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "secretGenerator", "generatorOptions", "patches"}
# The patchMergeKey of each list of the kinds deploy/k8s patches (from the Kubernetes API).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


def render(directory: Path) -> list[dict[str, Any]]:
    """The resources of the kustomization in ``directory``, with its patches applied."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml: fields beyond the subset this renderer knows: {unknown}")
    resources: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            resources.extend(render(path))
        else:
            resources.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    if kustomization.get("secretGenerator"):
        if not kustomization.get("generatorOptions", {}).get("disableNameSuffixHash"):
            raise ValueError("only secretGenerator with generatorOptions.disableNameSuffixHash: true is supported")
        resources.extend(_secret(directory, spec) for spec in kustomization["secretGenerator"])
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"only patches by path are supported, got {patch}")
        for doc in yaml.safe_load_all((directory / patch["path"]).read_text()):
            (target,) = [r for r in resources if _identity(r) == _identity(doc)]
            resources[resources.index(target)] = merge(target, doc)
    return resources


def _identity(resource: dict[str, Any]) -> tuple[str, str]:
    return resource["kind"], resource["metadata"]["name"]


def _secret(directory: Path, spec: dict[str, Any]) -> dict[str, Any]:
    if set(spec) - {"name", "files"}:
        raise ValueError(f"secretGenerator {spec['name']}: only name and files are supported")
    data = {}
    for entry in spec["files"]:
        key, _, path = entry.rpartition("=")
        data[key or Path(path).name] = base64.b64encode((directory / path).read_bytes()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": spec["name"]}, "type": "Opaque", "data": data}


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """``patch`` merged into ``base`` as a strategic merge patch of the subset above."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = merge(base[key], value, key) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        by_key = {item[key]: item for item in base}
        patched = {item[key]: item for item in patch}
        return ([merge(by_key[k], v) if k in by_key else v for k, v in patched.items()]
                + [item for item in base if item[key] not in patched])
    return patch
