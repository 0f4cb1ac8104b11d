"""What the wiring rules read of the rendered pod templates: which of them a label selector
selects, and the ports their containers declare (validate_manifests.wiring_errors and
network_rules.network_policy_errors share these, so both read a selector and a port alike)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Every label of the selector is on `labels`: an empty selector matches everything, as
    a NetworkPolicy's empty podSelector selects every pod."""
    return all(labels.get(k) == v for k, v in selector.items())


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """A Service's, PodDisruptionBudget's or ServiceMonitor's selector selects `labels`: an
    empty one selects nothing (a Service without a selector gets no endpoints from it)."""
    return bool(selector) and matches(selector, labels)


def container_ports(pods: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(field, port) for every port of every container of the pod templates: field is
    "initContainers" (epsd, the native sidecar) or "containers"."""
    for pod in pods:
        for field in ("initContainers", "containers"):
            for c in pod["spec"].get(field, []):
                for port in c.get("ports", []):
                    yield field, port
