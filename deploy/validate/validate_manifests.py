"""Validates deploy/k8s offline: schemas of Kubernetes >= 1.29 and the pod's sidecar contract.

For the base and every overlay, the kustomization is rendered (kustomize_render) and
every resource is validated against the strict JSON schemas that kubernetes-validate
ships for the lowest Kubernetes version the overlay supports and for the newest one
it knows; the ServiceMonitor against servicemonitor.schema.json. Then every
Deployment's pod template is checked for what docs/deploy.md and docs/deploy-operations.md
promise: epsd as a native sidecar with kubelet gRPC startup and liveness probes on its
health port and no readiness probe (its readiness would be the pod's), the socket and
/dev/shm shared with the engine, hardened containers with resources, memory budgets
(--max-server-bytes) that fit epsd's memory limit, GPU sharing that hands both containers
the same device, and a GPU the image has code for (the Dockerfile's CUDA_ARCHITECTURES).
Exit status 1 lists every problem found.

Usage: validate_manifests.py [--k8s-dir deploy/k8s]
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import socket
import sys
from pathlib import Path
from typing import Any

import jsonschema
import referencing
from gpu_rules import gpu_architecture_errors, lowest_compute_major
from kubernetes_validate import utils as kv_utils
from kustomize_render import RenderError, Resource, render
from network_rules import network_policy_errors
from packaging.version import Version
from pod_templates import container_ports, selects

# The lowest Kubernetes release each kustomization targets (native sidecars: 1.29;
# resource.k8s.io/v1 for DRA: 1.34). A new overlay must be added here.
MIN_VERSIONS = {"base": "1.29", "cpu-demo": "1.29", "gpu": "1.29", "gpu-dra": "1.34"}
SIDECAR = "epsd"
SERVICE = "eps.v1.PageSelector"
HERE = Path(__file__).resolve().parent
MIB = 1 << 20
# epsd's defaults (service/flags.cc) of the flags the memory rule reads; a test compares
# them with the built epsd's --help.
EPSD_DEFAULTS = {"max-server-bytes": "2G", "max-session-bytes": "512M", "max-message-bytes": "64M"}
# What epsd's memory holds beyond --max-server-bytes: the process itself and a request
# being received, which is not charged to the budget: about 2.6 times the message's size
# at its peak, more when large Attaches repeat (measured with bench/attach_peak_rss.py;
# the numbers, command, machine and date are in docs/deploy-operations.md, "Memory budgets"). So
# 64 MiB plus three largest messages: room for one such message at a time.
PROCESS_BYTES = 64 * MIB
MESSAGE_FACTOR = 3



def flags_of(resources: list[Resource]) -> list[str]:
    """The epsd flags in the epsd-flags ConfigMap: one per line, '#' comments, no blanks."""
    maps = [
        r for r in resources if r["kind"] == "ConfigMap" and r["metadata"]["name"] == "epsd-flags"
    ]
    if len(maps) != 1:
        raise RenderError(f"want one ConfigMap epsd-flags, found {len(maps)}")
    text = maps[0].get("data", {}).get("epsd.flags", "")
    return parse_flags_file(text)


def parse_flags_file(text: str) -> list[str]:
    """Flags of an epsd flags file, as deploy/docker/epsd-entrypoint.sh reads it."""
    flags = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            flags.extend(line.split())
    return flags


def flag_value(flags: list[str], name: str) -> str | None:
    prefix = f"--{name}="
    values = [f[len(prefix) :] for f in flags if f.startswith(prefix)]
    return values[-1] if values else None


def epsd_size(text: str) -> int | None:
    """An epsd size flag's value (cli::Size: digits and k, K, M, G, T, powers of 1024)."""
    m = re.fullmatch(r"([0-9]+)([kKMGT]?)", text)
    if not m:
        return None
    shift = {"": 0, "k": 10, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2)]
    return int(m.group(1)) << shift


def k8s_quantity(text: str) -> int | None:
    """Bytes of a Kubernetes memory quantity (2Gi, 512Mi, 1G, 1e9, 1.5Gi); None if unread."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|[eE][0-9]+)?", text)
    if not m:
        return None
    suffix = m.group(2) or ""
    binary = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
    decimal = {"k": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}
    if suffix in binary:
        scale = 1024 ** binary[suffix]
    elif suffix in decimal:
        scale = 1000 ** decimal[suffix]
    else:
        scale = 10 ** int(suffix[1:]) if suffix else 1
    return int(float(m.group(1)) * scale)


def memory_errors(sidecar: dict[str, Any], flags: list[str]) -> list[str]:
    """epsd's memory budgets fit its container: past the limit it is OOM-killed instead of
    answering RESOURCE_EXHAUSTED (docs/deploy-operations.md, "Memory budgets")."""
    limit_text = str(sidecar.get("resources", {}).get("limits", {}).get("memory", ""))
    if not limit_text:
        return []  # the resources check reports it
    limit = k8s_quantity(limit_text)
    if limit is None:
        return [f"epsd's limits.memory {limit_text!r} is not a quantity this check reads"]
    sizes = {}
    for name, default in EPSD_DEFAULTS.items():
        text = flag_value(flags, name) or default
        sizes[name] = epsd_size(text)
        if sizes[name] is None:
            return [f"--{name}={text} is not an epsd size"]
    errors = []
    server, session = sizes["max-server-bytes"], sizes["max-session-bytes"]
    if session > server:
        errors.append(
            f"--max-session-bytes ({session // MIB} MiB) exceeds --max-server-bytes "
            f"({server // MIB} MiB)"
        )
    # A replacing Attach builds its session in the bytes the replaced one gives back, so
    # for that hand-over epsd holds up to one session more than --max-server-bytes.
    headroom = PROCESS_BYTES + MESSAGE_FACTOR * sizes["max-message-bytes"] + session
    if server + headroom > limit:
        errors.append(
            f"--max-server-bytes ({server // MIB} MiB) plus {headroom // MIB} MiB for the "
            f"process, one largest message (--max-message-bytes) and a restarting engine's "
            f"hand-over (--max-session-bytes) exceeds epsd's limits.memory {limit_text}: "
            "epsd would be OOM-killed before it answers RESOURCE_EXHAUSTED; set "
            "--max-server-bytes (and --max-session-bytes) lower"
        )
    return errors


@functools.cache
def k8s_validator(kind: str, api_version: str, version: str) -> jsonschema.Draft202012Validator:
    """The strict schema kubernetes-validate ships for kind in the newest release <= version.

    The lookup is kubernetes_validate.validate's, kept here so that each schema is loaded
    and compiled once per run rather than once per resource.
    """
    known = [
        v for v in kv_utils.all_versions() if Version(kv_utils.major_minor(v)) <= Version(version)
    ]
    if not known:
        raise kv_utils.VersionNotSupportedError(version)
    schema_dir = f"kubernetes-json-schema/v{known[-1]}-local-strict"
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = kv_utils.schema_contents(f"{schema_dir}/{kind.lower()}-{group}.json", version)
    except FileNotFoundError:
        raise kv_utils.SchemaNotFoundError(
            kind=kind, version=version, api_version=api_version
        ) from None
    definitions = kv_utils.schema_contents(f"{schema_dir}/_definitions.json", version)
    registry = referencing.Resource.from_contents(definitions) @ (
        referencing.Resource.from_contents(schema) @ referencing.Registry()
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


def schema_errors(resource: Resource, versions: list[str]) -> list[str]:
    where = f"{resource['kind']}/{resource.get('metadata', {}).get('name')}"
    if resource["kind"] == "ServiceMonitor":
        schema = json.loads((HERE / "servicemonitor.schema.json").read_text())
        validator = jsonschema.Draft202012Validator(schema)
        return [f"{where}: {e.json_path}: {e.message}" for e in validator.iter_errors(resource)]
    errors = []
    for version in versions:
        try:
            validator = k8s_validator(resource["kind"], resource["apiVersion"], version)
        except kv_utils.SchemaNotFoundError as e:
            errors.append(f"{where}: {e.message}")
            continue
        for e in validator.iter_errors(resource):
            path = ".".join(str(p) for p in e.absolute_path)
            errors.append(f"{where} (Kubernetes {version}): {path}: {e.message}")
    return errors


def _loopback(host: str) -> bool:
    """epsd's rule (service/config.cc): localhost, [::1], or an IPv4 address in 127/8 as
    inet_aton reads one (127.0.0.1, 127.1), never a host name that merely starts with
    "127." (it resolves to whatever DNS says)."""
    if host in ("localhost", "[::1]"):
        return True
    try:
        return socket.inet_aton(host)[0] == 127
    except OSError:
        return False


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def pod_errors(deployment: Resource, flags: list[str]) -> list[str]:
    """What the sidecar contract of docs/deploy.md and docs/deploy-operations.md needs of a
    Deployment's pod template."""
    name = f"Deployment/{deployment['metadata']['name']}"
    template = deployment["spec"]["template"]
    spec = template["spec"]
    errors: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            errors.append(f"{name}: {message}")

    sidecars = [c for c in spec.get("initContainers", []) if c["name"] == SIDECAR]
    need(len(sidecars) == 1, f"no init container named {SIDECAR}")
    if not sidecars:
        return errors
    sidecar = sidecars[0]
    engines = spec.get("containers", [])
    need(len(engines) == 1, f"want one engine container, found {len(engines)}")
    if not engines:
        return errors
    engine = engines[0]
    need(
        sidecar.get("restartPolicy") == "Always",
        "epsd must be a native sidecar (restartPolicy: Always)",
    )
    need(spec.get("shareProcessNamespace") is True, "CUDA IPC needs shareProcessNamespace: true")
    pod_nonroot = spec.get("securityContext", {}).get("runAsNonRoot") is True

    for c in spec.get("initContainers", []) + engines:
        sc = c.get("securityContext", {})
        cn = f"container {c['name']}"
        need(sc.get("readOnlyRootFilesystem") is True, f"{cn}: readOnlyRootFilesystem must be true")
        need(
            sc.get("allowPrivilegeEscalation") is False,
            f"{cn}: allowPrivilegeEscalation must be false",
        )
        need(
            "ALL" in sc.get("capabilities", {}).get("drop", []), f"{cn}: capabilities must drop ALL"
        )
        need(pod_nonroot or sc.get("runAsNonRoot") is True, f"{cn}: runAsNonRoot must be true")
        for kind in ("requests", "limits"):
            for res in ("cpu", "memory"):
                need(
                    res in c.get("resources", {}).get(kind, {}),
                    f"{cn}: resources.{kind}.{res} missing",
                )

    errors += [f"{name}: {e}" for e in memory_errors(sidecar, flags)]

    listen = flag_value(flags, "listen") or ""
    need(listen.startswith("unix:///"), f"--listen={listen!r} is not a unix:/// socket")
    socket_path = listen[len("unix://") :]
    socket_dir = socket_path.rsplit("/", 1)[0]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for c in (sidecar, engine):
        mounts = _mounts(c)
        need(
            socket_dir in mounts,
            f"container {c['name']} does not mount the socket dir {socket_dir}",
        )
        need("/dev/shm" in mounts, f"container {c['name']} does not mount /dev/shm")
    if socket_dir in _mounts(sidecar) and socket_dir in _mounts(engine):
        need(
            _mounts(sidecar)[socket_dir] == _mounts(engine)[socket_dir],
            "socket dirs are different volumes",
        )
        need(
            "emptyDir" in volumes.get(_mounts(sidecar)[socket_dir], {}),
            "socket volume is not an emptyDir",
        )
    if "/dev/shm" in _mounts(sidecar) and "/dev/shm" in _mounts(engine):
        shm = _mounts(sidecar)["/dev/shm"]
        need(_mounts(engine)["/dev/shm"] == shm, "the two /dev/shm mounts are different volumes")
        need(
            volumes.get(shm, {}).get("emptyDir", {}).get("medium") == "Memory",
            "/dev/shm is not a memory emptyDir",
        )
    need(_env(engine).get("EPS_TARGET") == listen, f"engine EPS_TARGET is not --listen ({listen})")

    # kubelet's gRPC probes dial the pod IP on --health-listen's port.
    health_listen = flag_value(flags, "health-listen") or ""
    health_host, _, health_port = health_listen.rpartition(":")
    need(
        health_port.isdigit() and not _loopback(health_host),
        f"--health-listen={health_listen!r} is not host:port on the pod IP: kubelet cannot "
        "probe it",
    )
    for probe in ("startupProbe", "livenessProbe"):
        grpc = sidecar.get(probe, {}).get("grpc", {})
        need(
            str(grpc.get("port")) == health_port and grpc.get("service") == SERVICE,
            f"epsd {probe} must be a grpc probe of service {SERVICE} on port {health_port} "
            f"(--health-listen={health_listen})",
        )
    # A native sidecar's readiness counts in the pod's Ready condition: a readiness probe on
    # epsd would take the engine out of the Service whenever epsd drains or restarts, while
    # the engine serves on, falling back to dense attention (docs/deploy-operations.md, section 1).
    need(
        "readinessProbe" not in sidecar,
        "epsd must have no readinessProbe: a native sidecar's readiness is part of the pod's, "
        "so the engine would leave the Service whenever epsd drains or restarts, though it "
        "keeps serving densely (fail open)",
    )
    for name_ in ("metrics-listen", "health-listen"):
        value = flag_value(flags, name_)
        if value and not _loopback(value.rpartition(":")[0]):
            need(
                "--allow-remote" in flags or flag_value(flags, "allow-remote") == "true",
                f"--{name_}={value} binds beyond loopback: epsd refuses it without --allow-remote",
            )

    otel = _env(sidecar)
    need(
        otel.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").startswith("http"),
        "epsd has no OTEL_EXPORTER_OTLP_ENDPOINT",
    )
    need("OTEL_SERVICE_NAME" in otel, "epsd has no OTEL_SERVICE_NAME")
    annotations = template.get("metadata", {}).get("annotations", {})
    ports = {p["containerPort"]: p.get("name") for p in sidecar.get("ports", [])}
    need(
        annotations.get("prometheus.io/scrape") == "true", "pod lacks prometheus.io/scrape: 'true'"
    )
    metrics_port = annotations.get("prometheus.io/port", "")
    need(
        metrics_port.isdigit() and int(metrics_port) in ports,
        f"prometheus.io/port={metrics_port!r} is not a port of epsd",
    )
    # Once the ConfigMap sets epsd's metrics listener, Prometheus must reach it on the pod IP.
    metrics_listen = flag_value(flags, "metrics-listen")
    if metrics_listen is not None:
        host, _, port = metrics_listen.rpartition(":")
        need(port == metrics_port, f"--metrics-listen={metrics_listen} is not prometheus.io/port")
        need(
            not _loopback(host),
            f"--metrics-listen={metrics_listen} binds loopback: Prometheus cannot scrape it",
        )

    # One GPU for both containers (docs/deploy.md, "One GPU for two containers").
    def gpus(c: dict[str, Any]) -> int:
        return int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))

    backend = flag_value(flags, "backend")
    claims = {
        n: {cl["name"] for cl in c.get("resources", {}).get("claims", [])}
        for n, c in (("epsd", sidecar), ("engine", engine))
    }
    need(gpus(sidecar) == 0, "epsd must not request nvidia.com/gpu: that would be a second GPU")
    if gpus(engine):
        need(
            _env(sidecar).get("NVIDIA_VISIBLE_DEVICES") == "all",
            "engine has a GPU but epsd has no NVIDIA_VISIBLE_DEVICES=all",
        )
        # The GPU Operator's CDI default (v25.10+) injects device-plugin GPUs through the
        # container runtime's own CDI support; only the NVIDIA runtime class still reads
        # NVIDIA_VISIBLE_DEVICES, so without it epsd silently sees no GPU.
        need(
            bool(spec.get("runtimeClassName")),
            "epsd takes the engine's GPU through NVIDIA_VISIBLE_DEVICES but the pod has no "
            "runtimeClassName: with CDI (the GPU Operator's default since v25.10) only the "
            "NVIDIA runtime class (runtimeClassName: nvidia) reads the variable, and epsd "
            "would see no GPU",
        )
        count = spec.get("nodeSelector", {}).get("nvidia.com/gpu.count")
        need(
            count == str(gpus(engine)),
            f"engine requests {gpus(engine)} GPU(s) but nodeSelector nvidia.com/gpu.count is "
            f"{count!r}: epsd sees every GPU of the node, so the pod must hold them all",
        )
    has_gpu = bool(gpus(engine)) or bool(claims["epsd"])
    if has_gpu:
        # A GPU newer than the image's code JIT-compiles its PTX at epsd's CUDA warm-up;
        # the driver caches the result under $HOME, which the read-only root and
        # HOME=/nonexistent leave unwritable, so every start would compile again.
        cache = _env(sidecar).get("CUDA_CACHE_PATH", "")
        mount = next(
            (m for m in sidecar.get("volumeMounts", [])
             if cache == m["mountPath"] or cache.startswith(m["mountPath"].rstrip("/") + "/")),
            None,
        )
        need(
            mount is not None
            and not mount.get("readOnly")
            and "emptyDir" in volumes.get(mount["name"], {}),
            f"epsd's CUDA_CACHE_PATH={cache!r} is not on a writable emptyDir it mounts: the "
            "driver could not keep its JIT cache (read-only root, HOME=/nonexistent)",
        )
    if claims["epsd"] or claims["engine"]:
        need(claims["epsd"] == claims["engine"], f"epsd and engine name different claims: {claims}")
        pod_claims = {c["name"] for c in spec.get("resourceClaims", [])}
        need(
            claims["epsd"] <= pod_claims, f"claims {claims['epsd']} are not in spec.resourceClaims"
        )
    need(backend != "cuda" or has_gpu, "--backend=cuda but no GPU is given to the pod")
    need(backend != "cpu" or not has_gpu, "--backend=cpu on a pod that holds a GPU")
    return errors


def wiring_errors(resources: list[Resource]) -> list[str]:
    """Service, ServiceMonitor and PodDisruptionBudget select the pods and ports that exist."""
    errors: list[str] = []
    by_kind: dict[str, list[Resource]] = {}
    for r in resources:
        by_kind.setdefault(r["kind"], []).append(r)
    pods = [d["spec"]["template"] for d in by_kind.get("Deployment", [])]

    # Port names of the regular containers and of the init containers (epsd, the native
    # sidecar), and every port number. Before Kubernetes 1.32 the endpoints controllers
    # resolve a named targetPort in spec.containers only (kubernetes/kubernetes#127958).
    names: dict[str, set[str]] = {"containers": set(), "initContainers": set()}
    numbers: set[int] = set()
    for field, port in container_ports(pods):
        if port.get("name"):
            names[field].add(port["name"])
        numbers.add(port["containerPort"])
    for svc in by_kind.get("Service", []):
        where = f"Service/{svc['metadata']['name']}"
        if not any(selects(svc["spec"].get("selector", {}), p["metadata"]["labels"]) for p in pods):
            errors.append(f"{where}: selector matches no pod template")
        for p in svc["spec"].get("ports", []):
            target = p.get("targetPort", p.get("port"))
            if isinstance(target, str) and target in names["containers"]:
                continue
            if isinstance(target, str) and target in names["initContainers"]:
                errors.append(
                    f"{where}: targetPort {target} is a port of an init container only: before "
                    "Kubernetes 1.32 no endpoint gets it (kubernetes/kubernetes#127958); use "
                    "its number"
                )
            elif isinstance(target, str):
                errors.append(f"{where}: targetPort {target} is no container port")
            elif target not in numbers:
                errors.append(f"{where}: targetPort {target} is no container's port")
    errors += network_policy_errors(by_kind, pods)
    for pdb in by_kind.get("PodDisruptionBudget", []):
        sel = pdb["spec"].get("selector", {}).get("matchLabels", {})
        if not any(selects(sel, p["metadata"]["labels"]) for p in pods):
            errors.append(
                f"PodDisruptionBudget/{pdb['metadata']['name']}: selector matches no pod template"
            )
    for sm in by_kind.get("ServiceMonitor", []):
        sel = sm["spec"]["selector"].get("matchLabels", {})
        services = [
            s for s in by_kind.get("Service", []) if selects(sel, s["metadata"].get("labels", {}))
        ]
        if not services:
            errors.append(f"ServiceMonitor/{sm['metadata']['name']}: selector matches no Service")
        names = {p.get("name") for s in services for p in s["spec"].get("ports", [])}
        for ep in sm["spec"]["endpoints"]:
            if ep.get("port") not in names:
                errors.append(
                    f"ServiceMonitor/{sm['metadata']['name']}: "
                    f"port {ep.get('port')} is not a Service port"
                )
    return errors


def kustomization_dirs(k8s_dir: Path) -> dict[str, Path]:
    dirs = {"base": k8s_dir / "base"}
    for overlay in sorted((k8s_dir / "overlays").iterdir()):
        if overlay.is_dir():
            dirs[overlay.name] = overlay
    return dirs


def component_dirs(k8s_dir: Path) -> dict[str, Path]:
    """The opt-in kustomize Components under k8s_dir/components, by name."""
    root = k8s_dir / "components"
    if not root.is_dir():
        return {}
    return {c.name: c for c in sorted(root.iterdir()) if c.is_dir()}


def validate(k8s_dir: Path, only: set[str] | None = None) -> list[str]:
    """Problems of every kustomization under k8s_dir (or of those named in only).

    Each opt-in component is checked added to each kustomization, as NAME+COMPONENT.
    """
    latest = kv_utils.latest_version()
    problems: list[str] = []
    try:
        lowest_major = lowest_compute_major(k8s_dir.parent / "docker" / "Dockerfile")
    except (RenderError, OSError) as e:
        return [f"Dockerfile: {e}"]
    components = component_dirs(k8s_dir)
    for name, directory in kustomization_dirs(k8s_dir).items():
        variants = {name: ()} | {f"{name}+{c}": (d,) for c, d in components.items()}
        for variant, extra in variants.items():
            if only is not None and variant not in only:
                continue
            if name not in MIN_VERSIONS:
                problems.append(f"{variant}: add its lowest Kubernetes version to MIN_VERSIONS")
                continue
            versions = [MIN_VERSIONS[name], latest]
            try:
                resources = render(directory, extra)
                flags = flags_of(resources)
            except (RenderError, OSError) as e:
                problems.append(f"{variant}: {e}")
                continue
            found = []
            for r in resources:
                found += schema_errors(r, versions)
                if r["kind"] == "Deployment":
                    found += pod_errors(r, flags)
            found += gpu_architecture_errors(resources, lowest_major)
            found += wiring_errors(resources)
            problems += [f"{variant}: {p}" for p in found]
            print(
                f"{variant}: {len(resources)} resources, Kubernetes {' and '.join(versions)}: "
                f"{'ok' if not found else f'{len(found)} problem(s)'}"
            )
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k8s-dir", type=Path, default=HERE.parent / "k8s")
    args = parser.parse_args()
    problems = validate(args.k8s_dir)
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
