"""eps_client.cuda on two real GPUs: a region made and freed on GPU 1 from a thread that
never chose a device leaves no context on GPU 0 (test_cuda.py checks the calls with a fake
runtime; this checks what the driver sees). In a fresh process, so that nothing earlier
made GPU 0's context."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import ctypes, threading
    from eps_client.buffers import BufferShape
    from eps_client.cuda import CudaBuffers, _Runtime, load_cudart, load_driver
    from eps_client.layout import ModelLayout

    def work():
        model = ModelLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)
        shape = BufferShape(num_slots=4, max_seqs=2, max_context=256, max_batch=2)
        buffers = CudaBuffers(model, shape, device=1)
        buffers.visit_count.fill_(7)
        assert int(buffers.visit_count.sum()) == 7 * buffers.visit_count.numel()
        buffers.close()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    rt = _Runtime(load_cudart(), load_driver())
    print("gpu0", rt.primary_context_active(0), "gpu1", rt.primary_context_active(1))
""")


def test_a_region_on_gpu_one_from_a_fresh_thread_makes_no_context_on_gpu_zero():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["gpu0", "False", "gpu1", "True"], done.stdout
