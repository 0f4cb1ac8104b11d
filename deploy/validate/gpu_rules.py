"""The GPU rule of validate_manifests: a pod that holds a GPU lands only on GPUs the image
has code for (the Dockerfile's CUDA_ARCHITECTURES); below that epsd's CUDA warm-up fails and
it serves the cpu backend alone (docs/deploy-operations.md, "Startup and fail-open")."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kustomize_render import RenderError, Resource

# GPU feature discovery's node label of the GPUs' compute capability major (option A).
COMPUTE_MAJOR_LABEL = "nvidia.com/gpu.compute.major"
# How the NVIDIA DRA driver's devices are selected by compute capability (option B).
COMPUTE_CEL = re.compile(
    r'device\.attributes\["gpu\.nvidia\.com"\]\.cudaComputeCapability'
    r'\.compareTo\(semver\("([0-9]+)\.[0-9]+\.[0-9]+"\)\)\s*>=\s*0'
)


def lowest_compute_major(dockerfile: Path) -> int:
    """The lowest compute capability major the image has GPU code for.

    The Dockerfile's CUDA_ARCHITECTURES default is CMake's list: "90" is sm_90 code plus
    compute_90 PTX, which the driver compiles for newer GPUs, so the lowest entry is the
    oldest GPU epsd's kernels run on; below it the CUDA warm-up fails and epsd serves
    the cpu backend alone.
    """
    m = re.search(r"^ARG CUDA_ARCHITECTURES=(\S+)", dockerfile.read_text(), re.MULTILINE)
    if not m:
        raise RenderError(f"{dockerfile}: no 'ARG CUDA_ARCHITECTURES=' default")
    entries = [re.match(r"[0-9]+", e.strip('"')) for e in m.group(1).split(";")]
    if not entries or not all(entries):
        raise RenderError(f"{dockerfile}: CUDA_ARCHITECTURES={m.group(1)} is not a CMake list")
    return min(int(e.group(0)) for e in entries) // 10


def _excludes_older_gpus(term: dict[str, Any], lowest: int) -> bool:
    """A node selector term that admits only nodes whose GPUs have compute major >= lowest."""
    for e in term.get("matchExpressions", []):
        if e.get("key") != COMPUTE_MAJOR_LABEL:
            continue
        values = e.get("values", [])
        if not values or not all(str(v).isdigit() for v in values):
            continue
        if e.get("operator") == "Gt" and int(values[0]) >= lowest - 1:
            return True
        if e.get("operator") == "In" and min(int(v) for v in values) >= lowest:
            return True
    return False


def gpu_architecture_errors(resources: list[Resource], lowest: int) -> list[str]:
    """A pod that holds a GPU is placed only on GPUs of compute capability >= lowest.

    Option A (the device plugin): a required node affinity on GPU feature discovery's
    nvidia.com/gpu.compute.major in every node selector term. Option B (a DRA claim):
    each request of the claim's template selects devices with a CEL expression on the
    NVIDIA DRA driver's cudaComputeCapability attribute, in the form COMPUTE_CEL reads.
    """
    errors: list[str] = []
    claim_requests: dict[str, list[dict[str, Any]]] = {}
    for r in resources:
        if r["kind"] == "ResourceClaimTemplate":
            claim_requests[r["metadata"]["name"]] = r["spec"]["spec"]["devices"]["requests"]
    for d in (r for r in resources if r["kind"] == "Deployment"):
        name = f"Deployment/{d['metadata']['name']}"
        spec = d["spec"]["template"]["spec"]
        engines = spec.get("containers", [])
        plugin_gpus = any(
            c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") for c in engines
        )
        if plugin_gpus:
            affinity = spec.get("affinity", {}).get("nodeAffinity", {})
            terms = affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get(
                "nodeSelectorTerms", []
            )
            selected = spec.get("nodeSelector", {}).get(COMPUTE_MAJOR_LABEL, "")
            if not (selected.isdigit() and int(selected) >= lowest) and not (
                terms and all(_excludes_older_gpus(t, lowest) for t in terms)
            ):
                errors.append(
                    f"{name}: the image has GPU code for compute capability {lowest}.0 and "
                    f"newer only, but the pod may land on an older GPU (where epsd serves the "
                    f"cpu backend alone): require node affinity {COMPUTE_MAJOR_LABEL} Gt "
                    f"{lowest - 1} in every nodeSelectorTerm"
                )
        for claim in spec.get("resourceClaims", []):
            template = claim.get("resourceClaimTemplateName")
            if template not in claim_requests:
                errors.append(
                    f"{name}: claim {claim['name']} names no ResourceClaimTemplate of the "
                    "kustomization, so its GPU's compute capability cannot be checked"
                )
                continue
            for request in claim_requests[template]:
                selectors = request.get("exactly", {}).get("selectors", [])
                floors = [
                    int(m.group(1))
                    for s in selectors
                    if (m := COMPUTE_CEL.search(s.get("cel", {}).get("expression", "")))
                ]
                if not floors or max(floors) < lowest:
                    errors.append(
                        f"ResourceClaimTemplate/{template}: request {request['name']} may get "
                        f"a GPU older than compute capability {lowest}.0, which the image has "
                        "no code for: select devices with device.attributes[\"gpu.nvidia.com\"]"
                        f'.cudaComputeCapability.compareTo(semver("{lowest}.0.0")) >= 0'
                    )
    return errors
