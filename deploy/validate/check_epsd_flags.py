"""Checks that every flag in the epsd-flags ConfigMap is one the built epsd accepts.

For the base and every overlay: renders the kustomization, takes the flags file
of the epsd-flags ConfigMap and
1. compares each flag name with the flags `epsd --help` lists;
2. runs deploy/docker/epsd-entrypoint.sh (the image's entrypoint) on that file with
   `--help` appended: epsd parses every flag and value first and exits 2 on an unknown
   flag, a bad value or a stray word, 0 when all parse; the file is read exactly as
   in the container.
Exit status 1 lists every problem.

Usage: check_epsd_flags.py --epsd build/service/epsd [--k8s-dir deploy/k8s]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kustomize_render import RenderError, render
from validate_manifests import flags_of, kustomization_dirs

HERE = Path(__file__).resolve().parent
ENTRYPOINT = HERE.parent / "docker" / "epsd-entrypoint.sh"


def accepted_flags(epsd: str) -> set[str]:
    done = subprocess.run([epsd, "--help"], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{epsd} --help exited {done.returncode}: {done.stderr.strip()}")
    names = set(re.findall(r"^\s+--([a-z0-9-]+)", done.stdout, re.MULTILINE))
    if not names:
        raise RuntimeError(f"{epsd} --help lists no flags:\n{done.stdout}")
    return names


def check(epsd: str, k8s_dir: Path) -> list[str]:
    accepted = accepted_flags(epsd)
    problems: list[str] = []
    for name, directory in kustomization_dirs(k8s_dir).items():
        try:
            resources = render(directory)
            flags = flags_of(resources)
        except RenderError as e:
            problems.append(f"{name}: {e}")
            continue
        text = next(
            r
            for r in resources
            if r["kind"] == "ConfigMap" and r["metadata"]["name"] == "epsd-flags"
        )
        for flag in flags:
            flag_name = flag[2:].split("=", 1)[0] if flag.startswith("--") else None
            if flag_name not in accepted:
                problems.append(
                    f"{name}: '{flag}' is not an epsd flag (epsd accepts {sorted(accepted)})"
                )
        with tempfile.NamedTemporaryFile("w", suffix=".flags", delete=False) as f:
            f.write(text["data"]["epsd.flags"])
        try:
            env = dict(os.environ, EPSD_BIN=epsd, EPSD_FLAGS_FILE=f.name)
            done = subprocess.run(
                ["sh", str(ENTRYPOINT), "--help"],
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        finally:
            os.unlink(f.name)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["(no output)"])[0]
            problems.append(
                f"{name}: epsd rejects the ConfigMap's flags (exit {done.returncode}): {first}"
            )
        print(f"{name}: {len(flags)} flags: {'ok' if done.returncode == 0 else 'rejected'}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsd", required=True, help="the built epsd binary")
    parser.add_argument("--k8s-dir", type=Path, default=HERE.parent / "k8s")
    args = parser.parse_args()
    problems = check(args.epsd, args.k8s_dir)
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
