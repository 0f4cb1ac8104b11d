"""The deploy/ checks fail on broken manifests, flags and Dockerfiles, and pass on the real ones.

Each test copies deploy/ into a temporary directory, breaks one thing and runs the
check on the copy. EPSD (set by ctest) is the built epsd, for the flag check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import check_epsd_flags
import lint_dockerfile
import pytest
import validate_manifests

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def deploy(tmp_path: Path) -> Path:
    copy = tmp_path / "deploy"
    shutil.copytree(REPO / "deploy", copy)
    return copy


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def epsd() -> str:
    path = os.environ.get("EPSD")
    assert path, "set EPSD to the built epsd (ctest does)"
    return path


def test_the_committed_manifests_pass(deploy: Path) -> None:
    assert validate_manifests.validate(deploy / "k8s") == []


def test_an_unknown_field_fails_the_schema_check(deploy: Path) -> None:
    edit(
        deploy / "k8s/base/deployment.yaml",
        "      shareProcessNamespace: true\n",
        "      shareProcessNamespace: true\n      shareProcessNamespaces: true\n",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("shareProcessNamespaces" in p and "Kubernetes 1.29" in p for p in problems), problems


def test_a_wrong_type_fails_the_schema_check(deploy: Path) -> None:
    edit(deploy / "k8s/base/deployment.yaml", "  replicas: 2\n", "  replicas: two\n")
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("replicas" in p for p in problems), problems


def test_epsd_as_a_plain_init_container_fails(deploy: Path) -> None:
    edit(deploy / "k8s/base/deployment.yaml", "          restartPolicy: Always\n", "")
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("native sidecar" in p for p in problems), problems


def test_a_writable_root_filesystem_fails(deploy: Path) -> None:
    edit(
        deploy / "k8s/base/deployment.yaml",
        "readOnlyRootFilesystem: true",
        "readOnlyRootFilesystem: false",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("container epsd: readOnlyRootFilesystem" in p for p in problems), problems


def test_a_probe_on_another_port_than_health_listen_fails(deploy: Path) -> None:
    edit(
        deploy / "k8s/overlays/gpu/configmap-patch.yaml",
        "--health-listen=[::]:9465",
        "--health-listen=[::]:9466",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"gpu"})
    assert any(p.startswith("gpu:") and "startupProbe must be a grpc probe" in p for p in problems), (
        problems
    )


def test_an_exec_probe_fails(deploy: Path) -> None:
    edit(
        deploy / "k8s/base/deployment.yaml",
        "          livenessProbe:\n            grpc:\n              port: 9465\n"
        "              service: eps.v1.PageSelector\n",
        "          livenessProbe:\n            exec:\n              command:\n"
        "                - /usr/local/bin/eps-health-probe\n",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("livenessProbe must be a grpc probe" in p for p in problems), problems


def test_a_readiness_probe_on_epsd_fails(deploy: Path) -> None:
    # A native sidecar's readiness is part of the pod's Ready condition: with one, the
    # engine left the Service whenever epsd drained or restarted, though it served densely.
    edit(
        deploy / "k8s/base/deployment.yaml",
        "          livenessProbe:\n            grpc:\n              port: 9465\n",
        "          readinessProbe:\n            grpc:\n              port: 9465\n"
        "              service: eps.v1.PageSelector\n"
        "          livenessProbe:\n            grpc:\n              port: 9465\n",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("epsd must have no readinessProbe" in p for p in problems), problems


def test_a_loopback_health_listen_fails(deploy: Path) -> None:
    edit(
        deploy / "k8s/base/configmap-epsd-flags.yaml",
        "--health-listen=[::]:9465",
        "--health-listen=127.0.0.1:9465",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("kubelet cannot probe it" in p for p in problems), problems


def test_a_remote_listener_without_allow_remote_fails(deploy: Path) -> None:
    edit(deploy / "k8s/overlays/cpu-demo/configmap-patch.yaml", "    --allow-remote\n", "")
    problems = validate_manifests.validate(deploy / "k8s", {"cpu-demo"})
    assert any(p.startswith("cpu-demo:") and "without --allow-remote" in p for p in problems), (
        problems
    )


def test_a_gpu_engine_without_a_gpu_for_epsd_fails(deploy: Path) -> None:
    edit(
        deploy / "k8s/overlays/gpu/deployment-patch.yaml",
        "              value: all\n",
        "              value: void\n",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"gpu"})
    assert any(p.startswith("gpu:") and "NVIDIA_VISIBLE_DEVICES=all" in p for p in problems), (
        problems
    )


def test_visible_devices_without_a_runtime_class_fails(deploy: Path) -> None:
    # With CDI (the GPU Operator's default since v25.10) only the NVIDIA runtime class reads
    # NVIDIA_VISIBLE_DEVICES: without it epsd saw no GPU and served the cpu backend alone.
    edit(deploy / "k8s/overlays/gpu/deployment-patch.yaml", "      runtimeClassName: nvidia\n", "")
    problems = validate_manifests.validate(deploy / "k8s", {"gpu"})
    assert any(p.startswith("gpu:") and "no runtimeClassName" in p for p in problems), problems


def test_a_device_plugin_gpu_without_a_compute_capability_floor_fails(deploy: Path) -> None:
    # The image holds sm_90 code and compute_90 PTX: on an older GPU epsd's CUDA warm-up
    # fails and it serves the cpu backend alone.
    edit(
        deploy / "k8s/overlays/gpu/deployment-patch.yaml",
        "                    values: [\"8\"]\n",
        "                    values: [\"7\"]\n",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"gpu"})
    assert any(
        p.startswith("gpu:") and "nvidia.com/gpu.compute.major Gt 8" in p for p in problems
    ), problems


def test_the_compute_capability_floor_follows_the_dockerfiles_architectures(
    deploy: Path,
) -> None:
    edit(
        deploy / "docker/Dockerfile",
        "ARG CUDA_ARCHITECTURES=90\n",
        "ARG CUDA_ARCHITECTURES=80;90\n",
    )
    edit(
        deploy / "k8s/overlays/gpu/deployment-patch.yaml",
        "                    values: [\"8\"]\n",
        "                    values: [\"7\"]\n",
    )
    assert validate_manifests.validate(deploy / "k8s", {"gpu"}) == []


def test_a_dra_claim_without_a_compute_capability_selector_fails(deploy: Path) -> None:
    edit(
        deploy / "k8s/overlays/gpu-dra/resourceclaimtemplate.yaml",
        'compareTo(semver("9.0.0"))',
        'compareTo(semver("8.0.0"))',
    )
    problems = validate_manifests.validate(deploy / "k8s", {"gpu-dra"})
    assert any(
        p.startswith("gpu-dra:") and "request gpu may get a GPU older than compute capability 9.0"
        in p
        for p in problems
    ), problems


@pytest.mark.parametrize(
    "architectures, major", [("90", 9), ("90-real;100", 9), ('"80;90"', 8), ("120a", 12)]
)
def test_the_lowest_compute_major_is_read_from_cmakes_architecture_list(
    tmp_path: Path, architectures: str, major: int
) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM x AS build\nARG CUDA_ARCHITECTURES={architectures}\n")
    assert validate_manifests.lowest_compute_major(dockerfile) == major


@pytest.mark.parametrize("overlay", ["gpu", "gpu-dra"])
def test_a_gpu_pod_without_a_writable_cuda_cache_fails(deploy: Path, overlay: str) -> None:
    # A GPU newer than the image's sm_90 code JIT-compiles its PTX at every epsd start
    # when the driver cannot keep its cache (read-only root, HOME=/nonexistent).
    edit(
        deploy / "k8s/base/deployment.yaml",
        "            - name: cuda-cache\n              mountPath: /var/cache/cuda\n",
        "",
    )
    problems = validate_manifests.validate(deploy / "k8s", {overlay})
    assert any(
        p.startswith(f"{overlay}:") and "CUDA_CACHE_PATH='/var/cache/cuda' is not on a writable"
        in p
        for p in problems
    ), problems


def test_claims_that_differ_between_the_containers_fail(deploy: Path) -> None:
    edit(
        deploy / "k8s/overlays/gpu-dra/deployment-patch.yaml",
        "            claims:\n              - name: gpu\n",
        "            claims:\n              - name: other\n",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"gpu-dra"})
    assert any(p.startswith("gpu-dra:") and "different claims" in p for p in problems), problems


def test_a_servicemonitor_on_a_missing_port_fails(deploy: Path) -> None:
    edit(
        deploy / "k8s/base/servicemonitor.yaml",
        "    - port: eps-metrics\n",
        "    - port: metrics\n",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("port metrics is not a Service port" in p for p in problems), problems


def test_a_named_target_port_of_the_sidecar_alone_fails(deploy: Path) -> None:
    # Before Kubernetes 1.32 the endpoints controllers resolve names in spec.containers
    # only: Prometheus got no target for the eps-metrics port of the epsd init container.
    edit(deploy / "k8s/base/service.yaml", "      targetPort: 9464\n", "      targetPort: eps-metrics\n")
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any(
        "targetPort eps-metrics is a port of an init container only" in p for p in problems
    ), problems


def test_a_target_port_number_no_container_declares_fails(deploy: Path) -> None:
    edit(deploy / "k8s/base/service.yaml", "      targetPort: 9464\n", "      targetPort: 9446\n")
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("targetPort 9446 is no container's port" in p for p in problems), problems


def test_a_network_policy_that_drops_a_service_port_fails(deploy: Path) -> None:
    # Without the engine's rule the policy would refuse every client of the Service's
    # http port once applied.
    edit(
        deploy / "k8s/components/networkpolicy/networkpolicy.yaml",
        "    - ports:\n        - port: 8000\n          protocol: TCP\n",
        "",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"gpu+networkpolicy"})
    assert any(
        p.startswith("gpu+networkpolicy:") and "admits no ingress to port 8000" in p
        for p in problems
    ), problems


def test_an_empty_pod_selector_applies_the_network_policy_to_every_pod(deploy: Path) -> None:
    # A NetworkPolicy's empty podSelector selects every pod of its namespace, where a
    # Service's empty selector selects none: the dropped port is still found, and no
    # "matches no pod template".
    policy = deploy / "k8s/components/networkpolicy/networkpolicy.yaml"
    edit(policy, "  podSelector:\n    matchLabels:\n      app.kubernetes.io/name: vllm-eps\n",
         "  podSelector: {}\n")
    assert validate_manifests.validate(deploy / "k8s", {"gpu+networkpolicy"}) == []
    edit(policy, "    - ports:\n        - port: 8000\n          protocol: TCP\n", "")
    problems = validate_manifests.validate(deploy / "k8s", {"gpu+networkpolicy"})
    assert any("admits no ingress to port 8000" in p for p in problems), problems
    assert not any("matches no pod template" in p for p in problems), problems


def test_a_network_policy_port_no_container_has_fails(deploy: Path) -> None:
    edit(deploy / "k8s/components/networkpolicy/networkpolicy.yaml", "port: 9464", "port: 9446")
    problems = validate_manifests.validate(deploy / "k8s", {"base+networkpolicy"})
    assert any("port 9446 is no container's port" in p for p in problems), problems
    assert any("admits no ingress to port 9464" in p for p in problems), problems


def test_a_servicemonitor_typo_fails_its_schema(deploy: Path) -> None:
    edit(deploy / "k8s/base/servicemonitor.yaml", "      interval: 15s\n", "      intervall: 15s\n")
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("intervall" in p for p in problems), problems


@pytest.mark.parametrize(
    "listen, message",
    [("127.0.0.1:9464", "binds loopback"), ("0.0.0.0:9000", "is not prometheus.io/port")],
)
def test_a_metrics_listener_prometheus_cannot_scrape_fails(
    deploy: Path, listen: str, message: str
) -> None:
    edit(
        deploy / "k8s/base/configmap-epsd-flags.yaml",
        "    --backend=auto\n",
        f"    --backend=auto\n    --metrics-listen={listen}\n",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any(message in p for p in problems), problems


def test_the_default_server_budget_past_epsds_memory_limit_fails(deploy: Path) -> None:
    # The audit's case: no budget flag, so epsd's 2G default against a 512Mi limit; two
    # Attaches of about 1 kB (inline queries at offset 400 MiB) took epsd past 800 MB.
    edit(deploy / "k8s/overlays/cpu-demo/configmap-patch.yaml", "    --max-server-bytes=256M\n", "")
    problems = validate_manifests.validate(deploy / "k8s", {"cpu-demo"})
    assert any(
        p.startswith("cpu-demo:")
        and "--max-server-bytes (2048 MiB)" in p
        and "limits.memory 512Mi" in p
        for p in problems
    ), problems


def test_a_memory_limit_below_the_server_budget_fails(deploy: Path) -> None:
    edit(deploy / "k8s/base/deployment.yaml", "              memory: 2Gi\n", "              memory: 1Gi\n")
    edit(deploy / "k8s/base/deployment.yaml", "              memory: 2Gi\n", "              memory: 1Gi\n")
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("--max-server-bytes (1024 MiB)" in p and "OOM-killed" in p for p in problems), (
        problems
    )


def test_the_restart_hand_over_needs_a_session_of_room_beside_the_budget(deploy: Path) -> None:
    # A replacing Attach may hold one more session's bytes than --max-server-bytes: with
    # 1536M (the earlier ConfigMaps) and 512M a session, the base's 2Gi is too small.
    edit(deploy / "k8s/base/configmap-epsd-flags.yaml", "--max-server-bytes=1024M",
         "--max-server-bytes=1536M")
    problems = validate_manifests.validate(deploy / "k8s", {"base"})
    assert any("--max-server-bytes (1536 MiB)" in p and "hand-over" in p for p in problems), (
        problems
    )


def test_larger_messages_need_more_room_beside_the_budget(deploy: Path) -> None:
    edit(
        deploy / "k8s/overlays/cpu-demo/configmap-patch.yaml",
        "--max-message-bytes=16M",
        "--max-message-bytes=128M",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"cpu-demo"})
    assert any("plus 576 MiB for the process, one largest message" in p for p in problems), (
        problems
    )


def test_a_session_budget_above_the_server_budget_fails(deploy: Path) -> None:
    edit(
        deploy / "k8s/overlays/gpu/configmap-patch.yaml",
        "--max-session-bytes=512M",
        "--max-session-bytes=2G",
    )
    problems = validate_manifests.validate(deploy / "k8s", {"gpu"})
    assert any(
        p.startswith("gpu:") and "--max-session-bytes (2048 MiB) exceeds --max-server-bytes" in p
        for p in problems
    ), problems


@pytest.mark.parametrize(
    "text, size",
    [
        ("2Gi", 2 << 30),
        ("512Mi", 512 << 20),
        ("1G", 10**9),
        ("1e9", 10**9),
        ("1.5Gi", 3 << 29),
        ("1048576", 1 << 20),
        ("2 Gi", None),
        ("Gi", None),
    ],
)
def test_memory_quantities_are_read_as_kubernetes_reads_them(text: str, size: int | None) -> None:
    assert validate_manifests.k8s_quantity(text) == size


def test_the_memory_rule_knows_epsds_defaults() -> None:
    done = subprocess.run([epsd(), "--help"], capture_output=True, text=True, timeout=30, check=True)
    for name, default in validate_manifests.EPSD_DEFAULTS.items():
        assert f"  --{name}={default}\n" in done.stdout, name


def test_an_overlay_without_a_minimum_version_fails(deploy: Path) -> None:
    shutil.copytree(deploy / "k8s/overlays/gpu", deploy / "k8s/overlays/gpu-new")
    problems = validate_manifests.validate(deploy / "k8s", {"gpu-new"})
    assert any(p.startswith("gpu-new:") and "MIN_VERSIONS" in p for p in problems), problems


def test_the_flags_file_parser_reads_crlf_line_ends_as_the_entrypoint_does() -> None:
    text = "# comment\r\n--backend=cpu\r\n--socket-mode=0660 # mode\r\n\r\n--eps-dim=8"
    assert validate_manifests.parse_flags_file(text) == [
        "--backend=cpu",
        "--socket-mode=0660",
        "--eps-dim=8",
    ]


def test_the_committed_flags_are_accepted_by_epsd(deploy: Path) -> None:
    assert check_epsd_flags.check(epsd(), deploy / "k8s") == []


def test_an_unknown_flag_fails_the_flag_check(deploy: Path) -> None:
    edit(
        deploy / "k8s/base/configmap-epsd-flags.yaml",
        "    --eps-dim=8\n",
        "    --eps-dimension=8\n",
    )
    problems = check_epsd_flags.check(epsd(), deploy / "k8s")
    assert any(
        p.startswith("base:") and "'--eps-dimension=8' is not an epsd flag" in p for p in problems
    ), problems
    assert any(p.startswith("base:") and "unknown flag --eps-dimension" in p for p in problems), (
        problems
    )


def test_a_bad_flag_value_fails_the_flag_check(deploy: Path) -> None:
    edit(deploy / "k8s/overlays/cpu-demo/configmap-patch.yaml", "--backend=cpu", "--backend=tpu")
    problems = check_epsd_flags.check(epsd(), deploy / "k8s")
    assert any(p.startswith("cpu-demo:") and "--backend=tpu" in p for p in problems), problems


def test_a_value_with_a_space_fails_the_flag_check(deploy: Path) -> None:
    edit(
        deploy / "k8s/base/configmap-epsd-flags.yaml",
        "    --eps-method=questclt\n",
        "    --eps-method=questclt jl\n",
    )
    problems = check_epsd_flags.check(epsd(), deploy / "k8s")
    assert any(p.startswith("base:") and "unexpected argument 'jl'" in p for p in problems), (
        problems
    )


def test_the_committed_dockerfile_passes(deploy: Path) -> None:
    assert lint_dockerfile.own_rule_findings(deploy / "docker/Dockerfile", REPO) == []


def test_the_committed_dockerfile_has_its_packages_and_configures_from_its_copies(
    deploy: Path,
) -> None:
    assert lint_dockerfile.package_findings(deploy / "docker/Dockerfile", REPO) == []
    assert lint_dockerfile.configure_findings(deploy / "docker/Dockerfile", REPO) == []


@pytest.mark.parametrize(("file", "old", "new", "rules", "says"), [
    ("Dockerfile", "COPY core core\n", "COPY kernel kernel\n", "own_rule_findings",
     "COPY source kernel does not exist"),
    ("Dockerfile", "USER 10001:10001\n", "USER root\n", "own_rule_findings", "non-root USER"),
    ("Dockerfile", "FROM nvidia/cuda:${CUDA_VERSION}-${CUDA_RUNTIME_FLAVOR}",
     "FROM nvidia/cuda:12.8.0-${CUDA_RUNTIME_FLAVOR}", "own_rule_findings",
     "does not use ${CUDA_VERSION}"),
    # The image once lacked nlohmann-json3-dev, which service/telemetry needs, and cli/,
    # which every binary's flags need: docker build failed.
    ("Dockerfile", " nlohmann-json3-dev", "", "package_findings",
     "does not apt-get install nlohmann-json3-dev"),
    ("Dockerfile", "COPY cli cli\n", "", "configure_findings",
     '"cli" which is not an existing directory'),
    ("Dockerfile.dockerignore", "!cli/**\n", "", "package_findings",
     "COPY source cli is left out of the context"),
], ids=["missing-copy-source", "root-user", "cuda-version", "apt-package", "uncopied-folder",
        "dockerignore"])
def test_a_dockerfile_breaking_a_rule_fails(deploy: Path, file: str, old: str, new: str,
                                            rules: str, says: str) -> None:
    edit(deploy / "docker" / file, old, new)
    findings = getattr(lint_dockerfile, rules)(deploy / "docker/Dockerfile", REPO)
    assert any(says in f for f in findings), findings


def test_hadolint_findings_fail_the_lint(
    deploy: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    edit(deploy / "docker/Dockerfile", "WORKDIR /src\n", "RUN cd /src\n")
    monkeypatch.setattr(
        "sys.argv",
        [
            "lint_dockerfile.py",
            "--dockerfile",
            str(deploy / "docker/Dockerfile"),
            "--repo-root",
            str(REPO),
        ],
    )
    assert lint_dockerfile.main() == 1
    assert "DL3003" in capsys.readouterr().err


def test_loopback_is_an_address_in_127_8_not_a_name_that_starts_so() -> None:
    """As epsd's own check (service/config.cc): "127.example.com" resolves to whatever DNS
    says, and the validator took it for loopback as text."""
    assert validate_manifests._loopback("127.0.0.1")
    assert validate_manifests._loopback("127.1")
    assert validate_manifests._loopback("localhost") and validate_manifests._loopback("[::1]")
    assert not validate_manifests._loopback("127.example.com")
    assert not validate_manifests._loopback("128.0.0.1")
    assert not validate_manifests._loopback("0.0.0.0")
