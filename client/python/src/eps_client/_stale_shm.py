"""The shm objects of dead creators, and how ShmBuffers holds its own (docs/api-memory.md §3.3).

A process killed before it unlinks its buffers leaves the object in /dev/shm, which in a
pod is memory. The object must outlive nothing but its creator (epsd re-opens it by name
at a re-attach), so the creator's lock tells a live one from a dead one's: the creator
holds ``flock(LOCK_SH)`` on every object it makes for as long as it keeps the object, and
the kernel drops the lock when the process dies, however it dies and whatever its pid
namespace. Before creating, ShmBuffers removes the objects of its tag that no one holds.
The same rule as client/cpp's ReapStaleShm (engine_buffers.h).
"""

from __future__ import annotations

import fcntl
import math
import numbers
import os
import re
import stat
import time

SHM_DIR = "/dev/shm"  # where shm_open (glibc's and Python's) keeps every object on Linux
# How long an object must have gone unchanged (ctime and mtime) before it may be removed:
# its creator locks it just after making it, and an object in between must never be taken,
# however long its creator is descheduled there; no longer than Kubernetes' first restart
# back-off (10 s), so a restarted engine finds a crashed one's objects old enough.
# client/cpp's kStaleShmGrace.
STALE_SHM_GRACE_S = 10.0

# A pid of at most 7 digits (Linux's pid_max is at most 2^22), a count of at most 10, a
# suffix of exactly 16 hex digits: no tag's name reads as another's where one tag is the
# other's prefix and a '-' ("a" and "a-1"; docs/api-memory.md, "Stale objects").
_SUFFIX = re.compile(r"[0-9]{1,7}-[0-9]{1,10}(-[0-9a-f]{16})?")


def named_for_tag(entry: str, tag: str) -> bool:
    """Whether ``entry`` (a /dev/shm name) is one ShmBuffers or EngineBuffers makes for
    ``tag``: ``eps-<tag>-<pid>-<n>``, or that with ``-<16 lower-case hex digits>``."""
    prefix = f"eps-{tag}-"
    return entry.startswith(prefix) and _SUFFIX.fullmatch(entry, len(prefix)) is not None


def hold(name: str) -> int:
    """A descriptor of the new object ``name`` (no '/') holding ``flock(LOCK_SH)`` on it;
    closing it releases the lock. Raises OSError; EWOULDBLOCK when a reaper holds it (it was
    about to remove it)."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def grace_period(name: str, value: float) -> float:
    """``value`` as a grace period in seconds: a finite number >= 0, else ValueError (TypeError
    for what is no number), naming ``name`` and the value. A negative one would take an object
    whose creator has not locked it yet; NaN or infinity would quietly take none."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} is not a number of seconds")
    out = float(value)
    if not math.isfinite(out) or out < 0:
        raise ValueError(f"{name}={out!r} must be a finite number of seconds >= 0")
    return out


def _unchanged_for(st: os.stat_result, now_ns: int, grace_s: float) -> bool:
    """Whether neither ctime nor mtime is within ``grace_s`` of now (a clock set back makes
    an object younger: kept)."""
    return now_ns - max(st.st_ctime_ns, st.st_mtime_ns) >= grace_s * 1e9


def reap_stale(tag: str, grace_s: float = STALE_SHM_GRACE_S) -> list[str]:
    """Removes ``tag``'s stale objects and returns their names ('/'-prefixed): every entry
    ``named_for_tag``, a regular file of this process's effective uid (checked before the
    entry is opened: nothing else is ever opened), unchanged for at least ``grace_s``, that
    ``flock(LOCK_EX | LOCK_NB)`` can lock (its creator is gone). Everything else is left
    alone, quietly: another tag's, another user's, a held one (a live creator's, this
    process's own included), a younger one. Best effort: an entry that cannot be opened,
    locked or unlinked is skipped. A ``grace_s`` that ``grace_period`` refuses raises before
    anything is removed."""
    grace_s = grace_period("grace_s", grace_s)
    reaped: list[str] = []
    try:
        dir_fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return reaped
    try:
        entries = os.listdir(dir_fd)
        uid = os.geteuid()
        now_ns = time.time_ns()  # the clock of st_ctime and st_mtime
        for entry in entries:
            if named_for_tag(entry, tag) and _reap_one(dir_fd, entry, uid, now_ns, grace_s):
                reaped.append("/" + entry)
    except OSError:
        pass  # the directory could not be listed: nothing reaped
    finally:
        os.close(dir_fd)
    return reaped


def _reap_one(dir_fd: int, entry: str, uid: int, now_ns: int, grace_s: float) -> bool:
    # Checked before it is opened, without following a link: what is not a regular file of
    # this uid (a FIFO, whose open would wake a writer waiting on it, a device, a link,
    # another user's file) is never opened.
    try:
        checked = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISREG(checked.st_mode) or checked.st_uid != uid:
        return False
    # O_NOFOLLOW | O_NONBLOCK | O_NOCTTY: what may have replaced the entry since is neither
    # followed, waited on nor made the controlling terminal, and is left unless it is the
    # very inode checked.
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                     | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        opened = os.fstat(fd)
        if ((opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino)
                or not _unchanged_for(opened, now_ns, grace_s)):
            return False
        try:  # fails while anyone holds the object: its creator (LOCK_SH), or another reaper
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        # Only the object locked: since it was opened, another reaper may have removed it and
        # a new creator made the name again.
        try:
            named = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        if (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
            return False
        try:
            os.unlink(entry, dir_fd=dir_fd)
        except OSError:  # EPERM (another user's, in the sticky /dev/shm), ENOENT: quietly
            return False
        return True
    finally:
        os.close(fd)
