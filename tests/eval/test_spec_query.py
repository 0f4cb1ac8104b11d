"""The speculative query (eps_eval.run_lowrank --spec): a layer's query computed from the
residual stream entering an earlier layer. `query_from` on the layer's own input must give
the queries the prefill computed, for both forwards (random weights of a tiny shape, no
GGUF), and the residual a prefill records must be the one that layer read."""

from __future__ import annotations

import numpy as np
from eps_eval import gemma, model


def _tiny_gemma(rng: np.random.Generator) -> gemma.Gemma:
    m = gemma.Gemma.__new__(gemma.Gemma)
    m.cfg = gemma.Config(layers=6, hidden=16, heads=2, kv_heads=1, head_dim=8, eps=1e-6,
                         window=4, context=64)
    h, d, ffn = 16, 8, 12
    shapes = {"attn_norm.weight": (h,), "attn_q.weight": (2 * d, h), "attn_k.weight": (d, h),
              "attn_v.weight": (d, h), "attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,),
              "attn_output.weight": (h, 2 * d), "post_attention_norm.weight": (h,),
              "ffn_norm.weight": (h,), "ffn_gate.weight": (ffn, h), "ffn_up.weight": (ffn, h),
              "ffn_down.weight": (h, ffn), "post_ffw_norm.weight": (h,)}
    m.w = {f"blk.{i}.{n}": rng.standard_normal(s).astype(np.float32) * 0.5
           for i in range(6) for n, s in shapes.items()}
    m.embed = rng.standard_normal((50, h)).astype(np.float32)
    return m


def _tiny_llama(rng: np.random.Generator) -> model.Model:
    m = model.Model.__new__(model.Model)
    m.cfg = model.Config(layers=3, hidden=16, heads=4, kv_heads=2, head_dim=4, ffn=12,
                         rope_base=1e4, eps=1e-5, context=64, vocab=50)
    h, ffn = 16, 12
    shapes = {"attn_norm.weight": (h,), "attn_q.weight": (h, h), "attn_k.weight": (8, h),
              "attn_v.weight": (8, h), "attn_output.weight": (h, h), "ffn_norm.weight": (h,),
              "ffn_gate.weight": (ffn, h), "ffn_up.weight": (ffn, h), "ffn_down.weight": (h, ffn)}
    m.w = {f"blk.{i}.{n}": rng.standard_normal(s).astype(np.float32) * 0.5
           for i in range(3) for n, s in shapes.items()}
    m.embed = m.out = rng.standard_normal((50, h)).astype(np.float32)
    return m


def test_gemma_query_from_own_input_is_the_prefill_query(rng: np.random.Generator) -> None:
    m = _tiny_gemma(rng)
    tokens = [int(t) for t in rng.integers(0, 50, 20)]
    qpos = [7, 13, 19]
    tr = m.prefill(tokens, qpos, [], resid_layers={4, 5})
    assert set(tr.x) == {4, 5}
    assert tr.x[4].shape == (3, 16)
    got = m.query_from(5, tr.x[5], qpos)
    want = np.stack([tr.q[5][p] for p in qpos])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The layer before's input gives another query (the residual moved through layer 4).
    assert np.abs(m.query_from(5, tr.x[4], qpos) - want).max() > 1e-3


def test_llama_query_from_own_input_is_the_prefill_query(rng: np.random.Generator) -> None:
    m = _tiny_llama(rng)
    tokens = [int(t) for t in rng.integers(0, 50, 20)]
    qpos = [5, 19]
    tr = m.prefill(tokens, qpos, [], resid_layers={0, 2})
    assert set(tr.x) == {0, 2}
    for L in (0, 2):
        got = m.query_from(L, tr.x[L], qpos)
        np.testing.assert_allclose(got, np.stack([tr.q[p][L] for p in qpos]), rtol=1e-5, atol=1e-5)
    # Layer 0's input is the embedding.
    np.testing.assert_array_equal(tr.x[0], m.embed[[tokens[p] for p in qpos]])
