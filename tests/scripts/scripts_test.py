"""The repository's shell scripts, run against stand-ins: their argument checks and the
failures they must report, without the builds and runs they normally start."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False,
                          **kwargs)  # type: ignore[call-overload]


def test_demo_stops_with_epsds_status_when_epsd_cannot_start(tmp_path: Path) -> None:
    # Once the demo waited out its 5 s for the socket and ran eps-demo against nobody.
    shutil.copy(REPO / "scripts" / "demo.sh", tmp_path / "demo.sh")
    (tmp_path / "scripts").mkdir()
    shutil.move(tmp_path / "demo.sh", tmp_path / "scripts" / "demo.sh")
    _script(tmp_path / "scripts" / "setup.sh", "true\n")
    _script(tmp_path / "scripts" / "build.sh", "true\n")
    _script(tmp_path / "build" / "service" / "epsd",
            'echo "epsd: --listen: stand-in refusal" >&2\nexit 2\n')
    _script(tmp_path / "build" / "demo" / "eps-demo", f'touch "{tmp_path}/demo-ran"\n')
    done = _run(["bash", str(tmp_path / "scripts" / "demo.sh")],
                env={**os.environ, "EPS_BUILD_DIR": str(tmp_path / "build")})
    assert done.returncode == 2, done
    assert "epsd: --listen: stand-in refusal" in done.stderr
    assert "epsd exited with status 2" in done.stderr
    assert not (tmp_path / "demo-ran").exists()


def test_fuzz_refuses_a_time_that_is_not_whole_seconds_before_building(tmp_path: Path) -> None:
    # No compiler: a run that got past the check would fail at cmake, not build for minutes.
    env = {**os.environ, "EPS_FUZZ_BUILD_DIR": str(tmp_path / "build-fuzz"),
           "EPS_CLANG": str(tmp_path / "no-clang"), "EPS_CLANGXX": str(tmp_path / "no-clang++")}
    for args in (["1h"], ["abc"], ["-5"], ["1", "2"]):
        done = _run(["bash", str(REPO / "scripts" / "fuzz.sh"), *args], env=env)
        assert done.returncode == 2, (args, done)
        assert "whole seconds per target" in done.stderr, done.stderr
    done = _run(["bash", str(REPO / "scripts" / "fuzz.sh"), "5"],
                env={**env, "EPS_FUZZ_RUNS": "many"})
    assert done.returncode == 2 and "EPS_FUZZ_RUNS=many" in done.stderr, done
    assert not (tmp_path / "build-fuzz").exists()


def test_check_format_says_when_it_has_no_clang_format(tmp_path: Path) -> None:
    # Once it exited 1 with no word, as if a file were misformatted.
    done = _run(["bash", str(REPO / "scripts" / "check_format.sh")],
                env={**os.environ, "CLANG_FORMAT": str(tmp_path / "no-clang-format")})
    assert done.returncode == 1
    assert "cannot run clang-format" in done.stderr, done.stderr
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("dirname", "git"):
        (tools / tool).symlink_to(shutil.which(tool) or tool)
    env = {k: v for k, v in os.environ.items() if k != "CLANG_FORMAT"}
    done = _run([shutil.which("bash") or "bash", str(REPO / "scripts" / "check_format.sh")],
                env={**env, "PATH": str(tools)})
    assert done.returncode == 1
    assert "cannot run clang-format (CLANG_FORMAT=unset)" in done.stderr, done.stderr
