"""Tests of deploy/validate/kustomize_render.py, the kustomize subset CI renders with."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from kustomize_render import RenderError, render, strategic_merge

REPO = Path(__file__).resolve().parents[2]

DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata:
  name: app
spec:
  template:
    spec:
      initContainers:
        - name: side
          image: side
          restartPolicy: Always
      containers:
        - name: main
          image: example/main:1.0
          args: ["--a", "--b"]
          env:
            - name: KEEP
              value: "1"
            - name: DROP
              value: "2"
          readinessProbe:
            httpGet:
              path: /health
              port: 8000
      volumes:
        - name: shm
          emptyDir:
            medium: Memory
"""


def write(directory: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return directory


def kustomization(body: str) -> str:
    return "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n" + textwrap.dedent(
        body
    )


def overlay(tmp_path: Path, body: str, extra: dict[str, str] | None = None) -> Path:
    write(
        tmp_path,
        {
            "base/kustomization.yaml": kustomization("resources:\n  - deployment.yaml\n"),
            "base/deployment.yaml": DEPLOYMENT,
            "overlay/kustomization.yaml": kustomization(body),
            **(extra or {}),
        },
    )
    return tmp_path / "overlay"


def containers(resources: list[dict]) -> dict[str, dict]:
    spec = resources[0]["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["initContainers"] + spec["containers"]}


def test_patch_merges_named_list_elements_and_appends_new_ones(tmp_path: Path) -> None:
    out = render(
        overlay(
            tmp_path,
            "resources: [../base]\npatches:\n  - path: p.yaml\n",
            {
                "overlay/p.yaml": """
        apiVersion: apps/v1
        kind: Deployment
        metadata: {name: app}
        spec:
          template:
            spec:
              containers:
                - name: main
                  env:
                    - name: KEEP
                      value: "changed"
                    - name: NEW
                      value: "3"
    """
            },
        )
    )
    env = containers(out)["main"]["env"]
    assert env == [
        {"name": "KEEP", "value": "changed"},
        {"name": "DROP", "value": "2"},
        {"name": "NEW", "value": "3"},
    ]
    assert containers(out)["side"]["restartPolicy"] == "Always"


def test_patch_null_removes_a_field_and_dollar_patch_delete_removes_an_element(
    tmp_path: Path,
) -> None:
    out = render(
        overlay(
            tmp_path,
            "resources: [../base]\npatches:\n  - path: p.yaml\n",
            {
                "overlay/p.yaml": """
        apiVersion: apps/v1
        kind: Deployment
        metadata: {name: app}
        spec:
          template:
            spec:
              containers:
                - name: main
                  readinessProbe: null
                  env:
                    - name: DROP
                      $patch: delete
    """
            },
        )
    )
    main = containers(out)["main"]
    assert "readinessProbe" not in main
    assert [e["name"] for e in main["env"]] == ["KEEP"]


def test_patch_replaces_lists_without_a_merge_key(tmp_path: Path) -> None:
    out = render(
        overlay(
            tmp_path,
            "resources: [../base]\npatches:\n  - path: p.yaml\n",
            {
                "overlay/p.yaml": """
        apiVersion: apps/v1
        kind: Deployment
        metadata: {name: app}
        spec:
          template:
            spec:
              containers:
                - name: main
                  args: ["--c"]
    """
            },
        )
    )
    assert containers(out)["main"]["args"] == ["--c"]


def test_images_rename_and_retag_containers_and_init_containers(tmp_path: Path) -> None:
    out = render(
        overlay(
            tmp_path,
            """
        resources: [../base]
        images:
          - name: side
            newName: registry.example.com/side
            newTag: "2.0"
          - name: example/main
            digest: sha256:abc
    """,
        )
    )
    assert containers(out)["side"]["image"] == "registry.example.com/side:2.0"
    assert containers(out)["main"]["image"] == "example/main@sha256:abc"


def test_merge_does_not_modify_its_arguments() -> None:
    base = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}]}]}
    patch = {"containers": [{"name": "a", "env": [{"name": "X", "value": "2"}]}]}
    strategic_merge(base, patch)
    assert base["containers"][0]["env"][0]["value"] == "1"


@pytest.mark.parametrize(
    "body, extra, message",
    [
        ("resources: [../base]\nnamespace: prod\n", {}, "unsupported keys ['namespace']"),
        ("resources: [missing.yaml]\n", {}, "resource missing.yaml does not exist"),
        (
            "resources: [../base]\npatches:\n  - path: nope.yaml\n",
            {},
            "patch nope.yaml does not exist",
        ),
        (
            "resources: [../base]\npatches:\n  - path: p.yaml\n    target: {kind: Deployment}\n",
            {"overlay/p.yaml": "kind: Deployment\nmetadata: {name: app}\n"},
            "must have only 'path'",
        ),
        (
            "resources: [../base]\npatches:\n  - path: p.yaml\n",
            {"overlay/p.yaml": "kind: Deployment\nmetadata: {name: other}\n"},
            "is not a resource",
        ),
        (
            "resources: [../base]\npatches:\n  - path: ../base/deployment.yaml\n",
            {},
            "outside the kustomization root",
        ),
        (
            "resources: [../base]\nimages:\n  - name: nothing-uses-this\n    newTag: x\n",
            {},
            "matches no container",
        ),
        ("resources: [../base, ../base/deployment.yaml]\n", {}, "outside the kustomization root"),
        (
            "resources: [../base]\npatches:\n  - path: p.yaml\n",
            {
                "overlay/p.yaml": "kind: Deployment\nmetadata: {name: app}\n"
                "spec:\n  template:\n    spec:\n      containers:\n"
                "        - name: ghost\n          $patch: delete\n"
            },
            "no element name='ghost'",
        ),
    ],
)
def test_unsupported_or_broken_kustomizations_are_errors(
    tmp_path: Path, body: str, extra: dict[str, str], message: str
) -> None:
    with pytest.raises(RenderError, match=message.replace("[", r"\[").replace("]", r"\]")):
        render(overlay(tmp_path, body, extra))


COMPONENT = "apiVersion: kustomize.config.k8s.io/v1alpha1\nkind: Component\n"


def test_a_component_adds_its_resources_and_patches_before_the_overlays_patches(
    tmp_path: Path,
) -> None:
    root = overlay(
        tmp_path,
        "resources: [../base]\ncomponents: [../extra]\npatches:\n  - path: p.yaml\n",
        {
            "extra/kustomization.yaml": COMPONENT
            + "resources: [policy.yaml]\npatches:\n  - path: p.yaml\n",
            "extra/policy.yaml": "kind: ConfigMap\nmetadata: {name: policy}\n",
            "extra/p.yaml": "kind: Deployment\nmetadata: {name: app}\nspec: {replicas: 3}\n",
            "overlay/p.yaml": "kind: Deployment\nmetadata: {name: app}\nspec: {replicas: 5}\n",
        },
    )
    out = render(root)
    assert [r["metadata"]["name"] for r in out] == ["app", "policy"]
    assert out[0]["spec"]["replicas"] == 5  # the overlay's patch comes after the component's
    # The same component given by the caller, as the validator adds an opt-in one.
    write(tmp_path, {"overlay/kustomization.yaml": kustomization("resources: [../base]\n")})
    out = render(root, (tmp_path / "extra",))
    assert out[0]["spec"]["replicas"] == 3


@pytest.mark.parametrize(
    "component, message",
    [
        ("kind: Component\n", "a Component is kustomize.config.k8s.io/v1alpha1"),
        (
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n",
            "kind is 'Kustomization', want Component",
        ),
        (COMPONENT + "images: []\n", "unsupported keys ['images']"),
        (COMPONENT + "resources: [../base]\n", "is a directory: a Component lists files"),
    ],
)
def test_a_broken_component_is_an_error(tmp_path: Path, component: str, message: str) -> None:
    root = overlay(
        tmp_path,
        "resources: [../base]\ncomponents: [../extra]\n",
        {"extra/kustomization.yaml": component},
    )
    with pytest.raises(RenderError, match=message.replace("[", r"\[").replace("]", r"\]")):
        render(root)


def test_duplicate_resources_are_an_error(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "kustomization.yaml": kustomization("resources: [a.yaml, b.yaml]\n"),
            "a.yaml": "kind: ConfigMap\nmetadata: {name: x}\n",
            "b.yaml": "kind: ConfigMap\nmetadata: {name: x}\n",
        },
    )
    with pytest.raises(RenderError, match="defined twice"):
        render(tmp_path)


def test_the_gpu_overlay_gives_the_engine_a_gpu_and_epsd_the_visible_devices() -> None:
    out = render(REPO / "deploy/k8s/overlays/gpu")
    deployment = next(r for r in out if r["kind"] == "Deployment")
    c = containers([deployment])
    assert c["engine"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in c["epsd"]["env"]
    assert c["epsd"]["image"] == "registry.example.com/eps/epsd:0.1.0"
    # The base's env survives the patch.
    assert any(e["name"] == "OTEL_EXPORTER_OTLP_ENDPOINT" for e in c["epsd"]["env"])


def test_the_cpu_demo_overlay_runs_eps_demo_without_engine_probes() -> None:
    out = render(REPO / "deploy/k8s/overlays/cpu-demo")
    c = containers([next(r for r in out if r["kind"] == "Deployment")])
    assert c["engine"]["image"] == "registry.example.com/eps/epsd-demo:0.1.0"
    assert c["engine"]["command"][-1] == "/usr/local/bin/eps-demo"
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(c["engine"])
    assert {"startupProbe", "livenessProbe"} <= set(c["epsd"])
    assert "readinessProbe" not in c["epsd"]
