"""The requests EpsClient sends, built from plain values (eps_client.types) with their inputs
checked: a bad one is a TypeError or ValueError naming the field and its value. The
AttachRequest is built once and sent again on every re-attach (eps_client.reattach); a step's
SelectPagesRequest gets its session just before it is sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from eps_client import _values
from eps_client.proto import page_selector_pb2 as pb
from eps_client.types import Backend, Row, SelectOptions, backend_proto, rows_proto


def attach_request(buffers: Any, *, engine_id: str, max_batch: int | None = None,
                   num_kv_blocks: int = 0, select: SelectOptions | None = None,
                   backend: Backend = "auto", device: int = 0,
                   lease_ms: int = 0, device_uuid: bytes = b"") -> pb.AttachRequest:
    """The AttachRequest that EpsClient sends (and re-sends on every re-attach).

    ``device_uuid``: the 16-byte CUDA UUID of the session's GPU, for a rank whose device
    ordinals differ from epsd's (CUDA_VISIBLE_DEVICES; docs/api-memory.md §3.7). Empty: the
    buffers' own (``CudaBuffers.device_uuid``), if they have one."""
    if not isinstance(engine_id, str):
        raise TypeError(f"engine_id={engine_id!r} is not a str")
    if not isinstance(device_uuid, (bytes, bytearray)):
        raise TypeError(f"device_uuid={device_uuid!r} is not bytes")
    if select is not None and not isinstance(select, SelectOptions):
        raise TypeError(f"select={select!r} is not a SelectOptions")
    layout = buffers.layout
    if not device_uuid:
        device_uuid = getattr(buffers, "device_uuid", b"") or b""
    request = pb.AttachRequest(
        engine_id=engine_id, layout=layout.model.to_proto(), buffers=buffers.descriptors(),
        max_batch=_values.integer("max_batch", max_batch if max_batch is not None
                                  else layout.shape.max_batch, *_values.UINT32),
        num_kv_blocks=_values.integer("num_kv_blocks", num_kv_blocks, *_values.UINT64),
        backend=backend_proto(backend),  # type: ignore[arg-type]
        device=_values.integer("device", device, *_values.INT32),
        lease_ms=_values.integer("lease_ms", lease_ms, *_values.UINT32),
        device_uuid=bytes(device_uuid))
    if select is not None:
        request.options.CopyFrom(select.to_proto())
    return request


def _step_request(step: int, rows: Iterable[Row | tuple[int, int] | tuple[int, int, int]],
                  options: SelectOptions | None, async_reply: bool) -> pb.SelectPagesRequest:
    """A step's request without its session: every input checked first (TypeError,
    ValueError naming the field and value: ``rows[1].table_row=None is not an integer``)."""
    request = pb.SelectPagesRequest(step=_values.integer("step", step, *_values.UINT64),
                                    rows=rows_proto(rows))
    if options is not None:
        if not isinstance(options, SelectOptions):
            raise TypeError(f"options={options!r} is not a SelectOptions")
        request.options.CopyFrom(options.to_proto())
    if _values.boolean("async_reply", async_reply):  # "no" is not False
        request.reply_mode = pb.REPLY_MODE_ASYNC
    return request
