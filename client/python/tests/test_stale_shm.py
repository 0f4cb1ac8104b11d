"""The names of ShmBuffers' objects (docs/api-memory.md §3.3): the objects of dead engines
reaped before a create, what is never removed (a live creator's, a young one, other users',
other tags', what is no regular file), and who removes a name (only its creator, once)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from eps_client import BufferShape, ModelLayout, ShmBuffers

REAP_MODEL = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
REAP_SHAPE = BufferShape(1, 1, 64, 1)

# A creator that lives, holding its buffers, until killed (-9, as a crashed engine dies:
# nothing of its own runs). Its multiprocessing resource tracker would outlive it and unlink
# what it registered, hiding what is tested; in a crashed container the tracker dies with
# the engine, so the child registers nothing with one.
CREATOR = """
import sys
from multiprocessing import resource_tracker
resource_tracker.register = lambda name, rtype: None
from eps_client import BufferShape, ModelLayout, ShmBuffers
model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
held = [ShmBuffers(model, BufferShape(1, 1, 64, 1), tag=sys.argv[1])
        for _ in range(int(sys.argv[2]))]
print(" ".join(b.shm_name for b in held), flush=True)
sys.stdin.read()
"""


class Creator:
    def __init__(self, tag: str, count: int) -> None:
        import eps_client

        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(eps_client.__file__))}
        self.process = subprocess.Popen([sys.executable, "-c", CREATOR, tag, str(count)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=env)
        assert self.process.stdout is not None
        self.names = self.process.stdout.readline().split()
        assert len(self.names) == count, "the child could not create its buffers"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def creator():
    made: list[Creator] = []

    def make(tag: str, count: int) -> Creator:
        made.append(Creator(tag, count))
        return made[-1]

    yield make
    for c in made:
        c.kill()
        for name in c.names:
            if os.path.exists(f"/dev/shm{name}"):
                os.unlink(f"/dev/shm{name}")


def make_unheld(name: str) -> None:
    """An object no one holds, as one is between its creation and its creator's lock."""
    fd = os.open(f"/dev/shm{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)


def exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm{name}")


def test_the_objects_of_a_killed_creator_are_removed_by_the_next_shm_buffers(creator):
    tag = f"killed{os.getpid()}"
    child = creator(tag, 2)
    child.kill()
    assert all(exists(name) for name in child.names)
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0) as buf:
        assert [name for name in child.names if exists(name)] == []
        assert exists(buf.shm_name)


def test_the_object_of_a_live_creator_is_kept(creator):
    from eps_client._stale_shm import reap_stale

    tag = f"live{os.getpid()}"
    child = creator(tag, 1)
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0):
        assert exists(child.names[0])
        assert reap_stale(tag, 0) == [], "this process's own object was taken"
        # Only the lock kept it: once its creator is gone, it goes.
        child.kill()
        assert reap_stale(tag, 0) == child.names


def test_an_unheld_object_younger_than_the_grace_period_is_kept():
    from eps_client._stale_shm import reap_stale

    tag = f"young{os.getpid()}"
    young = f"/eps-{tag}-1-0"
    make_unheld(young)
    try:
        with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag):  # STALE_SHM_GRACE_S
            assert exists(young)
        # Only its age kept it.
        assert reap_stale(tag, 0) == [young]
    finally:
        if exists(young):
            os.unlink(f"/dev/shm{young}")


@pytest.mark.parametrize("grace", [-1, -0.5, float("nan"), float("inf"), float("-inf")])
def test_a_negative_or_non_finite_grace_period_is_refused_before_anything_is_removed(grace):
    # A negative one would take an object whose creator has not locked it yet (as young as
    # one can be); NaN and infinity would quietly take none. Refused before the reaping and
    # the creation: the young unheld object stays, and no object is made.
    from eps_client._stale_shm import reap_stale

    tag = f"grace{os.getpid()}"
    young = f"/eps-{tag}-1-0"
    make_unheld(young)
    try:
        with pytest.raises(ValueError, match=re.escape(f"stale_grace_s={float(grace)!r}")):
            ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=grace)
        with pytest.raises(ValueError, match=re.escape(f"grace_s={float(grace)!r}")):
            reap_stale(tag, grace)
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"eps-{tag}-")] == [young[1:]]
    finally:
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"eps-{tag}-"):
                os.unlink(f"/dev/shm/{name}")


def test_only_the_names_shm_buffers_makes_for_the_tag_are_removed():
    tag = f"names{os.getpid()}"
    prefix = f"/eps-{tag}-"
    reaped = [prefix + "1-0", prefix + "4194304-4294967295",
              prefix + "1-2-0123456789abcdef"]  # the random suffix (16 digits, both clients)
    kept = [f"/eps-{tag}x-1-0", f"/eps-x{tag}-1-0", f"/eps-{tag}-other-1-0",
            f"/epsx-{tag}-1-0", f"/x-eps-{tag}-1-0", prefix + "1", prefix + "1-",
            prefix + "-1-0", prefix + "1-0-", prefix + "1-0-0-0", prefix + "1-0-ABC",
            prefix + "1-0-xyz", prefix + "1-0-0123456789abcdef0", prefix + "1-0.lock",
            prefix + "+1-0", prefix + "١-0",  # an Arabic-Indic digit: not \d in C++
            prefix + "1-1-abc",  # a suffix of fewer than 16 digits (before 2026-11-28)
            prefix + "1-100-5",  # tag <tag>-1's pid 100, count 5 (read as ours before)
            prefix + "12345678-0", prefix + "1-12345678901"]  # 8-digit pid, 11-digit count
    for name in reaped + kept:
        make_unheld(name)
    try:
        with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0):
            assert [name for name in reaped if exists(name)] == []
            assert [name for name in kept if not exists(name)] == []
    finally:
        for name in reaped + kept:
            if exists(name):
                os.unlink(f"/dev/shm{name}")



def test_a_tag_that_extends_another_takes_none_of_its_objects_nor_gives_its_own():
    """Tags "t" and "t-1": "eps-t-1-100-5" is t-1's (pid 100, count 5) and
    "eps-t-1-5-0123456789012345" t's (pid 1, count 5, an all-decimal suffix)."""
    tag = f"pre{os.getpid()}"
    longer, shorter = f"/eps-{tag}-1-100-5", f"/eps-{tag}-1-5-0123456789012345"
    try:
        make_unheld(longer)
        make_unheld(shorter)
        with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0):
            assert exists(longer) and not exists(shorter)
        make_unheld(shorter)
        with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=f"{tag}-1", stale_grace_s=0):
            assert exists(shorter) and not exists(longer)
    finally:
        for name in (longer, shorter):
            if exists(name):
                os.unlink(f"/dev/shm{name}")


def test_a_fifo_or_symlink_under_the_tags_names_is_left_alone():
    # Entries under the tag's names that are no objects: a FIFO (an open that waited on it
    # would hang ShmBuffers) and a symlink to an unheld object of the same user (the link is
    # not the object; neither is followed). Both stay, and ShmBuffers returns.
    tag = f"special{os.getpid()}"
    fifo, link, target = f"/eps-{tag}-1-0", f"/eps-{tag}-1-1", f"/eps-{tag}x-1-0"
    os.mkfifo(f"/dev/shm{fifo}", 0o600)
    make_unheld(target)
    os.symlink(f"/dev/shm{target}", f"/dev/shm{link}")
    try:
        with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0):
            assert os.path.lexists(f"/dev/shm{fifo}") and os.path.lexists(f"/dev/shm{link}")
            assert exists(target)
    finally:
        for name in (fifo, link, target):
            if os.path.lexists(f"/dev/shm{name}"):
                os.unlink(f"/dev/shm{name}")

def test_what_is_no_regular_file_under_the_tags_names_is_not_even_opened():
    # Checked before it is opened: opening a FIFO wakes a writer waiting on it (a device
    # would do more). inotify reports every open of the FIFO, here none.
    import ctypes

    from eps_client._stale_shm import reap_stale

    in_open, in_dont_follow = 0x20, 0x02000000  # <sys/inotify.h>
    libc = ctypes.CDLL(None, use_errno=True)
    tag = f"unopened{os.getpid()}"
    fifo = f"/dev/shm/eps-{tag}-1-0"
    os.mkfifo(fifo, 0o600)
    watch = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    assert watch >= 0, os.strerror(ctypes.get_errno())
    try:
        assert libc.inotify_add_watch(watch, fifo.encode(), in_open | in_dont_follow) >= 0, \
            os.strerror(ctypes.get_errno())
        assert reap_stale(tag, 0) == []
        with pytest.raises(BlockingIOError):  # no event: the reaper did not open it
            os.read(watch, 4096)
    finally:
        os.close(watch)
        os.unlink(fifo)


def test_an_entry_replaced_between_its_check_and_its_open_is_left_alone(monkeypatch):
    # The name can come to name something else after the reaper checked it (here a FIFO
    # renamed over an unheld object just before the open): only the inode checked is taken.
    # The reaper's clock is an hour ahead, so that the FIFO's fresh ctime (the rename's) does
    # not keep it as young: only the inode check may.
    import stat
    import time

    from eps_client._stale_shm import reap_stale

    tag = f"swapped{os.getpid()}"
    name, fifo = f"eps-{tag}-1-0", f"/dev/shm/{tag}-fifo"
    make_unheld("/" + name)
    os.mkfifo(fifo, 0o600)
    real_open = os.open

    def open_after_swap(path, flags, mode=0o777, *, dir_fd=None):
        if path == name and os.path.lexists(fifo):
            os.rename(fifo, f"/dev/shm/{name}")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", open_after_swap)
    monkeypatch.setattr(time, "time_ns", lambda real=time.time_ns: real() + 3600 * 10**9)
    try:
        assert reap_stale(tag, 0) == []
        assert stat.S_ISFIFO(os.lstat(f"/dev/shm/{name}").st_mode)
    finally:
        monkeypatch.undo()
        for path in (f"/dev/shm/{name}", fifo):
            if os.path.lexists(path):
                os.unlink(path)


def test_another_users_object_is_kept(creator, monkeypatch):
    # As another user: this process's uid is not the one the reaper takes for its own.
    tag = f"user{os.getpid()}"
    child = creator(tag, 1)
    child.kill()
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0):
        assert exists(child.names[0])
    monkeypatch.undo()
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0):
        assert not exists(child.names[0])



def test_a_forked_childs_close_leaves_its_parents_object_named_and_held():
    # A forked child has a copy of the parent's ShmBuffers (and of its lock's descriptor).
    # Its close(), or its garbage collection when it ends, must not remove the live
    # parent's object: epsd opens it again by name when the engine re-attaches.
    from eps_client._stale_shm import reap_stale

    tag = f"fork{os.getpid()}"
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag, stale_grace_s=0) as buf:
        pid = os.fork()
        if pid == 0:  # the child: close its copy, then end without running anything else
            try:
                buf.close()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert exists(buf.shm_name), "the child removed its parent's object"
        assert reap_stale(tag, 0) == [], "the parent's lock went with the child's copy"
    assert not exists(buf.shm_name)


def test_shm_buffers_cannot_be_pickled():
    # A copy in another process (multiprocessing's spawn and forkserver pickle a Process's
    # arguments) would hold copies of the arrays, not views of the object, and the lock's
    # descriptor number of this process; its close() would remove this process's object.
    import copy
    import pickle

    tag = f"pickle{os.getpid()}"
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag) as buf:
        with pytest.raises(TypeError, match=re.escape(buf.shm_name)):
            pickle.dumps(buf)
        with pytest.raises(TypeError, match=re.escape(buf.shm_name)):
            copy.copy(buf)
        assert exists(buf.shm_name)


def test_close_after_the_name_went_releases_the_object_quietly():
    # Someone removed the name (an operator's rm, an old client's reaper): close() still
    # unmaps and unlocks, and does not raise for a name that is already gone.
    with ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=f"gone{os.getpid()}") as buf:
        os.unlink(f"/dev/shm{buf.shm_name}")
        buf.close()
        assert buf._lock_fd == -1 and buf._shm is None


# A process whose buffers' name someone removes (an operator's rm, an old client's reaper)
# before it closes them and ends.
CLOSE_AFTER_RM = """
import os
import sys
from eps_client import BufferShape, ModelLayout, ShmBuffers
model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
buf = ShmBuffers(model, BufferShape(1, 1, 64, 1), tag=sys.argv[1])
os.unlink("/dev/shm" + buf.shm_name)
buf.close()
"""


def test_close_after_the_name_went_leaves_the_resource_tracker_nothing_to_clean_up():
    # SharedMemory registers the object with multiprocessing's resource tracker, and only
    # its unlink() of a name still there unregisters it. A name left registered has the
    # tracker warn of a leak when the process ends and unlink the name itself: by then
    # maybe another process's object.
    import eps_client

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(eps_client.__file__))}
    ended = subprocess.run([sys.executable, "-c", CLOSE_AFTER_RM, f"rm{os.getpid()}"],
                           capture_output=True, text=True, env=env)
    assert ended.returncode == 0, ended.stderr
    assert "resource_tracker" not in ended.stderr, ended.stderr


def test_without_flock_shm_buffers_raise_and_leave_no_object(monkeypatch):
    # A /dev/shm whose flock fails (ENOLCK): an unheld object would be taken for a dead
    # engine's, so none is made (docs/api-memory.md §3.3).
    import errno
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    tag = f"nolock{os.getpid()}"
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(OSError, match="cannot lock") as raised:
        ShmBuffers(REAP_MODEL, REAP_SHAPE, tag=tag)
    assert raised.value.errno == errno.ENOLCK
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"eps-{tag}-")] == []

def test_the_grace_period_is_the_cpp_clients():
    from eps_client._stale_shm import STALE_SHM_GRACE_S

    header = os.path.join(os.path.dirname(__file__), "..", "..", "cpp", "engine_buffers.h")
    with open(header) as f:
        cpp = re.search(r"kStaleShmGrace\{(\d+)\}", f.read())
    assert cpp is not None and float(cpp.group(1)) == STALE_SHM_GRACE_S
