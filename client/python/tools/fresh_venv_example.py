#!/usr/bin/env python3
"""Installs eps-client into a fresh venv (its wheel and, offline, its dependencies from the
wheelhouse that scripts/setup.sh fills) and runs examples/integrate.py there against a real
epsd (cpu backend): what an integrator's first ten minutes look like. epsd gets the flags
of docs/integration/quickstart.md's epsd line (its socket path aside), and that page must
install into a venv, as Debian's Python requires.

    python3 client/python/tools/fresh_venv_example.py client/python EPSD WHEELHOUSE

EPS_WHEELHOUSE overrides WHEELHOUSE (a checkout whose .venv is shared keeps its own).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def quickstart_epsd_flags(source: Path) -> list[str]:
    """The flags of the quickstart's epsd line, but --listen; refuses a page whose steps
    would fail on Debian bookworm (pip outside a venv) or bind a fixed metrics port."""
    page = source.parents[1] / "docs" / "integration" / "quickstart.md"
    block = re.search(r"```sh\n(.*?)```", page.read_text(), re.DOTALL)
    if block is None:
        raise SystemExit(f"{page}: no sh block")
    lines = block.group(1).splitlines()
    if not any(re.match(r"python3 -m venv (\S+)", line) for line in lines) or any(
        re.match(r"(python3 -m )?pip install", line) for line in lines
    ):
        raise SystemExit(f"{page}: install with a venv's pip (PEP 668 on Debian)")
    epsd = next((line for line in lines if line.startswith("build/service/epsd ")), None)
    if epsd is None:
        raise SystemExit(f"{page}: no build/service/epsd line")
    flags = [f for f in epsd.split()[1:] if f != "&" and not f.startswith("--listen=")]
    if not any(f in ("--metrics-listen=off", "--metrics-listen=127.0.0.1:0") for f in flags):
        raise SystemExit(f"{page}: epsd's default --metrics-listen fails where 9464 is taken")
    return flags


def main() -> int:
    source, epsd = Path(sys.argv[1]).resolve(), sys.argv[2]
    flags = quickstart_epsd_flags(source)
    wheels = Path(os.environ.get("EPS_WHEELHOUSE", sys.argv[3]))  # the env var overrides
    if not any(wheels.glob("grpcio-*.whl")):
        print(f"no dependency wheels in {wheels}: run scripts/setup.sh", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        subprocess.run(["cp", "-r", f"{source}/.", t / "src"], check=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", t / "dist", t / "src"], check=True)
        subprocess.run([sys.executable, "-m", "venv", t / "venv"], check=True)
        python = t / "venv" / "bin" / "python3"
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--no-index", "--find-links", wheels, "--find-links", t / "dist",
                        "eps-client"], check=True)
        socket = t / "epsd.sock"
        server = subprocess.Popen([epsd, f"--listen=unix://{socket}", *flags],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while not socket.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            # run from the temporary folder: only the installed package can be imported
            run = subprocess.run([python, str(source / "examples" / "integrate.py"),
                                  f"unix://{socket}"], cwd=t, capture_output=True, text=True,
                                 timeout=120)
        finally:
            server.kill()
            server.wait()
    print(run.stdout + run.stderr)
    if run.returncode != 0 or "steps," not in run.stdout:
        print(f"integrate.py failed: exit {run.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
