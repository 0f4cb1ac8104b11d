"""The shared buffers of one engine session, allocated by this library (docs/design.md §5).

Never the engine's own tensors: PyTorch's expandable segments and vLLM's cumem
allocator break legacy CUDA IPC, so the library allocates one region and the
engine copies its few per-step rows in. The buffers are ``CONTRACT``, the
table of core/buffer_contract.h (a test compares the two), laid out as
client/cpp's BufferPlan lays them out: in this order, every buffer 256-byte
aligned:

    summary_pool  [slots, num_layers, num_kv_heads, record_words]  float32
    group_table   [max_seqs, max_groups]                   int32   group -> slot
    block_table   [max_seqs, max_blocks]                   int32   logical -> physical
    queries       [num_layers, max_batch, num_q_heads, head_dim]   float32
    visit_blocks  [num_layers, max_batch(, lists), max_blocks]     int32
    visit_count   [num_layers, max_batch(, lists)]         int32   lists: kv_heads, per KV head only
    flags         [counters]                               uint64  inputs_ready, selection_done
    coarse_pool   [coarse_slots, num_layers, num_kv_heads, record_words]  float32
    coarse_table  [max_seqs, max_coarse_groups]            int32   coarse group -> coarse slot
    feedback      [num_layers, max_seqs, num_q_heads, max_groups]  float32  log-sum-exp, NaN

The coarse pool and table only with a coarse level (``ModelLayout.coarse_blocks`` > 0): a
buffer with ``coarse_level`` set belongs to a layout exactly when it has one (``applies``).
Feedback (selection feedback, docs/api-memory.md) only with ``BufferShape.with_feedback``: by
table row, the engine's attention writes each visited group's log-sum-exp and epsd sets
the step's rows back to NaN after a step that succeeded; it starts NaN.

``ShmBuffers`` puts them in one POSIX shared-memory object as numpy arrays
(CPU mode); ``CudaBuffers`` (eps_client.cuda) in one cudaMalloc region exported
through CUDA IPC, as torch tensors.
"""

from __future__ import annotations

import itertools
import os
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import NoReturn

import numpy as np

from eps_client import _stale_shm, _values
from eps_client.layout import (
    ModelLayout,
    SummaryLayout,
    blocks_for,
    coarse_groups_for,
    groups_for,
)
from eps_client.proto import page_selector_pb2 as pb

ALIGNMENT = 256  # core/buffer_contract.h kBufferAlignment
REGION_ALIGNMENT = 2 << 20  # core/buffer_contract.h kRegionAlignment: a device region's size
_counter = itertools.count()


@dataclass(frozen=True)
class BufferSpec:
    """One row of the buffer contract (core::BufferSpec)."""

    name: str
    dims: tuple[str, ...]  # core::DimName of each dim; "lists" only per KV head
    dtype: type
    output: bool  # written by epsd (feedback: by the engine too)
    optional: bool = False
    coarse_level: bool = False  # only with a coarse level: required then, refused otherwise

    def applies(self, model: ModelLayout) -> bool:
        """Whether the buffer is one of ``model``'s (core::BufferApplies)."""
        return not self.coarse_level or model.has_coarse_level


CONTRACT: tuple[BufferSpec, ...] = (
    BufferSpec("summary_pool", ("slots", "num_layers", "num_kv_heads", "record_words"),
               np.float32, False),
    BufferSpec("group_table", ("max_seqs", "max_groups"), np.int32, False),
    BufferSpec("block_table", ("max_seqs", "max_blocks"), np.int32, False),
    BufferSpec("queries", ("num_layers", "max_batch", "num_q_heads", "head_dim"), np.float32,
               False),
    BufferSpec("visit_blocks", ("num_layers", "max_batch", "lists", "max_blocks"), np.int32, True),
    BufferSpec("visit_count", ("num_layers", "max_batch", "lists"), np.int32, True),
    BufferSpec("flags", ("counters",), np.uint64, True, optional=True),
    BufferSpec("coarse_pool", ("coarse_slots", "num_layers", "num_kv_heads", "record_words"),
               np.float32, False, coarse_level=True),
    BufferSpec("coarse_table", ("max_seqs", "max_coarse_groups"), np.int32, False,
               coarse_level=True),
    BufferSpec("feedback", ("num_layers", "max_seqs", "num_q_heads", "max_groups"), np.float32,
               True, optional=True),
)


@dataclass(frozen=True)
class BufferShape:
    """Sizes of the shared buffers (client::BufferShape)."""

    num_slots: int  # summary records per (layer, kv head)
    max_seqs: int  # rows of the group and block tables
    max_context: int  # tokens: fixes max_blocks and max_groups
    max_batch: int
    per_kv_head: bool = False  # visit lists per (sequence, layer, KV head) instead of the union
    with_flags: bool = True
    coarse_slots: int = 0  # coarse records per (layer, kv head): >= 1 with a coarse level, else 0
    # the selection-feedback buffer (docs/api-memory.md); no bytes without
    with_feedback: bool = False

    def __post_init__(self) -> None:
        """Integers (operator.index: numpy's welcome, floats and bools refused) and flags,
        checked before any memory is allocated for them."""
        for name in ("num_slots", "max_seqs", "max_context", "max_batch", "coarse_slots"):
            value = _values.integer(f"BufferShape.{name}", getattr(self, name))
            if value < (0 if name == "coarse_slots" else 1):
                raise ValueError(f"BufferShape.{name}={value} must be "
                                 f"{'>= 0' if name == 'coarse_slots' else '>= 1'}")
            object.__setattr__(self, name, value)
        for name in ("per_kv_head", "with_flags", "with_feedback"):
            object.__setattr__(self, name, _values.boolean(f"BufferShape.{name}",
                                                           getattr(self, name)))


@dataclass(frozen=True)
class BufferLayout:
    """Byte offsets and shapes of every buffer inside the one allocation."""

    model: ModelLayout
    shape: BufferShape
    max_blocks: int
    max_groups: int
    max_coarse_groups: int  # 0 without a coarse level
    record_words: int
    lists: int
    shapes: dict[str, tuple[int, ...]]
    offsets: dict[str, int]
    dtypes: dict[str, type]
    size: int

    @staticmethod
    def compute(model: ModelLayout, shape: BufferShape) -> BufferLayout:
        if (shape.coarse_slots < 1) if model.has_coarse_level else (shape.coarse_slots != 0):
            raise ValueError(f"BufferShape.coarse_slots={shape.coarse_slots} with coarse_blocks="
                             f"{model.coarse_blocks}: want >= 1 with a coarse level, 0 without")
        max_blocks = blocks_for(shape.max_context, model.block_size)
        max_groups = groups_for(shape.max_context, model)
        max_coarse = coarse_groups_for(shape.max_context, model)
        words = SummaryLayout.for_model(model).record_words
        lists = model.num_kv_heads if shape.per_kv_head else 1
        dims: dict[str, int] = {
            "slots": shape.num_slots, "num_layers": model.num_layers,
            "num_kv_heads": model.num_kv_heads, "record_words": words,
            "max_seqs": shape.max_seqs, "max_groups": max_groups, "max_blocks": max_blocks,
            "max_batch": shape.max_batch, "num_q_heads": model.num_q_heads,
            "head_dim": model.head_dim, "lists": lists, "counters": 2,
            "coarse_slots": shape.coarse_slots, "max_coarse_groups": max_coarse,
        }
        # Only the layout's buffers: the coarse ones with a coarse level alone, feedback
        # only when asked for (it is as large as max_seqs rows of scores).
        specs = [spec for spec in CONTRACT if spec.applies(model)
                 and (spec.name != "feedback" or shape.with_feedback)]
        shapes: dict[str, tuple[int, ...]] = {
            spec.name: tuple(dims[d] for d in spec.dims if d != "lists" or shape.per_kv_head)
            for spec in specs
        }
        dtypes: dict[str, type] = {spec.name: spec.dtype for spec in specs}
        offsets: dict[str, int] = {}
        at = 0
        for name, shape_of in shapes.items():
            offsets[name] = at
            nbytes = int(np.prod(shape_of)) * np.dtype(dtypes[name]).itemsize
            at = (at + nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        return BufferLayout(model, shape, max_blocks, max_groups, max_coarse, words, lists,
                            shapes, offsets, dtypes, at)

    def descriptors(self, memory: dict[str, object]) -> pb.SharedBuffers:
        """SharedBuffers with ``memory`` (one oneof field, e.g. {"host_shm": HostShm}) in each."""
        proto_dtype: dict[type, int] = {np.float32: pb.DTYPE_FLOAT32, np.int32: pb.DTYPE_INT32,
                       np.uint64: pb.DTYPE_UINT64}
        out = pb.SharedBuffers()
        for name, dims in self.shapes.items():
            if name == "flags" and not self.shape.with_flags:
                continue
            d = getattr(out, name)
            for field, value in memory.items():
                getattr(d, field).CopyFrom(value)
            d.offset = self.offsets[name]
            d.shape.extend(dims)
            d.dtype = proto_dtype[self.dtypes[name]]
        return out


def _unlink(shm: shared_memory.SharedMemory) -> None:
    """Removes the object's name; one already gone (an operator's rm, an old client's reaper)
    is what the caller wanted. But SharedMemory(create=True) registered the name with
    multiprocessing's resource tracker (every Python this package supports does, track=True
    being 3.13's default), and unlink() unregisters it only after removing it: left
    registered, the tracker would warn of a leak at exit and unlink the name, by then maybe
    another process's object."""
    try:
        shm.unlink()
    except FileNotFoundError:
        resource_tracker.unregister("/" + shm.name.lstrip("/"), "shared_memory")


def _reserve(shm: shared_memory.SharedMemory, size: int) -> None:
    """Allocates the object's pages now. SharedMemory sizes it with ftruncate, which on
    tmpfs leaves it sparse: a /dev/shm too small for it (a container's 64 MiB) would kill
    the process with SIGBUS at the first write to a page it cannot hold. Raises OSError
    (the object closed and unlinked) instead."""
    fd = getattr(shm, "_fd", -1)
    if fd < 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        shm.close()
        _unlink(shm)
        raise OSError(e.errno, f"ShmBuffers: cannot reserve {size} bytes for /{shm.name}: "
                      f"{e.strerror} (is /dev/shm large enough? `df -h /dev/shm`)") from None


def _create_shm(name: str, size: int) -> shared_memory.SharedMemory:
    """A new object named ``name``, or, when a dead process of the same pid left an object of
    that name (a crashed engine restarted in its container often gets its pid back while
    /dev/shm keeps the object), ``name`` with a random suffix: the other object is left alone,
    as the C++ client's EngineBuffers does."""
    try:
        return shared_memory.SharedMemory(name=name, create=True, size=size)
    except FileExistsError:
        for _ in range(8):  # as many tries as EngineBuffers::Create makes
            try:
                return shared_memory.SharedMemory(name=f"{name}-{secrets.token_hex(8)}",
                                                  create=True, size=size)
            except FileExistsError:
                continue
        raise


class ShmBuffers:
    """The shared buffers in one POSIX shared-memory object, as numpy views.

    First removes the objects of ``tag`` that dead processes left (unheld and unchanged for
    ``stale_grace_s``, ``STALE_SHM_GRACE_S`` = 10 s; tests pass a shorter one: see
    eps_client._stale_shm and docs/api-memory.md §3.3; a negative, NaN or infinite one raises
    ValueError before anything is removed or created), then creates
    ``/eps-<tag>-<pid>-<n>`` (with a random suffix when a dead process left that name) and
    holds ``flock(LOCK_SH)`` on it; ``close()`` (or the context manager, or garbage
    collection) unmaps, unlinks and unlocks it. Only the creating process unlinks: in a
    forked child, ``close()`` unmaps the child's copy and closes its copy of the lock's
    descriptor, and the parent's object stays, held while the parent lives. Not picklable
    (nor copyable): a copy would hold copies of the arrays and another process's descriptor
    number. Not thread-safe: the engine writes inputs before SelectPages and reads outputs
    after it.
    """

    def __init__(self, model: ModelLayout, shape: BufferShape, tag: str = "py", *,
                 stale_grace_s: float = _stale_shm.STALE_SHM_GRACE_S) -> None:
        stale_grace_s = _stale_shm.grace_period("stale_grace_s", stale_grace_s)
        self.layout = BufferLayout.compute(model, shape)
        self.model, self.shape = model, shape
        self._lock_fd = -1
        # The one process that removes the object (close() in a forked child must not).
        self._creator_pid = os.getpid()
        # Before creating: a crash-looping engine's dead objects would otherwise fill
        # /dev/shm until this one could not fit.
        _stale_shm.reap_stale(tag, stale_grace_s)
        self._shm: shared_memory.SharedMemory | None = _create_shm(
            f"eps-{tag}-{os.getpid()}-{next(_counter) % 10**10}", self.layout.size)
        self.shm_name = "/" + self._shm.name.lstrip("/")
        # Held from now until close(): what tells a later reaper that this object's creator
        # lives (until this line, STALE_SHM_GRACE_S covers it).
        try:
            self._lock_fd = _stale_shm.hold(self.shm_name[1:])
        except OSError as e:
            shm, self._shm = self._shm, None
            _unlink(shm)
            shm.close()
            raise OSError(e.errno, f"ShmBuffers: cannot lock {self.shm_name}: {e.strerror}") \
                from None
        try:
            _reserve(self._shm, self.layout.size)
        except OSError:
            self._shm = None  # _reserve closed and unlinked it
            self._unlock()
            raise
        buf = self._shm.buf
        views: dict[str, np.ndarray] = {
            n: np.ndarray(dims, dtype=self.layout.dtypes[n], buffer=buf,
                          offset=self.layout.offsets[n])
            for n, dims in self.layout.shapes.items()
        }
        self.summary_pool: np.ndarray = views["summary_pool"]
        self.group_table: np.ndarray = views["group_table"]
        self.block_table: np.ndarray = views["block_table"]
        self.queries: np.ndarray = views["queries"]
        self.visit_blocks: np.ndarray = views["visit_blocks"]
        self.visit_count: np.ndarray = views["visit_count"]
        self.flags: np.ndarray = views["flags"]
        # The coarse level's, None without one.
        self.coarse_pool: np.ndarray | None = views.get("coarse_pool")
        self.coarse_table: np.ndarray | None = views.get("coarse_table")
        # Selection feedback, None without BufferShape.with_feedback; NaN until written.
        self.feedback: np.ndarray | None = views.get("feedback")
        if self.feedback is not None:
            self.feedback.fill(np.nan)

    @property
    def max_blocks(self) -> int:
        return self.layout.max_blocks

    @property
    def max_groups(self) -> int:
        return self.layout.max_groups

    @property
    def max_coarse_groups(self) -> int:
        return self.layout.max_coarse_groups

    def descriptors(self) -> pb.SharedBuffers:
        """Descriptors of every buffer, for AttachRequest.buffers (refused once closed: epsd
        would map a name that is gone)."""
        self._check_open()
        shm = pb.HostShm(name=self.shm_name, size=self.layout.size)
        return self.layout.descriptors({"host_shm": shm})

    def visits(self, layer: int, batch_pos: int, kv_head: int = 0) -> np.ndarray | None:
        """The visit list of (layer, batch position[, KV head]): physical blocks, ascending;
        None where epsd (or a dense release) set the count to -1: attend densely. Indices are
        checked (no negative wrap-around): ValueError."""
        self._check_open()
        index = [_values.integer("layer", layer, 0, self.model.num_layers - 1),
                 _values.integer("batch_pos", batch_pos, 0, self.shape.max_batch - 1)]
        head = _values.integer("kv_head", kv_head, 0, self.layout.lists - 1)
        if self.shape.per_kv_head:
            index.append(head)
        count = int(self.visit_count[tuple(index)])
        if count < 0:
            return None
        return self.visit_blocks[tuple(index)][:count]

    def selection_done(self) -> int:
        self._check_open()
        return int(self.flags[1])

    def _check_open(self) -> None:
        if self._shm is None:
            raise ValueError(f"buffers closed ({self.shm_name})")

    def close(self) -> None:
        if self._shm is None:
            return
        # Drop our views first: SharedMemory.close() refuses while buffers are exported.
        for name in ("summary_pool", "group_table", "block_table", "queries", "visit_blocks",
                     "visit_count", "flags", "coarse_pool", "coarse_table", "feedback"):
            setattr(self, name, None)
        shm, self._shm = self._shm, None
        try:
            # The name goes now (the mapping when the last view does), and only in the creator:
            # a forked child's copy names its parent's object, which may well be live.
            if os.getpid() == self._creator_pid:
                _unlink(shm)
        finally:
            self._unlock()  # after the unlink: unheld, the object could be taken for stale
            try:
                shm.close()
            except BufferError:  # the caller still holds a view: unmapped when it goes
                pass

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)

    def __reduce__(self) -> NoReturn:
        raise TypeError(f"ShmBuffers ({self.shm_name}) cannot be pickled or copied: a copy "
                        "would hold copies of the arrays, not views of the object; open the "
                        "object by name in the other process")

    def __enter__(self) -> ShmBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing left to report to
            pass
