"""eps_client: the engine side of epsd, the EPS page selector.

- ``ShmBuffers`` / ``CudaBuffers``: the shared buffers, allocated by this library
  (POSIX shm as numpy arrays; cudaMalloc + CUDA IPC as torch tensors).
- ``SummaryWriter`` (numpy, bit-exact with core/) and ``TorchSummaryWriter``
  (GPU, vectorised): EPS summaries written when K is written.
- ``EpsClient``: attach, one ``select_pages`` per decode step with a deadline and
  fail-open fallback counted by reason, background re-attach, stream transport,
  traceparent injection.

torch is optional and imported only by ``eps_client.cuda`` and ``eps_client.torch_writer``.
"""

from __future__ import annotations

from eps_client.buffers import BufferLayout, BufferShape, ShmBuffers
from eps_client.client import (
    ClientCounters,
    ClientOptions,
    EpsClient,
    EpsError,
    StepResult,
    batch_rows,
)
from eps_client.layout import (
    ModelLayout,
    SummaryFeatures,
    SummaryLayout,
    blocks_for,
    groups_for,
    visited_tokens,
)
from eps_client.phi import phi_bank, phi_hash, phi_matrix, phi_scale
from eps_client.proto import page_selector_pb2 as pb
from eps_client.summary import SummaryWriter

__all__ = [
    "BufferLayout", "BufferShape", "ClientCounters", "ClientOptions", "EpsClient", "EpsError",
    "ModelLayout", "ShmBuffers", "StepResult", "SummaryFeatures", "SummaryLayout",
    "SummaryWriter", "attach_request", "batch_rows", "blocks_for", "groups_for", "pb",
    "phi_bank", "phi_hash", "phi_matrix", "phi_scale", "visited_tokens",
]


def attach_request(engine_id: str, model: ModelLayout, buffers: pb.SharedBuffers, *,
                   max_batch: int, num_kv_blocks: int = 0,
                   options: pb.SelectOptions | None = None,
                   backend: pb.Backend = pb.BACKEND_UNSPECIFIED, device: int = 0,
                   lease_ms: int = 0) -> pb.AttachRequest:
    """The AttachRequest that EpsClient sends (and re-sends on every re-attach)."""
    request = pb.AttachRequest(engine_id=engine_id, layout=model.to_proto(), buffers=buffers,
                               max_batch=max_batch, num_kv_blocks=num_kv_blocks,
                               backend=backend, device=device, lease_ms=lease_ms)
    if options is not None:
        request.options.CopyFrom(options)
    return request
