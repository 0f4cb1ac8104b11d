"""The device side of an engine through libeps_engine's C ABI (client/cpp/engine_capi.h).

- ``StepCounters``: ``inputs_ready`` / ``selection_done`` on the engine's stream
  (docs/api-memory.md §3.4) and the dense release of a step that fell back.
- ``Watchdog``: releases a step epsd accepted but never finished (a sidecar killed
  mid-step), so the engine's stream never waits on it for longer than the timeout.
- ``DeviceSummaryWriter`` / ``SummaryQueue``: gpu/summary.h's writer, synchronous or
  queued on the engine's own stream with a step counter behind it (no host wait, and no
  stream of the engine's process ever waits for work another of its streams queues
  later: CUDA may put both in one hardware queue, a deadlock).
- ``key_appends``: the EpsKeyAppend records of one decode step, built with numpy;
  ``slot_runs``: the EpsRecordRun of each slot, for ``DeviceSummaryWriter.reset`` (reset a
  slot's records whenever it is (re)assigned to a new group).

Streams are passed as integers (``torch.cuda.Stream.cuda_stream``), memory as device
addresses (``tensor.data_ptr()``); an integer argument outside its C type (a negative step,
a device past int32), a bool or a non-integer is refused before the library is called
(TypeError, ValueError naming it), as are record arrays that are not 1-D contiguous
KEY_APPEND / RECORD_RUN arrays. The library is found through ``EPS_ENGINE_LIB``, next to
this package, or in a build folder of the source tree. Not thread-safe except Watchdog.
A handle used after its ``close()`` raises EngineLibError with code 9 (FAILED_PRECONDITION);
a SummaryQueue keeps its writer's device state alive, so closing the writer first is safe.

Lifetimes: an object made for a ``CudaBuffers`` (``StepCounters.of(buffers)``, a ``Watchdog``
over those counters, a ``DeviceSummaryWriter(..., buffers=b)`` and its ``SummaryQueue``) keeps
the buffers alive and is closed by ``buffers.close()`` before the region is freed, so no
order of close() calls lets the library touch freed memory. A Watchdog that is no longer
referenced closes itself. Counters made from raw addresses (no ``buffers``) borrow them:
the caller keeps the memory alive until every Watchdog over them is closed.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from eps_client import _values
from eps_client.layout import ModelLayout, SummaryLayout

KEY_APPEND = np.dtype([("record", "<u8"), ("keys", "<u8"), ("count", "<i8"),
                       ("stride", "<i8"), ("layer", "<i4"), ("kv_head", "<i4")])
RECORD_RUN = np.dtype([("first", "<u8"), ("records", "<i8")])
KEY_DTYPES = {"float32": 1, "float16": 2, "bfloat16": 3}
ABI_VERSION = 5  # EPS_ENGINE_ABI_VERSION of client/cpp/engine_capi.h


class EngineLibError(RuntimeError):
    """A failed call of libeps_engine: ``code`` is the canonical status code number."""

    def __init__(self, call: str, code: int, message: str) -> None:
        super().__init__(f"{call}: code {code}: {message}")
        self.code = code


class _Model(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("num_layers", "num_q_heads", "num_kv_heads",
                                              "head_dim", "block_size", "group_blocks",
                                              "sketch_dim")] + [
        ("phi_seed", ctypes.c_uint64), ("key_sum", ctypes.c_int32),
        ("principal", ctypes.c_int32), ("quest", ctypes.c_int32), ("quest8", ctypes.c_int32)]


def _candidates() -> list[Path]:
    here = Path(__file__).resolve().parent
    out = [here / "lib" / "libeps_engine.so"]
    for up in here.parents:
        out.append(up / "build" / "client" / "cpp" / "libeps_engine.so")
    return out


_LIB: ctypes.CDLL | None = None


def library(path: str | None = None) -> ctypes.CDLL:
    """Loads libeps_engine once: ``path``, else EPS_ENGINE_LIB, else the usual places; a named
    library that cannot load is the error (EngineLibError code 5)."""
    global _LIB
    if _LIB is not None and path is None:
        return _LIB
    tried = []
    # A library named by the caller or EPS_ENGINE_LIB is the one to load: its failure is the
    # error (a wrong setting once loaded a source tree's build/ library instead, silently).
    chosen = path or os.environ.get("EPS_ENGINE_LIB", "")
    for candidate in [chosen] if chosen else [str(p) for p in _candidates()]:
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as e:
            tried.append(f"{candidate}: {e}")
            continue
        _declare(lib)
        if lib.eps_engine_abi_version() != ABI_VERSION:
            raise EngineLibError("eps_engine_abi_version", 9, f"{candidate}: ABI version "
                                 f"{lib.eps_engine_abi_version()}, expected {ABI_VERSION}")
        _LIB = lib
        return lib
    if chosen:
        raise EngineLibError("load", 5, f"cannot load libeps_engine from "
                             f"{'path' if path else 'EPS_ENGINE_LIB'}={chosen!r}: {tried[0]}")
    raise EngineLibError("load", 5, "libeps_engine.so not found; set EPS_ENGINE_LIB. Tried: "
                         + "; ".join(tried))


def _declare(lib: ctypes.CDLL) -> None:
    u64, i64, i32, p = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    lib.eps_engine_last_error.restype = ctypes.c_char_p
    lib.eps_engine_watchdog_releases.restype = u64
    lib.eps_engine_summary_queue_errors.restype = u64
    sigs: dict[str, list[Any]] = {
        "eps_engine_preload": [i32],
        "eps_engine_signal_inputs_ready": [u64, u64, u64],
        "eps_engine_wait_selection": [u64, u64, u64],
        "eps_engine_wait_counter": [u64, u64, u64],
        "eps_engine_release_dense": [i32, u64, i64, u64, u64, u64],
        "eps_engine_clear_feedback": [i32, u64, i64, u64],
        "eps_engine_watchdog_create": [i32, u64, i64, u64, i64, ctypes.POINTER(p)],
        "eps_engine_watchdog_clear_feedback": [p, u64, i64],
        "eps_engine_watchdog_arm": [p, u64],
        "eps_engine_watchdog_releases": [p],
        "eps_engine_watchdog_destroy": [p],
        "eps_engine_summary_writer_create": [ctypes.POINTER(_Model), i32, ctypes.POINTER(p)],
        "eps_engine_summary_writer_record_words": [p, ctypes.POINTER(i32)],
        "eps_engine_summary_append": [p, p, i64, i32, u64],
        "eps_engine_summary_reset": [p, p, i64, u64],
        "eps_engine_summary_writer_destroy": [p],
        "eps_engine_summary_queue_create": [p, i32, ctypes.POINTER(p)],
        "eps_engine_summary_queue_submit": [p, p, i64, i32, u64, u64],
        "eps_engine_summary_queue_wait": [p, u64, u64],
        "eps_engine_summary_queue_drain": [p],
        "eps_engine_summary_queue_errors": [p, ctypes.c_char_p, i64],
        "eps_engine_summary_queue_destroy": [p],
        "eps_engine_flash_attention_views": [u64, u64, i32, i64, i32, i64, u64, i64, u64, i64,
                                             i32, i64, u64, u64, u64, u64],
        "eps_engine_flashinfer_fixed": [u64, u64, i32, i64, i32, i64, u64, i64, u64, i64, i32,
                                        i64, u64, i64, u64, u64, u64, u64],
    }
    for name, args in sigs.items():
        getattr(lib, name).argtypes = args


FAILED_PRECONDITION = 9


def _open(handle: int | None, what: str, call: str) -> int:
    """The handle of an object not yet closed; EngineLibError FAILED_PRECONDITION after
    close() (the library would otherwise be handed a null handle)."""
    if handle is None:
        raise EngineLibError(call, FAILED_PRECONDITION, f"the {what} is closed")
    return handle


def check(call: str, rc: int) -> None:
    if rc != 0:
        message = library().eps_engine_last_error().decode(errors="replace")
        raise EngineLibError(call, rc, message)


# ctypes converts a Python int to c_uint64 / c_int32 modulo 2**64 / 2**32, silently: -1 as
# a step is 2**64 - 1 (a dense release raised selection_done there for good), 2**32 as a
# device is device 0. Every integer argument goes through these first (TypeError for a
# non-integer or a bool, ValueError out of range, naming the argument).


def _u64(name: str, value: object) -> int:
    """A step, a stream handle or a device address: an integer in [0, 2**64)."""
    return _values.integer(name, value, *_values.UINT64)


def _device(name: str, value: object) -> int:
    """A CUDA device ordinal: an int32, >= 0."""
    return _values.integer(name, value, 0, _values.INT32[1])


def _key_dtype(key_dtype: object) -> int:
    """The C ABI's code of a key element type name (KEY_DTYPES)."""
    if not isinstance(key_dtype, str):
        raise TypeError(f"key_dtype={key_dtype!r} is not a str (one of {sorted(KEY_DTYPES)})")
    if key_dtype not in KEY_DTYPES:
        raise ValueError(f"key_dtype={key_dtype!r} is not one of {sorted(KEY_DTYPES)}")
    return KEY_DTYPES[key_dtype]


def _records(name: str, array: object, dtype: np.dtype, dtype_name: str) -> np.ndarray:
    """``array`` as the C ABI reads it: a 1-D, C-contiguous numpy array of ``dtype``, one
    struct per element (anything else was converted or reshaped into structs that are not
    the caller's: a [2, n] array became 2 appends, a float array garbage addresses)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} is a {type(array).__name__}, not a numpy array of {dtype_name}")
    if array.dtype != dtype:
        raise TypeError(f"{name}.dtype={array.dtype} is not {dtype_name}")
    if array.ndim != 1:
        raise ValueError(f"{name}.shape={array.shape} is not [n]")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} is not contiguous (strides {array.strides})")
    return array


def _check_feedback(feedback: Any, device: int) -> None:
    """The selection feedback a dense release NaN-fills as float32 [numel] from its
    data_ptr(): a contiguous float32 torch tensor on ``device``."""
    if feedback is None:
        return
    dtype = getattr(feedback, "dtype", None)
    if str(dtype) != "torch.float32":
        raise TypeError(f"feedback.dtype={dtype} is not torch.float32")
    if not feedback.is_contiguous():
        raise ValueError("feedback is not contiguous")
    where = feedback.device
    if where.type != "cuda" or where.index != device:
        raise ValueError(f"feedback is on {where}, the counters on cuda:{device}")


class StepCounters:
    """The flags buffer's counters (``flags`` [2] uint64 on the device) and the visit counts
    that a dense release marks -1. ``buffers`` (the CudaBuffers that hold them, as ``of``
    passes) is kept alive, and its ``close()`` closes these counters first; a call after
    ``close()`` raises EngineLibError FAILED_PRECONDITION.

    Steps and streams are integers in [0, 2**64), the device an int32 >= 0, ``lists`` >= 0,
    ``feedback`` a contiguous float32 tensor on ``device``: anything else is refused
    (TypeError, ValueError naming the argument) before the library is called."""

    def __init__(self, flags_ptr: int, visit_count_ptr: int, lists: int, device: int,
                 feedback: Any = None, *, buffers: Any = None) -> None:
        self.flags = _u64("flags_ptr", flags_ptr)
        self.counts = _u64("visit_count_ptr", visit_count_ptr)
        self.lists = _values.integer("lists", lists, 0, _values.INT64[1])
        self.device = _device("device", device)
        _check_feedback(feedback, self.device)
        self.feedback = feedback  # a torch tensor, NaN-filled by release_dense
        self.buffers = buffers  # the region's owner, or None (the caller keeps it alive)
        self._closed = False
        check("eps_engine_preload", library().eps_engine_preload(device))
        if buffers is not None:
            buffers.register(self)

    @staticmethod
    def of(buffers: Any) -> StepCounters:
        """For eps_client.cuda.CudaBuffers."""
        return StepCounters(buffers.flags.data_ptr(), buffers.visit_count.data_ptr(),
                            buffers.visit_count.numel(), buffers.device,
                            getattr(buffers, "feedback", None), buffers=buffers)

    def _live(self, call: str) -> None:
        if self._closed:
            raise EngineLibError(call, FAILED_PRECONDITION, "the step counters are closed")

    def close(self) -> None:
        """Stops using the addresses (their buffers are about to be freed)."""
        self._closed = True

    def signal_inputs_ready(self, stream: int, step: int) -> None:
        stream = _u64("signal_inputs_ready(stream)", stream)
        step = _u64("signal_inputs_ready(step)", step)
        self._live("signal_inputs_ready")
        check("signal_inputs_ready",
              library().eps_engine_signal_inputs_ready(stream, self.flags, step))

    def wait_selection(self, stream: int, step: int) -> None:
        stream = _u64("wait_selection(stream)", stream)
        step = _u64("wait_selection(step)", step)
        self._live("wait_selection")
        check("wait_selection", library().eps_engine_wait_selection(stream, self.flags, step))

    def release_dense(self, step: int, stream: int = 0) -> None:
        """visit_count = -1, then selection_done raised to ``step``. With a ``stream`` (the
        engine's, before its wait for ``step``) it is queued there and not waited for;
        without one it runs on a private stream and is waited for. A ``feedback`` tensor is
        NaN-filled first, in the same order: no selection consumed the entries of the step
        before, and the released step's attention would combine its masses with them."""
        step = _u64("release_dense(step)", step)
        stream = _u64("release_dense(stream)", stream)
        self._live("release_dense")
        if self.feedback is not None:
            check("clear_feedback", library().eps_engine_clear_feedback(
                self.device, self.feedback.data_ptr(), self.feedback.numel(), stream))
        check("release_dense", library().eps_engine_release_dense(
            self.device, self.counts, self.lists, self.flags, step, stream))


class Watchdog:
    """Arm(step) after each accepted async reply; after ``timeout_s`` a step whose
    selection_done has not come is released densely (counted in ``releases``).

    Keeps ``counters`` (and so their buffers) alive; their CudaBuffers' ``close()`` closes
    this watchdog first. ``close()`` (also run when the object is collected) finishes the
    armed step's watch: it returns once selection_done reaches the step, or at the step's
    due time after releasing it (client/cpp/selection_watchdog.h).

    Thread-safe: ``arm``, ``releases`` and ``close`` from any thread. A lock holds the
    handle through each library call, so close() destroys it only once no call is using it
    (the calls it waits for are short: the library's arm and releases take its mutex only
    briefly); the destroy itself, which may wait up to the timeout, runs outside the lock,
    and a call meanwhile raises FAILED_PRECONDITION at once. A second close() returns at
    once, while the first may still be finishing the watch."""

    _h: int | None = None  # set before anything can fail, so __del__ always finds it

    def __init__(self, counters: StepCounters, timeout_s: float) -> None:
        self._lock = threading.Lock()  # guards _h through every library call on it
        timeout_s = _values.duration("Watchdog timeout_s", timeout_s)
        counters._live("watchdog_create")
        handle = ctypes.c_void_p()
        check("watchdog_create", library().eps_engine_watchdog_create(
            counters.device, counters.counts, counters.lists, counters.flags,
            max(1, int(timeout_s * 1e6)), ctypes.byref(handle)))
        self._h = handle.value
        self._counters = counters  # the addresses the watchdog's thread reads and writes
        if counters.feedback is not None:  # cleared before each release, as release_dense does
            try:
                check("watchdog_clear_feedback", library().eps_engine_watchdog_clear_feedback(
                    self._h, counters.feedback.data_ptr(), counters.feedback.numel()))
            except BaseException:
                self.close()  # the caller never gets the object to close
                raise
        if counters.buffers is not None:
            try:
                counters.buffers.register(self)
            except BaseException:
                self.close()
                raise

    def arm(self, step: int) -> None:
        """Watches ``step`` (>= 1, < 2**64) from now on, superseding an older step armed
        before (its release raises selection_done past the older one too); a step not newer
        than the armed one changes nothing. Step 0 is refused (here, and with
        INVALID_ARGUMENT by the library): it is the watchdog's "nothing armed"."""
        step = _values.integer("Watchdog.arm(step)", step, 1, _values.UINT64[1])
        with self._lock:
            h = _open(self._h, "watchdog", "watchdog_arm")
            check("watchdog_arm", library().eps_engine_watchdog_arm(h, step))

    @property
    def releases(self) -> int:
        with self._lock:
            h = _open(self._h, "watchdog", "watchdog_releases")
            return int(library().eps_engine_watchdog_releases(h))

    def close(self) -> None:
        if self._h is None:
            return  # closed, or never made (__init__ failed before the handle)
        with self._lock:  # after any call that holds the handle
            h, self._h = self._h, None
        if h is not None:
            library().eps_engine_watchdog_destroy(h)

    def __del__(self) -> None:
        # Its thread would otherwise keep the armed step's addresses in use with no owner
        # left to stop it. Not on a half-torn-down interpreter: the library may be gone.
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            pass


class DeviceSummaryWriter:
    """gpu::DeviceSummaryWriter for ``model`` on ``device``. With ``buffers`` (the
    CudaBuffers whose summary pool it writes), it keeps them alive and their ``close()``
    closes it, and any SummaryQueue made on it, before the pool is freed."""

    _buffers: Any = None

    def __init__(self, model: ModelLayout, device: int = 0, *, buffers: Any = None) -> None:
        device = _device("device", device)
        f = model.features
        m = _Model(model.num_layers, model.num_q_heads, model.num_kv_heads, model.head_dim,
                   model.block_size, model.group_blocks, model.sketch_dim, model.phi_seed,
                   int(f.key_sum), int(f.principal), int(f.quest), int(f.quest8))
        handle = ctypes.c_void_p()
        check("summary_writer_create", library().eps_engine_summary_writer_create(
            ctypes.byref(m), device, ctypes.byref(handle)))
        self._h: int | None = handle.value
        self.model, self.device = model, device
        # The library's record must be this client's: a layout field it does not carry
        # would otherwise shift every record it writes.
        words = ctypes.c_int32()
        check("summary_writer_record_words", library().eps_engine_summary_writer_record_words(
            self._h, ctypes.byref(words)))
        want = SummaryLayout.for_model(model).record_words
        if words.value != want:
            self.close()
            raise EngineLibError("eps_engine_summary_writer_create", 9,
                                 f"the library's records have {words.value} words, this client's "
                                 f"{want} ({model.features}): libeps_engine and eps_client differ")
        if buffers is not None:
            try:
                buffers.register(self)
            except BaseException:
                self.close()  # the caller never gets the object to close
                raise
            self._buffers = buffers

    def append(self, appends: np.ndarray, key_dtype: str, stream: int = 0) -> None:
        """Applies ``appends`` (a 1-D contiguous KEY_APPEND array, as ``key_appends`` makes)
        on ``stream`` and waits for them. ``key_dtype``: a name of KEY_DTYPES."""
        a = _records("appends", appends, KEY_APPEND, "KEY_APPEND")
        code = _key_dtype(key_dtype)
        stream = _u64("append(stream)", stream)
        h = _open(self._h, "summary writer", "summary_append")
        check("summary_append", library().eps_engine_summary_append(
            h, a.ctypes.data, len(a), code, stream))

    def reset(self, runs: np.ndarray, stream: int = 0) -> None:
        """Queues on ``stream`` (not waited for) the reset of every record of ``runs`` (a
        RECORD_RUN array, e.g. ``slot_runs``) to the empty record, core's Reset bytes. Call it
        when a slot is (re)assigned to a new group, before the group's first append on the
        same stream: a reused record otherwise keeps the old group's statistics. ``runs``:
        a 1-D contiguous RECORD_RUN array."""
        r = _records("runs", runs, RECORD_RUN, "RECORD_RUN")
        stream = _u64("reset(stream)", stream)
        h = _open(self._h, "summary writer", "summary_reset")
        check("summary_reset", library().eps_engine_summary_reset(h, r.ctypes.data, len(r),
                                                                  stream))

    def close(self) -> None:
        if self._h is not None:
            library().eps_engine_summary_writer_destroy(self._h)
            self._h = None


class SummaryQueue:
    """A DeviceSummaryWriter on the engine's stream, with a step counter and no host wait
    (client/cpp/engine_summary_queue.h)."""

    def __init__(self, writer: DeviceSummaryWriter) -> None:
        w = _open(writer._h, "summary writer", "summary_queue_create")
        handle = ctypes.c_void_p()
        check("summary_queue_create", library().eps_engine_summary_queue_create(
            w, writer.device, ctypes.byref(handle)))
        self._h: int | None = handle.value
        self._writer = writer
        if writer._buffers is not None:  # closed before the pool its appends write is freed
            try:
                writer._buffers.register(self)
            except BaseException:
                self.close()
                raise

    def submit(self, appends: np.ndarray, key_dtype: str, after_stream: int, step: int) -> None:
        """Queues ``appends`` (a 1-D contiguous KEY_APPEND array) on ``after_stream``, then the
        queue's counter raised to ``step`` (an integer in [0, 2**64)) there."""
        a = _records("appends", appends, KEY_APPEND, "KEY_APPEND")
        code = _key_dtype(key_dtype)
        after_stream = _u64("submit(after_stream)", after_stream)
        step = _u64("submit(step)", step)
        h = _open(self._h, "summary queue", "summary_queue_submit")
        check("summary_queue_submit", library().eps_engine_summary_queue_submit(
            h, a.ctypes.data, len(a), code, after_stream, step))

    def wait(self, stream: int, step: int) -> None:
        """Enqueues on ``stream``: wait until the appends of ``step`` are applied."""
        stream = _u64("wait(stream)", stream)
        step = _u64("wait(step)", step)
        h = _open(self._h, "summary queue", "summary_queue_wait")
        check("summary_queue_wait", library().eps_engine_summary_queue_wait(h, stream, step))

    def drain(self) -> None:
        """Waits for the newest submission; EngineLibError code 15 (DATA_LOSS) when the
        device skipped appends (a bad key: the run is missing from its record) since the last
        drain."""
        h = _open(self._h, "summary queue", "summary_queue_drain")
        check("summary_queue_drain", library().eps_engine_summary_queue_drain(h))

    def errors(self) -> tuple[int, str]:
        """Submissions refused plus appends skipped on the device; call after ``drain``."""
        h = _open(self._h, "summary queue", "summary_queue_errors")
        buf = ctypes.create_string_buffer(512)
        n = library().eps_engine_summary_queue_errors(h, buf, len(buf))
        return int(n), buf.value.decode(errors="replace")

    def close(self) -> None:
        if self._h is not None:
            library().eps_engine_summary_queue_destroy(self._h)
            self._h = None


def key_appends(model: ModelLayout, pool_ptr: int, slots: np.ndarray, key_ptrs: np.ndarray,
                count: int | np.ndarray = 1, stride: int = 0, *, num_slots: int,
                coarse_pool_ptr: int | None = None, coarse_slots: np.ndarray | None = None,
                num_coarse_slots: int | None = None) -> np.ndarray:
    """Appends of keys to records: ``slots`` [n] summary slots (integers in [0, num_slots),
    ``num_slots`` the pool's first dimension) and ``key_ptrs`` [layers, n, kv_heads] device
    addresses of each key run (``count`` >= 0 keys, a scalar or [n], ``stride`` elements
    apart), for every layer and KV head. Returns a KEY_APPEND array of layers * n *
    kv_heads, ordered by layer, then n, then KV head. The addresses are computed here and
    the device writes through them, so a slot outside the pool is refused (ValueError), as is
    a float or bool slot (TypeError): nothing is built outside the pool. ``pool_ptr`` and
    ``key_ptrs`` are integers >= 0 (a negative, float or bool address is refused the same
    way, rather than wrapped or truncated into one).

    With a coarse level, ``coarse_pool_ptr``, ``coarse_slots`` [n] (run i's coarse slot:
    ``coarse_table[row, coarse_group_of(position, model)]``) and ``num_coarse_slots`` (the
    coarse pool's first dimension) append the same runs to the coarse records too, after the
    fine appends (twice as many entries). One call's appends must target distinct records
    (the device writer checks), so two runs of one coarse group in one call are refused
    here: submit a coarse group's keys as one run."""
    if (coarse_pool_ptr is None) != (coarse_slots is None):
        raise ValueError("coarse_pool_ptr and coarse_slots go together")
    if coarse_pool_ptr is not None and coarse_slots is not None:
        if not model.has_coarse_level:
            raise ValueError("coarse appends without a coarse level (coarse_blocks=0)")
        if num_coarse_slots is None:
            raise ValueError("coarse appends need num_coarse_slots (the coarse pool's slots)")
        coarse = _slots("coarse_slots", coarse_slots, num_coarse_slots)
        coarse_pool_ptr = _pool_ptr("coarse_pool_ptr", coarse_pool_ptr, num_coarse_slots, model)
        if coarse.shape != np.asarray(slots).shape:
            raise ValueError(f"coarse_slots.shape={coarse.shape}, expected "
                             f"{np.asarray(slots).shape}")
        values, counts = np.unique(coarse, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"coarse slot {int(values[counts > 1][0])} is appended to by "
                             f"{int(counts.max())} runs of one call: one run per coarse group")
        return np.concatenate([
            key_appends(model, pool_ptr, slots, key_ptrs, count, stride, num_slots=num_slots),
            key_appends(model, coarse_pool_ptr, coarse, key_ptrs, count, stride,
                        num_slots=num_coarse_slots)])
    L, H = model.num_layers, model.num_kv_heads
    words = SummaryLayout.for_model(model).record_words
    slots = _slots("slots", slots, num_slots)
    if slots.ndim != 1:
        raise ValueError(f"slots.shape={slots.shape}, expected [n]")
    n = slots.shape[0]
    pool_ptr = _pool_ptr("pool_ptr", pool_ptr, num_slots, model)
    key_ptrs = _values.integer_array("key_ptrs", key_ptrs)
    if key_ptrs.size and key_ptrs.min() < 0:
        raise ValueError(f"key_ptrs: {int(key_ptrs.min())} is not a device address")
    counts = _values.integer_array("count", count)
    if counts.ndim > 1 or (counts.ndim == 1 and counts.shape != (n,)):
        raise ValueError(f"count.shape={counts.shape}, expected a scalar or {(n,)}")
    if counts.size and counts.min() < 0:
        raise ValueError(f"count={int(counts.min())} is negative")
    stride = _values.integer("stride", stride, *_values.INT64)
    if key_ptrs.shape != (L, n, H):
        raise ValueError(f"key_ptrs.shape={key_ptrs.shape}, expected {(L, n, H)}")
    layer = np.arange(L, dtype=np.int64)[:, None, None]
    head = np.arange(H, dtype=np.int64)[None, None, :]
    record = pool_ptr + (((slots[None, :, None] * L + layer) * H + head) * words * 4)
    out = np.empty(L * n * H, dtype=KEY_APPEND)
    out["record"] = record.reshape(-1).astype(np.uint64)
    out["keys"] = key_ptrs.reshape(-1).astype(np.uint64)
    out["count"] = np.broadcast_to(counts[None, ..., None] if counts.ndim else counts,
                                   (L, n, H)).reshape(-1)
    out["stride"] = stride
    out["layer"] = np.broadcast_to(layer, (L, n, H)).reshape(-1)
    out["kv_head"] = np.broadcast_to(head, (L, n, H)).reshape(-1)
    return out


def slot_runs(model: ModelLayout, pool_ptr: int, slots: object, *,
              num_slots: int) -> np.ndarray:
    """The RECORD_RUN of each of ``slots`` (integers in [0, num_slots), ``num_slots`` the
    pool's first dimension) in the pool at device address ``pool_ptr`` (an integer >= 0):
    its num_layers * num_kv_heads records, for ``DeviceSummaryWriter.reset``. A slot outside
    the pool is refused (ValueError), a float or bool slot or address too (TypeError)."""
    s = _slots("slots", slots, num_slots).reshape(-1)
    pool_ptr = _pool_ptr("pool_ptr", pool_ptr, num_slots, model)
    per_slot = model.num_layers * model.num_kv_heads
    words = SummaryLayout.for_model(model).record_words
    out = np.empty(s.size, dtype=RECORD_RUN)
    out["first"] = (pool_ptr + s * (per_slot * words * 4)).astype(np.uint64)
    out["records"] = per_slot
    return out


def _pool_ptr(name: str, pool_ptr: object, num_slots: int, model: ModelLayout) -> int:
    """A pool's device address: an integer >= 0 (not a float, not a bool) whose ``num_slots``
    slots of records end below 2**63, where the records' addresses are computed (int64)."""
    ptr = _values.integer(name, pool_ptr, 0, _values.INT64[1])
    size = (num_slots * model.num_layers * model.num_kv_heads
            * SummaryLayout.for_model(model).record_words * 4)
    if ptr + size > _values.INT64[1] + 1:
        raise ValueError(f"{name}={ptr}: the pool's {num_slots} slots ({size} bytes) would end "
                         f"past 2**63")
    return ptr


def _slots(name: str, slots: object, num_slots: int) -> np.ndarray:
    """Integer slots in [0, num_slots) as int64."""
    limit = _values.integer(f"num_{name}", num_slots, 0)
    out = _values.integer_array(name, slots)
    if out.size and (out.min() < 0 or out.max() >= limit):
        raise ValueError(f"{name}: slot out of range [0, {limit}): {out.min()}..{out.max()}")
    return out
