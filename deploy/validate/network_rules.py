"""The NetworkPolicy rule of validate_manifests: an ingress policy selects the pods, names
their ports, and admits every port the Services forward to them (docs/deploy-operations.md)."""

from __future__ import annotations

from typing import Any

from kustomize_render import Resource
from pod_templates import container_ports, matches, selects


def network_policy_errors(
    by_kind: dict[str, list[Resource]], pods: list[dict[str, Any]]
) -> list[str]:
    """An ingress NetworkPolicy selects the pods, names their ports, and admits every port
    the Services forward to them: any port it leaves out is refused once it applies."""
    errors: list[str] = []
    numbers: dict[int | str, int] = {}  # container port name or number -> number
    for _, port in container_ports(pods):
        numbers[port["containerPort"]] = port["containerPort"]
        if port.get("name"):
            numbers[port["name"]] = port["containerPort"]
    for policy in by_kind.get("NetworkPolicy", []):
        where = f"NetworkPolicy/{policy['metadata']['name']}"
        spec = policy["spec"]
        if "Ingress" not in spec.get("policyTypes", ["Ingress"]):
            continue
        labels = spec.get("podSelector", {}).get("matchLabels", {})
        selected = [p for p in pods if matches(labels, p["metadata"]["labels"])]
        if not selected:
            errors.append(f"{where}: podSelector matches no pod template")
        admitted: set[int] = set()
        admits_all = False
        for rule in spec.get("ingress", []):
            if not rule.get("ports"):
                admits_all = True
            for port in rule.get("ports", []):
                if port.get("port") not in numbers:
                    errors.append(f"{where}: port {port.get('port')} is no container's port")
                else:
                    admitted.add(numbers[port["port"]])
        for svc in by_kind.get("Service", []):
            chosen = svc["spec"].get("selector", {})
            if not any(selects(chosen, p["metadata"]["labels"]) for p in selected):
                continue
            for port in svc["spec"].get("ports", []):
                target = numbers.get(port.get("targetPort", port.get("port")))
                if target is not None and not admits_all and target not in admitted:
                    errors.append(
                        f"{where} admits no ingress to port {target}, which Service/"
                        f"{svc['metadata']['name']} forwards ({port.get('name')}): its "
                        "clients would be refused"
                    )
    return errors
