"""The command docs/deploy-operations.md gives to restart epsd alone, run as written.

It runs in a PID namespace of its own (unshare), where the only epsd is the one the test
starts: on the host it would signal every epsd. ctest sets EPSD to the built epsd.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Starts nine stand-ins for the engine's processes (the pod shares its process namespace),
# then epsd: the stand-ins take pids 2 to 10 and epsd 11, so the last /proc entry in glob
# order (/proc/9) is not epsd, as in a pod, where the old command's status was that of its
# last test. Then it runs the documented command ($RESTART) and reports each exit status:
# the command's, epsd's (0 after a drain), the command's once more with no epsd left.
# When the namespace's first process exits, the kernel ends the others.
SCENARIO = """
for i in 1 2 3 4 5 6 7 8 9; do sleep 60 & done
"$EPSD" --listen="unix://$DIR/epsd.sock" --backend=cpu --metrics-listen=off 2>"$DIR/epsd.log" &
epsd=$!
tries=0
while [ ! -S "$DIR/epsd.sock" ] && [ "$tries" -lt 400 ]; do  # polling epsd's start-up
  sleep 0.05; tries=$((tries + 1))
done
sh -c "$RESTART"; echo "restart=$?"
wait "$epsd"; echo "epsd=$?"
sh -c "$RESTART"; echo "again=$?"
"""


def restart_command() -> str:
    text = (REPO / "docs/deploy-operations.md").read_text()
    found = re.search(r"-- sh -c \\\n\s*'([^']*)'", text)
    assert found, ("docs/deploy-operations.md has no `kubectl exec ... -c epsd -- sh -c '...'` "
                   "command")
    return found.group(1)


@pytest.fixture()
def scratch() -> Iterator[Path]:
    short = Path(tempfile.mkdtemp(prefix="eps-restart-", dir="/tmp"))
    yield short
    shutil.rmtree(short)


def test_the_restart_command_exits_0_when_it_stopped_epsd_and_1_when_none_runs(
    scratch: Path,
) -> None:
    unshare = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    if shutil.which("unshare") is None or subprocess.run(
        [*unshare, "true"], capture_output=True, check=False
    ).returncode:
        pytest.skip("no unshare into a user and PID namespace here")
    epsd = os.environ.get("EPSD")
    assert epsd, "set EPSD to the built epsd (ctest does)"
    env = dict(os.environ, EPSD=os.path.abspath(epsd), DIR=str(scratch), RESTART=restart_command())
    done = subprocess.run(
        [*unshare, "sh", "-c", SCENARIO],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    log = (scratch / "epsd.log").read_text() if (scratch / "epsd.log").exists() else ""
    assert "restart=0" in done.stdout, done.stdout + done.stderr + log
    assert "epsd=0" in done.stdout and "signal 15, draining" in log, done.stdout + log
    assert "again=1" in done.stdout, done.stdout + done.stderr
    assert "no epsd" in done.stderr, done.stderr
