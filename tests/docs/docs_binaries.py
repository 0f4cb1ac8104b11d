"""The built binaries the docs tests run: EPS_BINARIES ("name=path;…", as ctest sets it),
or else the build/ folder of this checkout."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILT = {
    "epsd": "build/service/epsd",
    "eps-load": "build/load/eps-load",
    "eps-demo": "build/demo/eps-demo",
    "eps_core_demo": "build/demo/eps_core_demo",
    "eps-health-probe": "build/deploy/eps-health-probe",
}


def binaries() -> dict[str, str]:
    spec = os.environ.get("EPS_BINARIES", "")
    if spec:
        return dict(item.split("=", 1) for item in spec.split(";") if item)
    return {name: str(ROOT / path) for name, path in BUILT.items()}


def binary(name: str) -> str:
    path = binaries()[name]
    assert Path(path).is_file(), (
        f"{path} is not built: cmake --build build --target {name}, or set EPS_BINARIES")
    return path
