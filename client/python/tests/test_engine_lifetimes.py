"""Lifetimes of eps_client.engine's objects over a CudaBuffers region, without a GPU: a
fake libcudart and a fake libeps_engine log the calls, so the order of the watchdog's
destruction and the region's cudaFree is seen. A watchdog destroyed after the free reads
selection_done from freed memory at its step's due time (or writes into whatever
allocation took the address)."""

from __future__ import annotations

import gc
import sys
import types
import weakref
from typing import Any

import pytest
from test_cuda import FakeRuntime

from eps_client import cuda, engine
from eps_client.buffers import BufferShape
from eps_client.layout import ModelLayout


class _Tensor:
    """What CudaBuffers' fake torch.as_tensor makes of a region's view."""

    _DTYPES = {"<f4": "torch.float32", "<i4": "torch.int32", "<u8": "torch.uint64"}

    def __init__(self, view: Any, device: str) -> None:
        self._view = view
        self._interface = view.__cuda_array_interface__
        self.dtype = self._DTYPES.get(self._interface["typestr"], self._interface["typestr"])
        kind, index = device.split(":")
        self.device = types.SimpleNamespace(type=kind, index=int(index))

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return int(self._interface["data"][0])

    def numel(self) -> int:
        n = 1
        for d in self._interface["shape"]:
            n *= d
        return n

    def fill_(self, value: float) -> None:
        pass


class _LoggingRuntime(FakeRuntime):
    def __init__(self, log: list[str]) -> None:
        super().__init__(current=0)
        self.log = log

    def _cudaFree(self, ptr: Any) -> int:
        self.log.append("cudaFree")
        return 0


class _Call:
    def __init__(self, body: Any) -> None:
        self.body = body

    def __call__(self, *args: Any) -> Any:
        return self.body(*args)


class _FakeEngineLib:
    """The libeps_engine calls the step counters, watchdog and summary writer make."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.next = 1
        self.eps_engine_last_error = _Call(lambda: b"")
        self.eps_engine_preload = _Call(lambda device: 0)
        self.eps_engine_watchdog_create = _Call(self._create("watchdog"))
        self.eps_engine_watchdog_clear_feedback = _Call(lambda h, p, n: 0)
        self.eps_engine_watchdog_destroy = _Call(self._destroy("watchdog"))
        self.eps_engine_summary_writer_create = _Call(self._create("writer"))
        self.eps_engine_summary_writer_record_words = _Call(self._record_words)
        self.eps_engine_summary_writer_destroy = _Call(self._destroy("writer"))
        self.eps_engine_summary_queue_create = _Call(self._create("queue"))
        self.eps_engine_summary_queue_destroy = _Call(self._destroy("queue"))
        self.record_words = 0

    def _create(self, what: str) -> Any:
        def create(*args: Any) -> int:
            args[-1]._obj.value = self.next
            self.log.append(f"{what} {self.next} created")
            self.next += 1
            return 0
        return create

    def _destroy(self, what: str) -> Any:
        def destroy(h: int) -> None:
            self.log.append(f"{what} {h} destroyed")
        return destroy

    def _record_words(self, h: int, out: Any) -> int:
        out._obj.value = self.record_words
        return 0


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    torch = types.ModuleType("torch")
    torch.as_tensor = lambda view, device: _Tensor(view, device)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(cuda, "load_cudart", lambda path=None: _LoggingRuntime(calls))
    monkeypatch.setattr(engine, "_LIB", _FakeEngineLib(calls))
    return calls


MODEL = ModelLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)


def _buffers(feedback: bool = False) -> cuda.CudaBuffers:
    shape = BufferShape(num_slots=4, max_seqs=2, max_context=256, max_batch=2,
                        with_feedback=feedback)
    return cuda.CudaBuffers(MODEL, shape, device=0)


@pytest.mark.parametrize("feedback", [False, True])
def test_closing_the_buffers_first_destroys_the_watchdog_before_the_region_is_freed(
        log: list[str], feedback: bool) -> None:
    buffers = _buffers(feedback)
    watchdog = engine.Watchdog(engine.StepCounters.of(buffers), 1.0)
    buffers.close()  # the engine's teardown in the wrong order
    assert log == ["watchdog 1 created", "watchdog 1 destroyed", "cudaFree"]
    watchdog.close()  # already closed: a no-op
    assert log.count("watchdog 1 destroyed") == 1


def test_counters_refuse_to_be_used_once_their_buffers_are_freed(log: list[str]) -> None:
    buffers = _buffers()
    counters = engine.StepCounters.of(buffers)
    buffers.close()
    for use in (lambda: counters.signal_inputs_ready(0, 1), lambda: counters.wait_selection(0, 1),
                lambda: counters.release_dense(1), lambda: engine.Watchdog(counters, 1.0)):
        with pytest.raises(engine.EngineLibError, match="the step counters are closed") as e:
            use()
        assert e.value.code == engine.FAILED_PRECONDITION
    assert log == ["cudaFree"]  # nothing reached the library


def test_a_watchdog_keeps_its_buffers_alive(log: list[str]) -> None:
    buffers = _buffers()
    watchdog = engine.Watchdog(engine.StepCounters.of(buffers), 1.0)
    held = weakref.ref(buffers)
    del buffers
    gc.collect()
    assert held() is not None
    watchdog.close()


def test_an_unreferenced_watchdog_is_destroyed(log: list[str]) -> None:
    buffers = _buffers()
    engine.Watchdog(engine.StepCounters.of(buffers), 1.0)  # dropped at once
    gc.collect()
    assert log == ["watchdog 1 created", "watchdog 1 destroyed"]
    buffers.close()
    assert log[-1] == "cudaFree"


def test_closing_the_buffers_closes_a_summary_queue_and_writer_made_for_them(
        log: list[str]) -> None:
    from eps_client.layout import SummaryLayout

    engine.library().record_words = SummaryLayout.for_model(MODEL).record_words
    buffers = _buffers()
    writer = engine.DeviceSummaryWriter(MODEL, buffers=buffers)
    queue = engine.SummaryQueue(writer)
    buffers.close()
    assert log == ["writer 1 created", "queue 2 created", "queue 2 destroyed",
                   "writer 1 destroyed", "cudaFree"]
    with pytest.raises(engine.EngineLibError, match="the summary queue is closed"):
        queue.drain()


def test_nothing_registers_with_freed_buffers(log: list[str]) -> None:
    buffers = _buffers()
    buffers.close()
    with pytest.raises(cuda.CudaError, match="closed"):
        buffers.register(engine.StepCounters(1 << 40, 1 << 40, 4, 0))


def test_a_close_interrupted_by_one_user_leaves_the_others_and_the_region_for_the_next(
        log: list[str]) -> None:
    buffers = _buffers()
    older = engine.Watchdog(engine.StepCounters.of(buffers), 1.0)
    newer = engine.Watchdog(engine.StepCounters.of(buffers), 1.0)
    real_close = newer.close

    def interrupted() -> None:
        newer.close = real_close  # type: ignore[method-assign]
        raise KeyboardInterrupt

    newer.close = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        buffers.close()
    assert "cudaFree" not in log  # the older watchdog still reads the region
    buffers.close()
    assert log[-3:] == ["watchdog 2 destroyed", "watchdog 1 destroyed", "cudaFree"]
    older.close()
