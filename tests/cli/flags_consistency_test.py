"""Every binary reads a shared flag name the same way (docs/cli.md).

ctest sets EPS_BINARIES to "name=path;..." for epsd, eps-load, eps-demo, eps_core_demo and
eps-health-probe. For every flag name that two or more of them accept, the same probe
values must be accepted by all or refused by all (a size, a duration, a bare number, a
fraction, a word), checked with `<flags> --help`: each binary parses and range-checks
every flag before it prints its usage, and exits 2 on a bad one.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

PROBES = ["16k", "2ms", "7", "1.5", "abc"]


def binaries() -> dict[str, str]:
    spec = os.environ.get("EPS_BINARIES", "")
    assert spec, "set EPS_BINARIES (ctest does)"
    return dict(item.split("=", 1) for item in spec.split(";") if item)


def run(path: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [path, *args], capture_output=True, text=True, timeout=30, check=False
    )


def flags_of(path: str) -> set[str]:
    done = run(path, "--help")
    assert done.returncode == 0, done.stderr
    return set(re.findall(r"^  --([a-z0-9-]+)=", done.stdout, re.MULTILINE))


def shared_flags() -> dict[str, list[str]]:
    owners: dict[str, list[str]] = defaultdict(list)
    for name, path in binaries().items():
        for flag in flags_of(path):
            owners[flag].append(name)
    return {flag: names for flag, names in sorted(owners.items()) if len(names) > 1}


def test_every_binary_prints_its_version_and_usage() -> None:
    for name, path in binaries().items():
        done = run(path, "--version")
        assert done.returncode == 0 and done.stdout.startswith(f"{name} "), done
        assert re.match(rf"{re.escape(name)} \d+\.\d+\.\d+$", done.stdout.strip()), (
            done.stdout
        )
        assert run(path, "--help").stdout.startswith(f"usage: {name}")


def test_the_binaries_share_their_common_flags() -> None:
    shared = shared_flags()
    for flag in ("target", "context", "batch", "seed", "mode", "deadline", "eps-dim"):
        assert flag in shared, f"--{flag} is in at most one binary: {shared}"


@pytest.mark.parametrize("value", PROBES)
def test_a_shared_flag_accepts_the_same_values_everywhere(value: str) -> None:
    paths = binaries()
    mismatches = []
    for flag, names in shared_flags().items():
        verdicts = {}
        for name in names:
            done = run(paths[name], f"--{flag}={value}", "--help")
            assert done.returncode in (0, 2), done
            verdicts[name] = "accepts" if done.returncode == 0 else "refuses"
        if len(set(verdicts.values())) > 1:
            mismatches.append(f"--{flag}={value}: {verdicts}")
    assert not mismatches, "\n".join(mismatches)


def test_a_bad_value_is_an_error_naming_the_flag() -> None:
    for path in binaries().values():
        done = run(path, "--no-such-flag=1")
        assert done.returncode == 2
        assert "--no-such-flag" in done.stderr, done.stderr
    paths = binaries()
    done = run(paths["eps-demo"], "--steps=abc")
    assert done.returncode == 2 and "--steps=abc" in done.stderr, done.stderr
    done = run(paths["eps-demo"], "--deadline=2ms", "--context=16k", "--help")
    assert done.returncode == 0, done.stderr


def test_a_unix_socket_path_too_long_for_its_address_is_refused_at_the_command_line() -> None:
    # Once eps-demo and eps-load ran and exited 3, eps-health-probe 1: the path failed only
    # at the first call. 107 bytes is sun_path less its NUL.
    paths = binaries()
    longest = "/tmp/" + "x" * 102  # 107 bytes
    for name, flag in (("eps-load", "target"), ("eps-demo", "target"),
                       ("eps-health-probe", "addr"), ("epsd", "listen")):
        done = run(paths[name], f"--{flag}=unix://{longest}x", "--help")
        assert done.returncode == 2, (name, done)
        assert f"--{flag}=unix://{longest}x: want a socket path of at most 107 bytes " \
               "(this one has 108)" in done.stderr, (name, done.stderr)
        done = run(paths[name], f"--{flag}=unix://{longest}", "--help")
        assert done.returncode == 0, (name, done.stderr)


def test_epsd_refuses_a_step_log_it_cannot_open_as_a_bad_command_line(tmp_path: Path) -> None:
    # Once exit 1, as a failure to serve; docs/cli.md: a file that cannot be created is 2.
    missing = tmp_path / "no-such-dir" / "steps.jsonl"
    done = run(binaries()["epsd"], f"--listen=unix://{tmp_path}/epsd.sock", "--backend=cpu",
               "--metrics-listen=off", f"--step-log={missing}")
    assert done.returncode == 2, done
    assert f"--step-log={missing}: cannot open for appending" in done.stderr, done.stderr
    assert not (tmp_path / "epsd.sock").exists()
