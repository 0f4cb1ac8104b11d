"""One epsd process for the bench scripts: started on a Unix socket in a fresh temporary
folder, ready once it has printed where it listens, stopped with SIGTERM when the `with`
block ends. Also builds the inline-buffer AttachRequest those scripts send, with the
repository's Python client (client/python/src), so no shm object is involved, and hands
them its stubs (`pb`, `pb_grpc`): importing this module puts that client on sys.path."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "client" / "python" / "src"))
from eps_client.buffers import BufferLayout, BufferShape
from eps_client.layout import ModelLayout
from eps_client.proto import page_selector_pb2 as pb
from eps_client.proto import page_selector_pb2_grpc as pb_grpc

# A small model: the summary pool (inline) carries the bytes a script asks for.
MODEL = ModelLayout(num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=64)


__all__ = ["MODEL", "LocalEpsd", "inline_attach", "pb", "pb_grpc"]


def inline_attach(engine_id: str, pool_bytes: int, send_pool: bool) -> pb.AttachRequest:
    """An AttachRequest for the cpu backend whose buffers are all inline_bytes, its summary
    pool at least `pool_bytes` long: sent as data (send_pool, the message is that large) or
    declared only (empty data: epsd allocates it zeroed from a message of about 100 bytes)."""
    record_words = BufferLayout.compute(MODEL, BufferShape(1, 1, 64, 1)).record_words
    per_slot = 4 * MODEL.num_layers * MODEL.num_kv_heads * record_words  # float32 records
    slots = max(1, -(-pool_bytes // per_slot))
    layout = BufferLayout.compute(
        MODEL, BufferShape(num_slots=slots, max_seqs=4, max_context=1024, max_batch=4,
                           with_flags=False))
    buffers = layout.descriptors({"inline_bytes": pb.InlineBytes()})
    for name in layout.shapes:
        if buffers.HasField(name):
            getattr(buffers, name).offset = 0  # each inline buffer is its own allocation
    if send_pool:
        buffers.summary_pool.inline_bytes.data = bytes(slots * per_slot)
    return pb.AttachRequest(engine_id=engine_id, layout=MODEL.to_proto(), buffers=buffers,
                            max_batch=4, backend=pb.BACKEND_CPU)


class LocalEpsd:
    """epsd (`binary`) with `--listen=unix://<tmp>/epsd.sock --backend=cpu
    --metrics-listen=off` and then `flags` (later flags win)."""

    def __init__(self, binary: str, flags: list[str]) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="eps-bench-")
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            [binary, f"--listen=unix://{self._tmp.name}/epsd.sock", "--backend=cpu",
             "--metrics-listen=off", *flags],
            stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout=30) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("epsd did not start:\n" + "".join(self.lines))
        found = re.search(r"listening on (\S+)", "".join(self.lines))
        assert found
        self.target = found.group(1)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if "listening on" in line:
                self._ready.set()
        self._ready.set()  # it exited: let the constructor see it

    def status_kb(self, key: str) -> int:
        """A `kB` line of /proc/<pid>/status: VmHWM (peak resident), VmRSS."""
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        found = re.search(rf"^{key}:\s+(\d+) kB$", text, re.MULTILINE)
        if not found:
            raise RuntimeError(f"no {key} in /proc/{self.proc.pid}/status")
        return int(found.group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
