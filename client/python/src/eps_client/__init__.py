"""eps_client: the engine side of epsd, the EPS page selector.

- ``ShmBuffers`` / ``CudaBuffers``: the shared buffers, allocated by this library
  (POSIX shm as numpy arrays; cudaMalloc + CUDA IPC as torch tensors).
- ``SummaryWriter`` (numpy, bit-exact with core/) and ``TorchSummaryWriter``
  (GPU, vectorised): EPS summaries written when K is written.
- ``EpsClient``: attach, one ``select_pages`` per decode step with a deadline and
  fail-open fallback counted by reason (and reported to epsd), background re-attach,
  stream transport, async replies, traceparent injection. Plain types in, plain types
  out (``SelectOptions`` with ``MassSetting``, ``Row``, ``StepResult``, ``StepStats``);
  failures raise ``EpsError`` with a status code; leaving ``with`` detaches.
- ``eps_client.outputs``: visit lists as FlashAttention (block_table, seqused_k) views and
  FlashInfer paged-KV arrays; ``eps_client.engine``: the device-side engine library
  (summary writer, step counters, watchdog) through its C ABI.

torch is optional and imported only by the modules that need it.
"""

from __future__ import annotations

from eps_client.buffers import BufferLayout, BufferShape, ShmBuffers
from eps_client.client import EpsClient
from eps_client.client_options import ClientOptions
from eps_client.layout import (
    ModelLayout,
    SummaryFeatures,
    SummaryLayout,
    blocks_for,
    coarse_group_of,
    coarse_groups_for,
    groups_for,
    visited_tokens,
)
from eps_client.phi import phi_bank, phi_hash, phi_matrix, phi_scale
from eps_client.summary import SummaryWriter
from eps_client.types import (
    AttachInfo,
    ClientCounters,
    EpsError,
    MassSetting,
    Row,
    SelectOptions,
    StatusCode,
    StepResult,
    StepStats,
)

__all__ = [
    "AttachInfo", "BufferLayout", "BufferShape", "ClientCounters", "ClientOptions",
    "EpsClient", "EpsError", "MassSetting", "ModelLayout", "Row", "SelectOptions", "ShmBuffers",
    "StatusCode", "StepResult", "StepStats", "SummaryFeatures", "SummaryLayout",
    "SummaryWriter", "blocks_for", "coarse_group_of", "coarse_groups_for", "groups_for",
    "phi_bank", "phi_hash", "phi_matrix", "phi_scale", "visited_tokens",
]
