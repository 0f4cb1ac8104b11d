"""eps_client.engine without a device: the EpsKeyAppend records match the C struct and the
record addresses follow the summary pool's layout."""

from __future__ import annotations

import ctypes
import re
import threading
import time
import types
from typing import Any

import numpy as np
import pytest

from eps_client import ModelLayout, SummaryLayout, engine
from eps_client.engine import KEY_APPEND, RECORD_RUN, key_appends, slot_runs


class CKeyAppend(ctypes.Structure):  # client/cpp/engine_capi.h, field for field
    _fields_ = [("record", ctypes.c_uint64), ("keys", ctypes.c_uint64),
                ("count", ctypes.c_int64), ("stride", ctypes.c_int64),
                ("layer", ctypes.c_int32), ("kv_head", ctypes.c_int32)]


def test_key_append_dtype_is_the_c_struct():
    assert KEY_APPEND.itemsize == ctypes.sizeof(CKeyAppend)
    for name, _ in CKeyAppend._fields_:
        assert KEY_APPEND.fields[name][1] == getattr(CKeyAppend, name).offset


class CRecordRun(ctypes.Structure):  # client/cpp/engine_capi.h
    _fields_ = [("first", ctypes.c_uint64), ("records", ctypes.c_int64)]


def test_record_run_dtype_is_the_c_struct():
    assert RECORD_RUN.itemsize == ctypes.sizeof(CRecordRun)
    for name, _ in CRecordRun._fields_:
        assert RECORD_RUN.fields[name][1] == getattr(CRecordRun, name).offset


def test_slot_runs_cover_every_record_of_each_slot_and_refuse_slots_outside_the_pool():
    model = ModelLayout(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=64)
    words = SummaryLayout.for_model(model).record_words
    runs = slot_runs(model, 1 << 20, [4, 0], num_slots=5)
    assert runs["first"].tolist() == [(1 << 20) + 4 * 6 * words * 4, 1 << 20]
    assert runs["records"].tolist() == [6, 6]
    with pytest.raises(ValueError, match="slot out of range"):
        slot_runs(model, 0, [5], num_slots=5)
    with pytest.raises(ValueError, match="slot out of range"):
        slot_runs(model, 0, [-1], num_slots=5)
    with pytest.raises(TypeError, match="must be integers"):
        slot_runs(model, 0, [1.9], num_slots=5)


def test_coarse_key_appends_follow_the_fine_ones_into_the_coarse_pool():
    model = ModelLayout(num_layers=2, num_q_heads=2, num_kv_heads=2, head_dim=64,
                        group_blocks=2, coarse_blocks=8)
    words = SummaryLayout.for_model(model).record_words
    slots, coarse = np.array([5, 0]), np.array([3, 1])
    ptrs = np.arange(2 * 2 * 2, dtype=np.uint64).reshape(2, 2, 2) * 1000 + 7
    fine = key_appends(model, 1 << 20, slots, ptrs, num_slots=6)
    both = key_appends(model, 1 << 20, slots, ptrs, num_slots=6, coarse_pool_ptr=1 << 30,
                       coarse_slots=coarse, num_coarse_slots=4)
    assert len(both) == 2 * len(fine)
    assert both[: len(fine)].tobytes() == fine.tobytes()
    for i, rec in enumerate(both[len(fine):]):
        layer, n, h = i // 4, (i // 2) % 2, i % 2
        assert rec["record"] == (1 << 30) + ((coarse[n] * 2 + layer) * 2 + h) * words * 4
        assert rec["keys"] == ptrs[layer, n, h] and rec["layer"] == layer


def test_coarse_key_appends_refuse_two_runs_into_one_coarse_record():
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=64,
                        group_blocks=2, coarse_blocks=8)
    ptrs = np.zeros((1, 2, 2), dtype=np.uint64)
    with pytest.raises(ValueError, match="coarse slot 4 is appended to by 2 runs"):
        key_appends(model, 0, np.array([0, 1]), ptrs, num_slots=2, coarse_pool_ptr=64,
                    coarse_slots=np.array([4, 4]), num_coarse_slots=5)
    with pytest.raises(ValueError, match="go together"):
        key_appends(model, 0, np.array([0, 1]), ptrs, num_slots=2, coarse_pool_ptr=64)
    flat = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="without a coarse level"):
        key_appends(flat, 0, np.array([0, 1]), ptrs, num_slots=2, coarse_pool_ptr=64,
                    coarse_slots=np.array([0, 1]), num_coarse_slots=2)


def test_key_appends_address_every_layer_and_head_of_each_slot():
    model = ModelLayout(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=64)
    words = SummaryLayout.for_model(model).record_words
    slots = np.array([5, 0, 9])
    ptrs = np.arange(3 * 3 * 2, dtype=np.uint64).reshape(3, 3, 2) * 1000 + 7
    a = key_appends(model, 1 << 20, slots, ptrs, count=np.array([16, 16, 3]), stride=128,
                    num_slots=10)
    assert len(a) == 18
    for i, rec in enumerate(a):
        layer, n, h = i // 6, (i // 2) % 3, i % 2
        assert rec["layer"] == layer and rec["kv_head"] == h
        assert rec["record"] == (1 << 20) + ((slots[n] * 3 + layer) * 2 + h) * words * 4
        assert rec["keys"] == ptrs[layer, n, h]
        assert rec["count"] == [16, 16, 3][n] and rec["stride"] == 128


@pytest.mark.parametrize(("slots", "kwargs", "error", "message"), [
    ([-1], {}, ValueError, r"slots: slot out of range \[0, 4\): -1..-1"),
    ([4], {}, ValueError, r"slot out of range \[0, 4\)"),
    ([10**6], {}, ValueError, "slot out of range"),
    ([1.9], {}, TypeError, "slots must be integers, got dtype float64"),
    ([True], {}, TypeError, "got dtype bool"),
    ([0], {"count": -5}, ValueError, "count=-5 is negative"),
    ([0], {"count": 1.5}, TypeError, "count must be integers"),
    ([0, 1], {"count": np.array([3, -1])}, ValueError, "count=-1 is negative"),
    ([0], {"num_slots": 4.0}, TypeError, "num_slots=4.0 is not an integer"),
])
def test_key_appends_refuse_slots_outside_the_pool_and_negative_counts(slots, kwargs, error,
                                                                       message):
    model = ModelLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)
    ptrs = np.zeros((2, len(slots), 2), np.uint64) + 0x7E0000000000
    args = {"num_slots": 4, **kwargs}
    with pytest.raises(error, match=message):
        key_appends(model, 0x7F0000000000, np.array(slots), ptrs, **args)


@pytest.mark.parametrize(("pool_ptr", "key_ptrs", "error", "message"), [
    (-4096, 1 << 40, ValueError, r"pool_ptr=-4096 is not in"),
    (1.5e12, 1 << 40, TypeError, r"pool_ptr=1500000000000.0 is not an integer"),
    (True, 1 << 40, TypeError, "pool_ptr=True is a bool"),
    (2**63 - 64, 1 << 40, ValueError, r"pool_ptr=9223372036854775744: the pool's 4 slots"),
    (1 << 40, -5, ValueError, "key_ptrs: -5 is not a device address"),
    (1 << 40, 1.5e12, TypeError, "key_ptrs must be integers, got dtype float64"),
    (1 << 40, True, TypeError, "key_ptrs must be integers, got dtype bool"),
])
def test_key_appends_refuse_addresses_that_are_not_device_addresses(pool_ptr, key_ptrs, error,
                                                                    message):
    # They were converted as they came (a negative pool_ptr wrapped to a record address near
    # 2**64, a float truncated, True read as address 1) into the appends the device runs.
    model = ModelLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)
    with pytest.raises(error, match=message):
        key_appends(model, pool_ptr, np.array([0, 1, 2]), np.full((2, 3, 2), key_ptrs),
                    num_slots=4)


@pytest.mark.parametrize(("pool_ptr", "error", "message"), [
    (-4096, ValueError, r"pool_ptr=-4096 is not in"),
    (1.5, TypeError, r"pool_ptr=1.5 is not an integer"),
    (True, TypeError, "pool_ptr=True is a bool"),
])
def test_slot_runs_and_coarse_appends_refuse_pool_addresses_that_are_not_addresses(
        pool_ptr, error, message):
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=64,
                        group_blocks=2, coarse_blocks=8)
    with pytest.raises(error, match=message):
        slot_runs(model, pool_ptr, [0, 1], num_slots=4)
    with pytest.raises(error, match=f"coarse_{message}"):
        key_appends(model, 1 << 40, np.array([0, 1]), np.zeros((1, 2, 2), np.int64),
                    num_slots=2, coarse_pool_ptr=pool_ptr, coarse_slots=np.array([0, 1]),
                    num_coarse_slots=2)


def test_coarse_key_appends_refuse_coarse_slots_outside_the_coarse_pool():
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=64,
                        group_blocks=2, coarse_blocks=8)
    ptrs = np.zeros((1, 2, 2), dtype=np.uint64)
    with pytest.raises(ValueError, match=r"coarse_slots: slot out of range \[0, 3\)"):
        key_appends(model, 0, np.array([0, 1]), ptrs, num_slots=2, coarse_pool_ptr=64,
                    coarse_slots=np.array([0, 3]), num_coarse_slots=3)
    with pytest.raises(ValueError, match="need num_coarse_slots"):
        key_appends(model, 0, np.array([0, 1]), ptrs, num_slots=2, coarse_pool_ptr=64,
                    coarse_slots=np.array([0, 1]))


def _closed(cls: type) -> object:
    """An instance in the state close() leaves (no device needed to make one)."""
    obj = cls.__new__(cls)
    obj._h = None  # type: ignore[attr-defined]
    obj._lock = threading.Lock()  # type: ignore[attr-defined]  # a Watchdog's
    return obj


@pytest.mark.parametrize("use", [
    lambda w: w.arm(5),
    lambda w: w.releases,
], ids=["arm", "releases"])
def test_a_closed_watchdog_raises_failed_precondition(use):
    # close() left None, which the library was handed as a null handle (a crash).
    with pytest.raises(engine.EngineLibError, match="the watchdog is closed") as e:
        use(_closed(engine.Watchdog))
    assert e.value.code == engine.FAILED_PRECONDITION


@pytest.mark.parametrize("use", [
    lambda q: q.submit(np.zeros(0, dtype=KEY_APPEND), "float16", 0, 1),
    lambda q: q.wait(0, 1),
    lambda q: q.drain(),
    lambda q: q.errors(),
], ids=["submit", "wait", "drain", "errors"])
def test_a_closed_summary_queue_raises_failed_precondition(use):
    with pytest.raises(engine.EngineLibError, match="the summary queue is closed") as e:
        use(_closed(engine.SummaryQueue))
    assert e.value.code == engine.FAILED_PRECONDITION


def test_a_closed_summary_writer_raises_failed_precondition():
    writer = _closed(engine.DeviceSummaryWriter)
    with pytest.raises(engine.EngineLibError, match="the summary writer is closed") as e:
        writer.append(np.zeros(0, dtype=KEY_APPEND), "float16")  # type: ignore[attr-defined]
    assert e.value.code == engine.FAILED_PRECONDITION
    with pytest.raises(engine.EngineLibError, match="the summary writer is closed"):
        writer.reset(np.zeros(0, dtype=RECORD_RUN))  # type: ignore[attr-defined]
    with pytest.raises(engine.EngineLibError, match="the summary writer is closed"):
        engine.SummaryQueue(writer)  # type: ignore[arg-type]
    writer.close()  # type: ignore[attr-defined]  # closing twice is a no-op


def test_the_library_refuses_null_handles_and_pointers():
    try:
        lib = engine.library()
    except engine.EngineLibError as e:
        pytest.skip(f"libeps_engine not built: {e}")
    assert lib.eps_engine_device_count(None) == 3
    assert b"count is null" in lib.eps_engine_last_error()
    assert lib.eps_engine_watchdog_arm(None, 1) == 3
    assert lib.eps_engine_summary_writer_record_words(None, None) == 3
    assert lib.eps_engine_summary_append(None, None, 0, 1, 0) == 3
    assert lib.eps_engine_summary_reset(None, None, 0, 0) == 3
    assert lib.eps_engine_summary_queue_drain(None) == 3
    assert lib.eps_engine_release_dense(0, 0, 4, 0, 1, 0) == 3
    assert b"flags is null" in lib.eps_engine_last_error()


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf")])
def test_a_watchdog_timeout_must_be_finite_and_positive(timeout_s):
    # It was clamped to 1 us: every armed step released at once.
    with pytest.raises(ValueError, match="timeout_s"):
        engine.Watchdog(None, timeout_s)  # type: ignore[arg-type]


@pytest.mark.parametrize("on_stream", [False, True])
def test_a_dense_release_clears_the_feedback_before_it_releases(on_stream):
    """No selection consumed the step before's entries: the released step's attention
    would combine its masses with them (log-add-exp). The release NaN-fills them first."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine.library()
    from eps_client.buffers import BufferShape
    from eps_client.cuda import CudaBuffers

    model = ModelLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)
    buffers = CudaBuffers(model, BufferShape(num_slots=8, max_seqs=2, max_context=256,
                                             max_batch=2, with_feedback=True))
    try:
        counters = engine.StepCounters.of(buffers)
        buffers.feedback.fill_(1.5)  # the step before's masses, never consumed
        stream = torch.cuda.Stream()
        if on_stream:
            counters.release_dense(3, stream.cuda_stream)
            counters.wait_selection(stream.cuda_stream, 3)
            stream.synchronize()
        else:
            counters.release_dense(3)
        assert bool(torch.isnan(buffers.feedback).all())
        assert int(buffers.flags[1]) == 3
        assert bool((buffers.visit_count == -1).all())
        # The watchdog's release (epsd accepted step 4 and never finished it) clears it too.
        buffers.feedback.fill_(1.5)
        torch.cuda.synchronize()
        watchdog = engine.Watchdog(counters, 0.05)
        try:
            watchdog.arm(4)
            deadline = time.monotonic() + 10
            while watchdog.releases < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert watchdog.releases == 1
        finally:
            watchdog.close()
        assert bool(torch.isnan(buffers.feedback).all())
        assert int(buffers.flags[1]) == 4
    finally:
        buffers.close()


class RecordingLib:
    """A stand-in libeps_engine: every call succeeds and is recorded; a create hands out a
    handle, and the writer's record has the client's words."""

    def __init__(self, record_words: int = 0) -> None:
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.record_words = record_words
        self.next = 1

    def eps_engine_last_error(self) -> bytes:
        return b""

    def __getattr__(self, name: str) -> object:
        if not name.startswith("eps_engine_"):
            raise AttributeError(name)

        def call(*args: object) -> int:
            self.calls.append((name, args))
            if name.endswith("_create"):
                args[-1]._obj.value = self.next  # type: ignore[attr-defined]
                self.next += 1
            elif name == "eps_engine_summary_writer_record_words":
                args[-1]._obj.value = self.record_words  # type: ignore[attr-defined]
            return 0
        return call


MODEL = ModelLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)


@pytest.fixture
def fake_lib(monkeypatch: pytest.MonkeyPatch) -> RecordingLib:
    lib = RecordingLib(SummaryLayout.for_model(MODEL).record_words)
    monkeypatch.setattr(engine, "_LIB", lib)
    return lib


class FakeFeedback:
    """What the counters read of a torch feedback tensor."""

    def __init__(self, dtype: str = "torch.float32", contiguous: bool = True,
                 device: str = "cuda:0") -> None:
        self.dtype, self._contiguous = dtype, contiguous
        kind, index = device.split(":")
        self.device = types.SimpleNamespace(type=kind, index=int(index))

    def is_contiguous(self) -> bool:
        return self._contiguous

    def data_ptr(self) -> int:
        return 0x1000

    def numel(self) -> int:
        return 8


def _objects() -> Any:
    """One of each object over the stand-in library, and a step's appends."""
    counters = engine.StepCounters(0x100, 0x200, 4, 0)
    writer = engine.DeviceSummaryWriter(MODEL, 0)
    return types.SimpleNamespace(
        counters=counters, watchdog=engine.Watchdog(counters, 0.1), writer=writer,
        queue=engine.SummaryQueue(writer),
        appends=key_appends(MODEL, 1 << 20, np.array([0, 1, 2]),
                            np.full((2, 3, 2), 1 << 22, dtype=np.uint64), num_slots=4))


U64 = "[0, 18446744073709551615]"


@pytest.mark.parametrize(("use", "error", "message"), [
    # -1 became 2**64 - 1 through ctypes: selection_done raised there for good
    (lambda o: o.counters.release_dense(-1), ValueError, f"release_dense(step)=-1 is not in {U64}"),
    (lambda o: o.counters.release_dense(2**64), ValueError,
     "release_dense(step)=18446744073709551616"),
    (lambda o: o.counters.release_dense(3, -1), ValueError, "release_dense(stream)=-1"),
    (lambda o: o.counters.release_dense(True), TypeError, "release_dense(step)=True is a bool"),
    (lambda o: o.counters.release_dense(3.0), TypeError, "release_dense(step)=3.0 is not an"),
    (lambda o: o.counters.signal_inputs_ready(0, -1), ValueError, "signal_inputs_ready(step)=-1"),
    (lambda o: o.counters.signal_inputs_ready(None, 1), TypeError,
     "signal_inputs_ready(stream)=None"),
    (lambda o: o.counters.wait_selection(-1, 1), ValueError, "wait_selection(stream)=-1"),
    (lambda o: o.counters.wait_selection(0, 2**64), ValueError, "wait_selection(step)="),
    # 0 is the library's "nothing armed": it dropped the watch of the step before
    (lambda o: o.watchdog.arm(0), ValueError, "Watchdog.arm(step)=0 is not in [1, "),
    (lambda o: o.watchdog.arm(-1), ValueError, "Watchdog.arm(step)=-1"),
    (lambda o: o.watchdog.arm("5"), TypeError, "Watchdog.arm(step)='5' is not an integer"),
    (lambda o: o.queue.submit(o.appends, "float32", 0, -1), ValueError, "submit(step)=-1"),
    (lambda o: o.queue.submit(o.appends, "float32", -7, 1), ValueError,
     "submit(after_stream)=-7"),
    (lambda o: o.queue.wait(0, 2**64), ValueError, "wait(step)=18446744073709551616"),
    (lambda o: o.writer.append(o.appends, "float32", -1), ValueError, "append(stream)=-1"),
    (lambda o: o.writer.reset(np.zeros(1, RECORD_RUN), 2**64), ValueError, "reset(stream)="),
    # 2**32 was device 0
    (lambda o: engine.StepCounters(0x100, 0x200, 4, 2**32), ValueError,
     "device=4294967296 is not in"),
    (lambda o: engine.StepCounters(-8, 0x200, 4, 0), ValueError, "flags_ptr=-8 is not in"),
    (lambda o: engine.StepCounters(0x100, 0x200, -1, 0), ValueError, "lists=-1 is not in"),
    (lambda o: engine.DeviceSummaryWriter(MODEL, -1), ValueError, "device=-1 is not in"),
    (lambda o: engine.DeviceSummaryWriter(MODEL, True), TypeError, "device=True is a bool"),
    (lambda o: engine.Watchdog(o.counters, "1"), TypeError,
     "Watchdog timeout_s='1' is not a number"),
])
def test_integer_arguments_outside_their_c_type_are_refused_before_the_library_is_called(
        fake_lib, use, error, message):
    objects = _objects()
    fake_lib.calls.clear()
    with pytest.raises(error, match=re.escape(message)):
        use(objects)
    assert fake_lib.calls == []


def test_numpy_integers_reach_the_library_as_the_same_ints(fake_lib):
    objects = _objects()
    fake_lib.calls.clear()
    objects.counters.release_dense(np.int64(3), np.uint64(2**64 - 1))
    objects.watchdog.arm(np.uint32(4))
    assert fake_lib.calls == [("eps_engine_release_dense", (0, 0x200, 4, 0x100, 3, 2**64 - 1)),
                              ("eps_engine_watchdog_arm", (objects.watchdog._h, 4))]
    assert all(type(a) is int for _, args in fake_lib.calls for a in args)


@pytest.mark.parametrize(("use", "error", "message"), [
    # a [2, n] array was read as 2 appends, a float array as appends at garbage addresses
    (lambda o: o.writer.append(o.appends.reshape(2, -1), "float32"), ValueError,
     r"appends.shape=\(2, 6\) is not \[n\]"),
    (lambda o: o.queue.submit(o.appends.reshape(2, 3, 2), "float32", 0, 1), ValueError,
     r"appends.shape=\(2, 3, 2\) is not \[n\]"),
    (lambda o: o.writer.append(np.zeros(12), "float32"), TypeError,
     "appends.dtype=float64 is not KEY_APPEND"),
    (lambda o: o.queue.submit(list(o.appends), "float32", 0, 1), TypeError,
     "appends is a list, not a numpy array of KEY_APPEND"),
    (lambda o: o.writer.append(o.appends[::2], "float32"), ValueError,
     "appends is not contiguous"),
    (lambda o: o.writer.reset(o.appends), TypeError, "runs.dtype=.* is not RECORD_RUN"),
    (lambda o: o.writer.reset(np.zeros((2, 2), RECORD_RUN)), ValueError,
     r"runs.shape=\(2, 2\) is not \[n\]"),
    # a bare KeyError named nothing
    (lambda o: o.writer.append(o.appends, "fp16"), ValueError,
     r"key_dtype='fp16' is not one of \['bfloat16', 'float16', 'float32'\]"),
    (lambda o: o.queue.submit(o.appends, None, 0, 1), TypeError,
     "key_dtype=None is not a str"),
])
def test_record_arrays_must_be_one_dimensional_contiguous_arrays_of_their_struct(
        fake_lib, use, error, message):
    objects = _objects()
    fake_lib.calls.clear()
    with pytest.raises(error, match=message):
        use(objects)
    assert fake_lib.calls == []


@pytest.mark.parametrize(("feedback", "error", "message"), [
    (FakeFeedback(dtype="torch.float16"), TypeError, "feedback.dtype=torch.float16 is not "
                                                     "torch.float32"),
    (FakeFeedback(contiguous=False), ValueError, "feedback is not contiguous"),
    (FakeFeedback(device="cuda:1"), ValueError, "feedback is on .*, the counters on cuda:0"),
    (FakeFeedback(device="cpu:0"), ValueError, "feedback is on"),
])
def test_the_feedback_a_release_fills_must_be_contiguous_float32_on_the_counters_device(
        fake_lib, feedback, error, message):
    # It was NaN-filled as float32 [numel] from data_ptr() whatever it was.
    with pytest.raises(error, match=message):
        engine.StepCounters(0x100, 0x200, 4, 0, feedback)
    assert fake_lib.calls == []


def test_close_waits_for_a_call_in_progress_and_destroys_the_watchdog_once(fake_lib):
    """close() on one thread while arm() runs on another: the handle was destroyed under
    the call (the library then armed a freed watchdog). Now close() takes the handle only
    once the call has returned, and a second close() destroys nothing."""
    watchdog = engine.Watchdog(engine.StepCounters(0x100, 0x200, 4, 0), 0.1)
    in_arm, leave_arm, destroyed = threading.Event(), threading.Event(), threading.Event()
    log: list[str] = []

    def arm(h: int, step: int) -> int:
        log.append(f"arm {h} enters")
        in_arm.set()
        leave_arm.wait(timeout=10)
        log.append(f"arm {h} returns")
        return 0

    def destroy(h: int) -> None:
        log.append(f"destroy {h}")
        destroyed.set()

    fake_lib.eps_engine_watchdog_arm = arm  # type: ignore[attr-defined]
    fake_lib.eps_engine_watchdog_destroy = destroy  # type: ignore[attr-defined]
    armer = threading.Thread(target=watchdog.arm, args=(5,))
    armer.start()
    assert in_arm.wait(timeout=10)
    closers = [threading.Thread(target=watchdog.close) for _ in range(2)]
    for c in closers:
        c.start()
    # Without the lock the destroy came at once, under the arm; with it none comes while
    # the arm runs (this bounded wait only lets a wrong order show).
    assert not destroyed.wait(timeout=0.2)
    leave_arm.set()
    armer.join()
    for c in closers:
        c.join()
    assert log == ["arm 1 enters", "arm 1 returns", "destroy 1"]
    with pytest.raises(engine.EngineLibError, match="the watchdog is closed"):
        watchdog.arm(6)


def test_a_library_named_by_eps_engine_lib_that_cannot_load_is_the_error(monkeypatch, tmp_path):
    # A wrong EPS_ENGINE_LIB once fell through to a source tree's build/ library silently, and
    # the error listed only the last four paths tried, never the one set.
    monkeypatch.setattr(engine, "_LIB", None)
    wrong = str(tmp_path / "missing" / "libeps_engine.so")
    monkeypatch.setenv("EPS_ENGINE_LIB", wrong)
    with pytest.raises(engine.EngineLibError, match=re.escape(f"EPS_ENGINE_LIB='{wrong}'")) as e:
        engine.library()
    assert e.value.code == 5
    with pytest.raises(engine.EngineLibError, match=re.escape(f"path='{wrong}'")):
        engine.library(wrong)
