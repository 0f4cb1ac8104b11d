"""Device buffers that the library allocates itself and exports through CUDA IPC.

docs/design.md §5: PyTorch's expandable segments and vLLM's cumem allocator break legacy
``cudaIpcGetMemHandle`` on the engine's own tensors, so ``CudaBuffers`` takes one
region with ``cudaMalloc`` (through ctypes on libcudart), exports its 64-byte
legacy IPC handle in every descriptor (``CudaIpcHandle``) and wraps the buffers
as torch tensors (``__cuda_array_interface__``, no copy). Same layout as
``ShmBuffers``. torch is imported lazily, here only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import os
import sys
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from eps_client.buffers import REGION_ALIGNMENT, BufferLayout, BufferShape
from eps_client.layout import ModelLayout
from eps_client.proto import page_selector_pb2 as pb

_IPC_HANDLE_BYTES = 64


class CudaError(RuntimeError):
    pass


class RegionUser(Protocol):
    """An object that holds device addresses inside a CudaBuffers region (a StepCounters,
    a Watchdog, a DeviceSummaryWriter made for it): it must stop using them in close()."""

    def close(self) -> None: ...


def _candidate_libraries() -> list[str]:
    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    found = ctypes.util.find_library("cudart")
    if found:
        names.insert(0, found)
    # The runtime that PyTorch's wheels bring (nvidia-cuda-runtime-*), then the toolkit's.
    for base in sys.path:
        names += sorted(glob.glob(os.path.join(base, "nvidia", "cu*", "lib", "libcudart.so*")))
        names += sorted(glob.glob(os.path.join(base, "nvidia", "cuda_runtime", "lib",
                                               "libcudart.so*")))
    names += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))
    return names


def load_cudart(path: str | None = None) -> ctypes.CDLL:
    """Loads libcudart (EPS_CUDART overrides the search)."""
    tried = []
    for name in [path or os.environ.get("EPS_CUDART", "")] + _candidate_libraries():
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            tried.append(f"{name}: {e}")
    raise CudaError("cannot load libcudart; set EPS_CUDART. Tried: " + "; ".join(tried[-6:]))


def load_driver() -> Any:
    """Loads libcuda (the driver, which libcudart itself loads), or None where it cannot."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


class _Runtime:
    def __init__(self, lib: ctypes.CDLL, driver: Any = None) -> None:
        self.lib = lib
        self.driver = driver
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.c_char_p, ctypes.c_void_p]

    def check(self, rc: int, call: str) -> None:
        if rc != 0:
            # Not left as the thread's last error: PyTorch's next launch check (the same
            # libcudart) would raise it on one of its own ops.
            self.lib.cudaGetLastError()
            message = self.lib.cudaGetErrorString(rc).decode()
            raise CudaError(f"{call} failed: error {rc} ({message})")

    def current_device(self) -> int:
        device = ctypes.c_int(0)
        self.check(self.lib.cudaGetDevice(ctypes.byref(device)), "cudaGetDevice")
        return device.value

    def primary_context_active(self, device: int) -> bool:
        """Whether ``device``'s primary context exists (cuDevicePrimaryCtxGetState); False
        where the driver cannot say, as gpu::PrimaryContextActive."""
        d = self.driver
        if d is None:
            return False
        handle, flags, active = ctypes.c_int(0), ctypes.c_uint(0), ctypes.c_int(0)
        return (d.cuInit(0) == 0 and d.cuDeviceGet(ctypes.byref(handle), device) == 0 and
                d.cuDevicePrimaryCtxGetState(handle, ctypes.byref(flags),
                                             ctypes.byref(active)) == 0 and active.value != 0)

    @contextlib.contextmanager
    def device_scope(self, device: int) -> Iterator[None]:
        """Makes ``device`` current inside the block, then gives the thread back its own
        device (client/cpp/device_scope.h's rule): unless that device's context does not
        exist, since a thread that never chose a device reads as 0 and setting 0 would
        create GPU 0's context in a process that may never use it."""
        previous = self.current_device()
        self.check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
        try:
            yield
        finally:
            if previous != device and self.primary_context_active(previous):
                if self.lib.cudaSetDevice(previous) != 0:
                    self.lib.cudaGetLastError()  # not left for PyTorch's next check

    def device_uuid(self, device: int) -> bytes:
        """The 16-byte UUID of ``device`` (this process's ordinal), as epsd reads it
        (cudaDeviceProp.uuid, which follows the 256-byte name in every CUDA version; the
        buffer is far larger than the struct, whatever its version)."""
        get = getattr(self.lib, "cudaGetDeviceProperties_v2", None) or \
            self.lib.cudaGetDeviceProperties
        props = ctypes.create_string_buffer(1 << 14)
        self.check(get(props, ctypes.c_int(device)), f"cudaGetDeviceProperties({device})")
        return props.raw[256:272]


class CudaBuffers:
    """The shared buffers in one cudaMalloc region on ``device``, as torch tensors.

    Attributes mirror ShmBuffers (summary_pool, group_table, block_table, queries,
    visit_blocks, visit_count, flags). ``close()`` frees the region (after the
    sidecar detached: freeing memory another process maps is undefined).

    Objects of eps_client.engine that hold addresses in the region (``StepCounters.of``, a
    ``Watchdog`` over them, a ``DeviceSummaryWriter`` or ``SummaryQueue`` made with
    ``buffers=``) keep this object alive and are registered here: ``close()`` closes them
    first, newest first, and frees the region only then. A watchdog's thread would otherwise
    read selection_done from freed memory at its step's due time, or write -1s, NaNs and a
    counter into whatever allocation took the address. Not thread-safe.
    """

    def __init__(self, model: ModelLayout, shape: BufferShape, device: int = 0,
                 cudart: str | None = None) -> None:
        import torch  # noqa: F401 - lazy (an optional extra), and missing before any allocation

        self.layout = BufferLayout.compute(model, shape)
        self.model, self.shape, self.device = model, shape, device
        self._users: list[weakref.ref[RegionUser]] = []
        self._ptr: int | None = None
        self._rt = _Runtime(load_cudart(cudart), load_driver())
        # The thread's current device is the engine's: made `device` only while the region
        # is made (device_scope.h's rule), so the engine's next allocation stays on its own.
        with self._rt.device_scope(device):
            self._allocate(device)

    def _allocate(self, device: int) -> None:
        """Takes the region on the current device (``device``) and fills it."""
        ptr = ctypes.c_void_p()
        # whole 2 MiB pages (docs/design.md §5, "Allocate whole 2 MiB pages")
        size = -(-self.layout.size // REGION_ALIGNMENT) * REGION_ALIGNMENT
        self._rt.check(self._rt.lib.cudaMalloc(ctypes.byref(ptr), size), f"cudaMalloc({size})")
        if ptr.value is None:
            raise CudaError(f"cudaMalloc({size}) returned a null pointer")
        self._ptr = ptr.value
        try:
            self._fill(ptr, size, device)
        except BaseException:
            # The object never reaches the caller, so nothing else would free the region.
            for name in self.layout.shapes:
                setattr(self, name, None)
            self._ptr = None
            self._rt.lib.cudaFree(ptr)
            raise

    def _fill(self, ptr: ctypes.c_void_p, size: int, device: int) -> None:
        """Zeroes the region, exports it and makes its tensors."""
        import torch

        base: int = ptr.value  # type: ignore[assignment]
        self._rt.check(self._rt.lib.cudaMemset(ptr, 0, size), "cudaMemset")
        handle = ctypes.create_string_buffer(_IPC_HANDLE_BYTES)
        self._rt.check(self._rt.lib.cudaIpcGetMemHandle(handle, ptr), "cudaIpcGetMemHandle")
        self.ipc_handle = handle.raw
        # The GPU's UUID: Attach names the device by it, so a rank started with
        # CUDA_VISIBLE_DEVICES (whose ordinals are not epsd's) reaches the right one.
        self.device_uuid = self._rt.device_uuid(device)
        for name, dims in self.layout.shapes.items():
            # flags are uint64 counters; torch sees them as int64 (same bits below 2^63).
            np_dtype = self.layout.dtypes[name]
            if np_dtype is np.uint64:
                np_dtype = np.int64
            view = _DeviceArray(base + self.layout.offsets[name], dims, np_dtype, self)
            setattr(self, name, torch.as_tensor(view, device=f"cuda:{device}"))
        if self.feedback is not None:
            self.feedback.fill_(float("nan"))  # no group visited yet (docs/api-memory.md)

    summary_pool: Any
    group_table: Any
    block_table: Any
    queries: Any
    visit_blocks: Any
    visit_count: Any
    flags: Any
    coarse_pool: Any = None  # the coarse level's; None without one
    coarse_table: Any = None
    feedback: Any = None  # selection feedback; None without BufferShape.with_feedback

    def descriptors(self) -> pb.SharedBuffers:
        handle = pb.CudaIpcHandle(handle=self.ipc_handle, device=self.device)
        return self.layout.descriptors({"cuda_ipc": handle})

    def register(self, user: RegionUser) -> None:
        """Closes ``user`` before the region is freed (``close()``). CudaError once closed:
        its addresses are already freed."""
        if self._ptr is None:
            raise CudaError("the CudaBuffers region is closed (freed)")
        self._users = [u for u in self._users if u() is not None]
        self._users.append(weakref.ref(user))

    def close(self) -> None:
        if self._ptr is None:
            return
        # Users first, newest first: a watchdog before the counters it was made over, a
        # queue before its writer. A watchdog's close finishes its armed step's watch,
        # which reads the region: it must still be there. One at a time, so that a close
        # that raises (an interrupt in a watchdog's) leaves the others registered and the
        # region unfreed, for a later close() to finish.
        while self._users:
            user = self._users[-1]()
            if user is not None:
                user.close()
            self._users.pop()
        for name in self.layout.shapes:
            setattr(self, name, None)
        ptr, self._ptr = self._ptr, None
        # On the region's device: cudaFree on a thread whose device has no context yet
        # would create one there (GPU 0's, on a thread that never chose a device).
        with self._rt.device_scope(self.device):
            self._rt.check(self._rt.lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def __enter__(self) -> CudaBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _DeviceArray:
    """A raw device pointer described by __cuda_array_interface__ (v2) for torch.as_tensor.
    Holds the owning CudaBuffers so the region outlives every tensor made from it."""

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: type, owner: CudaBuffers) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": np.dtype(dtype).str,
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }
