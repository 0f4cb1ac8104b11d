"""Renders the small subset of kustomize that deploy/k8s uses, for offline checks.

kustomize itself is not packaged for Debian bookworm nor on PyPI, so CI renders
the overlays with this module and validates the output. It supports exactly:

- ``resources``: YAML files (one or more documents) and directories that hold a
  ``kustomization.yaml``, loaded in order, relative to the kustomization;
- ``patches``: entries ``{path: file}`` holding a strategic-merge patch that names
  its target by ``kind`` and ``metadata.name``;
- ``images``: entries ``{name, newName?, newTag?, digest?}`` applied to every
  container and init container of Pod templates;
- ``components``: directories whose ``kustomization.yaml`` is a ``Component``
  (``kustomize.config.k8s.io/v1alpha1``) with ``resources`` (files) and ``patches``;
  as kustomize does, each is applied in order to the resources loaded so far, before
  the kustomization's own patches and images.

Anything else in a kustomization (another key, a patch ``target``, a resource
outside the kustomization root) is an error, so the manifests cannot silently
rely on a kustomize feature these checks do not model. Strategic merge follows
Kubernetes for the lists used here: the lists named in ``MERGE_KEYS`` merge
element by element on their key, an element ``{$patch: delete, <key>: ...}``
removes one, ``null`` removes a field, and every other list is replaced.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

# List fields that Kubernetes merges by key (patchMergeKey) in the kinds used here.
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
    "resourceClaims": "name",
    "claims": "name",
    "imagePullSecrets": "name",
}

KNOWN_KEYS = {"apiVersion", "kind", "resources", "patches", "images", "components"}
COMPONENT_KEYS = {"apiVersion", "kind", "resources", "patches"}


class RenderError(Exception):
    """A kustomization this renderer cannot render faithfully, or a broken reference."""


Resource = dict[str, Any]


def load_documents(path: Path) -> list[Resource]:
    """Every non-empty YAML document of a file; each must be a mapping."""
    with path.open(encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise RenderError(f"{path}: document {i} is a {type(doc).__name__}, want a mapping")
    return docs


def _inside(root: Path, path: Path, what: str) -> Path:
    resolved = path.resolve()
    # Directories given as resources may be anywhere (a base); files must not escape the root,
    # as kustomize's default load restrictor demands.
    if not resolved.is_relative_to(root.resolve()):
        raise RenderError(f"{what} {path} is outside the kustomization root {root}")
    return resolved


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Returns base with patch merged into it (neither argument is modified)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(base, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        out = copy.deepcopy(base)
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise RenderError(f"patch element of '{field}' has no merge key '{key}': {item!r}")
            index = next((i for i, b in enumerate(out) if b.get(key) == item[key]), None)
            if item.get("$patch") == "delete":
                if index is None:
                    raise RenderError(f"'{field}' has no element {key}={item[key]!r} to delete")
                del out[index]
            elif index is None:
                out.append(copy.deepcopy(item))
            else:
                out[index] = strategic_merge(out[index], item, field)
        return out
    return copy.deepcopy(patch)


def _split_image(image: str) -> tuple[str, str]:
    """('repo/name', ':tag' or '@sha256:...' or '')."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _set_images(resource: Resource, images: list[dict[str, str]]) -> None:
    spec = resource.get("spec", {}).get("template", {}).get("spec")
    if spec is None:
        return
    for container in spec.get("initContainers", []) + spec.get("containers", []):
        name, suffix = _split_image(container["image"])
        for entry in images:
            if entry["name"] != name:
                continue
            if "digest" in entry:
                suffix = "@" + entry["digest"]
            elif "newTag" in entry:
                suffix = ":" + entry["newTag"]
            container["image"] = entry.get("newName", name) + suffix
            break


def _identity(resource: Resource) -> tuple[str, str]:
    return resource["kind"], resource.get("metadata", {}).get("name", "")


def _kustomization(directory: Path, kind: str, keys: set[str]) -> tuple[Path, dict[str, Any]]:
    """The kustomization.yaml of directory, which must be of kind and hold only keys."""
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise RenderError(f"{directory} has no kustomization.yaml")
    docs = load_documents(kfile)
    if len(docs) != 1:
        raise RenderError(f"{kfile}: want one document, found {len(docs)}")
    k = docs[0]
    unknown = sorted(set(k) - keys)
    if unknown:
        raise RenderError(f"{kfile}: unsupported keys {unknown} (supported: {sorted(keys)})")
    if k.get("kind") != kind:
        raise RenderError(f"{kfile}: kind is {k.get('kind')!r}, want {kind}")
    return kfile, k


def _add_resources(
    directory: Path, kfile: Path, entries: list[str], resources: list[Resource], dirs: bool
) -> None:
    """Appends the resources entries name (files; kustomizations too where dirs) and
    fails when one is defined twice."""
    for entry in entries:
        path = directory / entry
        if path.is_dir() and not dirs:
            raise RenderError(f"{kfile}: resource {entry} is a directory: a Component lists files")
        if path.is_dir():
            resources.extend(render(path))
        elif path.is_file():
            resources.extend(load_documents(_inside(directory, path, "resource")))
        else:
            raise RenderError(f"{kfile}: resource {entry} does not exist")
    seen: set[tuple[str, str]] = set()
    for r in resources:
        if _identity(r) in seen:
            raise RenderError(f"{kfile}: {_identity(r)} is defined twice")
        seen.add(_identity(r))


def _apply_patches(
    directory: Path, kfile: Path, entries: list[dict[str, Any]], resources: list[Resource]
) -> None:
    for entry in entries:
        if set(entry) != {"path"}:
            raise RenderError(f"{kfile}: patch {entry} must have only 'path'")
        path = directory / entry["path"]
        if not path.is_file():
            raise RenderError(f"{kfile}: patch {entry['path']} does not exist")
        for patch in load_documents(_inside(directory, path, "patch")):
            matches = [i for i, r in enumerate(resources) if _identity(r) == _identity(patch)]
            if not matches:
                raise RenderError(f"{path}: patch target {_identity(patch)} is not a resource")
            resources[matches[0]] = strategic_merge(resources[matches[0]], patch)


def render(directory: Path, components: tuple[Path, ...] = ()) -> list[Resource]:
    """The resources of the kustomization in directory, with patches and images applied.

    components are applied after those the kustomization lists, as if listed last.
    """
    kfile, k = _kustomization(directory, "Kustomization", KNOWN_KEYS)
    resources: list[Resource] = []
    _add_resources(directory, kfile, k.get("resources", []), resources, dirs=True)
    for component in [directory / c for c in k.get("components", [])] + list(components):
        if not component.is_dir():
            raise RenderError(f"{kfile}: component {component} is not a directory")
        ckfile, ck = _kustomization(component, "Component", COMPONENT_KEYS)
        if ck.get("apiVersion") != "kustomize.config.k8s.io/v1alpha1":
            raise RenderError(f"{ckfile}: a Component is kustomize.config.k8s.io/v1alpha1")
        _add_resources(component, ckfile, ck.get("resources", []), resources, dirs=False)
        _apply_patches(component, ckfile, ck.get("patches", []), resources)
    _apply_patches(directory, kfile, k.get("patches", []), resources)

    images = k.get("images", [])
    for entry in images:
        if "name" not in entry or not set(entry) <= {"name", "newName", "newTag", "digest"}:
            raise RenderError(f"{kfile}: bad images entry {entry}")
    used = set()
    for r in resources:
        spec = r.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            used.add(_split_image(c["image"])[0])
    for entry in images:
        if entry["name"] not in used:
            raise RenderError(f"{kfile}: images entry {entry['name']!r} matches no container")
        for r in resources:
            _set_images(r, [entry])
    return resources


def main() -> None:
    import sys

    for directory in sys.argv[1:]:
        print(yaml.safe_dump_all(render(Path(directory)), sort_keys=False), end="")


if __name__ == "__main__":
    main()
