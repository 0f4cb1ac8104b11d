#!/usr/bin/env python3
"""Builds the eps-client wheel offline (no build isolation, no dependencies) and checks
that it holds the package, the generated stubs and the type marker.

    python3 client/python/tools/check_wheel.py client/python
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REQUIRED = {
    "eps_client/__init__.py", "eps_client/client.py", "eps_client/client_options.py",
    "eps_client/buffers.py", "eps_client/reattach.py", "eps_client/requests.py",
    "eps_client/cuda.py", "eps_client/phi.py", "eps_client/summary.py",
    "eps_client/torch_writer.py", "eps_client/layout.py", "eps_client/py.typed",
    "eps_client/types.py", "eps_client/engine.py", "eps_client/outputs.py",
    "eps_client/proto/page_selector_pb2.py", "eps_client/proto/page_selector_pb2_grpc.py",
    "eps_client/proto/page_selector_pb2.pyi",
}


def main() -> int:
    source = Path(sys.argv[1]).resolve()
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as build:
        # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
        subprocess.run(["cp", "-r", f"{source}/.", build], check=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", out, build], check=True)
        wheels = list(Path(out).glob("eps_client-*.whl"))
        if len(wheels) != 1:
            print(f"expected one wheel, got {wheels}", file=sys.stderr)
            return 1
        names = set(zipfile.ZipFile(wheels[0]).namelist())
    missing = sorted(REQUIRED - names)
    if missing:
        print(f"{wheels[0].name} lacks {missing}", file=sys.stderr)
        return 1
    print(f"{wheels[0].name}: {len(names)} files, all {len(REQUIRED)} required present")
    return 0


if __name__ == "__main__":
    sys.exit(main())
