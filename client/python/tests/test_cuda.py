"""eps_client.cuda without a GPU: a fake libcudart stands in for the runtime, so that the
calls CudaBuffers makes on the engine's thread are seen: the thread's current device is
the engine's again afterwards, and a failed call leaves no error pending."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from eps_client import cuda
from eps_client.buffers import BufferShape
from eps_client.layout import ModelLayout


class _Call:
    """A function of the fake runtime: ctypes' attributes (argtypes, restype) are accepted."""

    def __init__(self, body: Any) -> None:
        self.body = body

    def __call__(self, *args: Any) -> Any:
        return self.body(*args)


class FakeRuntime:
    """The runtime calls CudaBuffers makes; `fail` names the one that fails (error 2)."""

    def __init__(self, current: int, fail: str = "") -> None:
        self.current, self.fail, self.pending = current, fail, 0
        self.sets: list[int] = []
        for name in ("cudaGetErrorString", "cudaMalloc", "cudaFree", "cudaMemset",
                     "cudaSetDevice", "cudaGetDevice", "cudaGetLastError",
                     "cudaIpcGetMemHandle", "cudaGetDeviceProperties"):
            setattr(self, name, _Call(getattr(self, "_" + name)))

    def _result(self, name: str) -> int:
        if name == self.fail:
            self.pending = 2
            return 2
        return 0

    def _cudaGetErrorString(self, rc: int) -> bytes:
        return b"out of memory"

    def _cudaGetLastError(self) -> int:
        rc, self.pending = self.pending, 0
        return rc

    def _cudaSetDevice(self, device: int) -> int:
        self.sets.append(device)
        if self._result("cudaSetDevice"):
            return 2
        self.current = device
        return 0

    def _cudaGetDevice(self, out: Any) -> int:
        out._obj.value = self.current
        return self._result("cudaGetDevice")

    def _cudaMalloc(self, out: Any, size: int) -> int:
        if self._result("cudaMalloc"):
            return 2
        out._obj.value = 1 << 40
        return 0

    def _cudaFree(self, ptr: Any) -> int:
        return 0

    def _cudaMemset(self, ptr: Any, value: int, size: int) -> int:
        return self._result("cudaMemset")

    def _cudaIpcGetMemHandle(self, handle: Any, ptr: Any) -> int:
        return self._result("cudaIpcGetMemHandle")

    def _cudaGetDeviceProperties(self, props: Any, device: Any) -> int:
        return self._result("cudaGetDeviceProperties")


class FakeDriver:
    """libcuda's calls behind primary_context_active: `active` lists the devices whose
    primary context exists."""

    def __init__(self, active: set[int]) -> None:
        self.active = active
        self.cuInit = _Call(lambda flags: 0)
        self.cuDeviceGet = _Call(self._get)
        self.cuDevicePrimaryCtxGetState = _Call(self._state)

    def _get(self, out: Any, ordinal: int) -> int:
        out._obj.value = ordinal
        return 0

    def _state(self, device: Any, flags: Any, active: Any) -> int:
        active._obj.value = int(device.value in self.active)
        return 0


def _buffers(monkeypatch: pytest.MonkeyPatch, fake: FakeRuntime,
             driver: FakeDriver | None = None, no_driver: bool = False) -> cuda.CudaBuffers:
    torch = types.ModuleType("torch")
    torch.as_tensor = lambda view, device: view  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(cuda, "load_cudart", lambda path=None: fake)
    # The caller's device has its context unless a test says otherwise.
    if driver is None and not no_driver:
        driver = FakeDriver({fake.current})
    monkeypatch.setattr(cuda, "load_driver", lambda: driver)
    model = ModelLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)
    shape = BufferShape(num_slots=4, max_seqs=2, max_context=256, max_batch=2)
    return cuda.CudaBuffers(model, shape, device=1)


def test_buffers_leave_the_callers_current_device() -> None:
    fake = FakeRuntime(current=0)
    with pytest.MonkeyPatch.context() as monkeypatch:
        buffers = _buffers(monkeypatch, fake)
    assert fake.sets == [1, 0]  # device 1 made current for the region only
    assert fake.current == 0
    assert buffers.device == 1


def test_a_thread_that_never_chose_a_device_is_not_given_gpu_zero() -> None:
    # A fresh thread reads as device 0 without GPU 0's context: setting 0 back would
    # create that context (memory on a GPU the process may never use).
    fake = FakeRuntime(current=0)
    with pytest.MonkeyPatch.context() as monkeypatch:
        buffers = _buffers(monkeypatch, fake, FakeDriver(set()))
        assert fake.sets == [1]
        buffers.close()
    assert fake.sets == [1, 1]  # freed on the region's device, and 0 never set
    assert fake.current == 1


def test_close_frees_on_the_regions_device_and_restores_the_callers() -> None:
    fake = FakeRuntime(current=0)
    with pytest.MonkeyPatch.context() as monkeypatch:
        buffers = _buffers(monkeypatch, fake)
        fake.current = 0
        freed_on: list[int] = []
        fake.cudaFree = _Call(lambda ptr: freed_on.append(fake.current) or 0)
        fake.sets.clear()
        buffers.close()
    assert freed_on == [1]
    assert fake.sets == [1, 0]
    assert fake.current == 0


def test_without_the_driver_the_device_is_not_restored() -> None:
    # As gpu::PrimaryContextActive: a context the driver cannot confirm is not assumed.
    fake = FakeRuntime(current=0)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _buffers(monkeypatch, fake, no_driver=True)
    assert fake.sets == [1]


@pytest.mark.parametrize("failing", ["cudaMalloc", "cudaMemset", "cudaIpcGetMemHandle"])
def test_a_failed_call_restores_the_device_and_leaves_no_error_pending(failing: str) -> None:
    fake = FakeRuntime(current=0, fail=failing)
    with pytest.MonkeyPatch.context() as monkeypatch, pytest.raises(cuda.CudaError, match=failing):
        _buffers(monkeypatch, fake)
    assert fake.current == 0
    assert fake.pending == 0  # PyTorch's next launch check would have raised it


def test_a_failed_set_device_leaves_no_error_pending() -> None:
    fake = FakeRuntime(current=0, fail="cudaSetDevice")
    with pytest.MonkeyPatch.context() as monkeypatch, pytest.raises(cuda.CudaError):
        _buffers(monkeypatch, fake)
    assert fake.current == 0
    assert fake.pending == 0

