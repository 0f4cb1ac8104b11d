"""The PyTorch Gemma 3 forward (eval/eps_eval/gemma_torch.py) against the numpy one.

Runs only where torch, gguf and the GGUF are present (CI has none of them and skips):
the GGUF at $EPS_GEMMA_GGUF, else in the harness cache ($EPS_EVAL_CACHE). 600 tokens
of GPL-3 in chunks of 256 cross the local layers' 512-token window and chunk edges.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

from eps_eval.gemma import GGUF_NAME, Gemma
from eps_eval.run_gemma import LICENCES, text


def _gguf() -> Path:
    env = os.environ.get("EPS_GEMMA_GGUF")
    if env:
        return Path(env)
    return Path(os.environ.get("EPS_EVAL_CACHE", "/nonexistent")) / GGUF_NAME


@pytest.mark.skipif(not _gguf().exists(), reason="no Gemma 3 GGUF (EPS_GEMMA_GGUF / EPS_EVAL_CACHE)")
@pytest.mark.skipif(not (LICENCES / "GPL-3").exists(), reason="no licence texts")
def test_torch_forward_matches_numpy_dense_gated_and_decoding() -> None:
    from eps_eval.gemma_torch import TorchGemma, compare

    host = Gemma(_gguf())
    m = TorchGemma(host, "cpu", "float32", chunk=256)
    ids = host.tokenizer.encode(text(("GPL-3",)))[:600]
    r = compare(host, m, ids)
    print(r)
    # float32 both ways; logits reach ~25 in magnitude.
    assert r["logits_max_abs"] < 2e-3
    assert r["gated_logits_max_abs"] < 2e-3
    assert r["decode_logits_max_abs"] < 2e-3
    assert r["argmax_agree"] == 1.0
    assert max(r["k_max_rel"], r["v_max_rel"], r["q_max_rel"], r["decode_q_max_rel"]) < 1e-4
    # The gate changes the gated positions' logits, so the gated comparison means something.
    assert r["gated_vs_dense_max_abs"] > 0.1
