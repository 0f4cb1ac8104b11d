"""TorchSummaryWriter writes the core/ record layout: equal to the numpy writer (which is
bit-exact with core/) up to float rounding. Needs torch; skipped without it (CI has none):
run by hand with a Python that has torch, e.g. PYTHONPATH=src python3 -m pytest tests/."""

from __future__ import annotations

import numpy as np
import pytest

from eps_client import ModelLayout, SummaryFeatures, SummaryWriter

torch = pytest.importorskip("torch")
from eps_client.torch_writer import TorchSummaryWriter  # noqa: E402


@pytest.mark.parametrize("features", [SummaryFeatures(),
                                      SummaryFeatures(key_sum=True, quest=False),
                                      SummaryFeatures(quest8=True)])
def test_records_match_the_numpy_writer(rng, features):
    model = ModelLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32,
                        phi_seed=int(rng.integers(0, 1 << 63)), features=features)
    slots = rng.integers(0, 5, 200)
    keys = rng.standard_normal((200, 2, 32)).astype(np.float32)
    ref = SummaryWriter(model)
    expected = np.zeros((5, 2, 2, ref.layout.record_words), np.float32)
    ref.reset(expected)
    ref.append(expected, 1, slots, keys)
    writer = TorchSummaryWriter(model, device="cpu")
    pool = torch.zeros(expected.shape)
    writer.reset(pool, torch.arange(5))
    writer.append(pool, 1, torch.from_numpy(slots), torch.from_numpy(keys))
    got = pool.numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3)
    lay = ref.layout
    np.testing.assert_array_equal(got[..., lay.count], expected[..., lay.count])
    if lay.quest_min >= 0:  # float16 min and max of the same floats, rounded alike: exact
        span = slice(lay.quest_min, lay.quest_min + model.head_dim)
        np.testing.assert_array_equal(got[..., span], expected[..., span])
    if lay.quest8 >= 0:  # codes and scale do not depend on the order of the keys: exact
        span = slice(lay.quest8, lay.quest8 + model.head_dim // 2 + 1)
        np.testing.assert_array_equal(got[..., span], expected[..., span])
    np.testing.assert_array_equal(writer.phi.numpy(), ref.phi)


def test_quest8_over_several_calls_equals_the_numpy_writer(rng):
    # Keys growing over calls (the scale steps up and the codes are requantized), zero keys,
    # several keys of a record in one call.
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=64,
                        phi_seed=int(rng.integers(0, 1 << 63)),
                        features=SummaryFeatures(key_sum=False, quest=False, quest8=True))
    ref = SummaryWriter(model)
    expected = np.zeros((4, 1, 2, ref.layout.record_words), np.float32)
    ref.reset(expected)
    writer = TorchSummaryWriter(model, device="cpu")
    pool = torch.zeros(expected.shape)
    writer.reset(pool, torch.arange(4))
    for call in range(12):
        n = int(rng.integers(1, 9))
        slots = rng.integers(0, 4, n)
        keys = rng.standard_normal((n, 2, 64)).astype(np.float32) * np.float32(10.0 ** (call - 4))
        keys[rng.random(n) < 0.2] = 0.0
        ref.append(expected, 0, slots, keys)
        writer.append(pool, 0, torch.from_numpy(slots), torch.from_numpy(keys))
    lay = ref.layout
    span = slice(lay.quest8, lay.quest8 + model.head_dim // 2 + 1)
    np.testing.assert_array_equal(pool.numpy()[..., span], expected[..., span])


def test_wrong_pool_shape_is_rejected():
    model = ModelLayout(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=8)
    writer = TorchSummaryWriter(model, device="cpu")
    with pytest.raises(ValueError, match="pool must be float32"):
        writer.append(torch.zeros(2, 1, 1, 3), 0, [0], torch.zeros(1, 1, 8))


@pytest.mark.parametrize("features", [SummaryFeatures(), SummaryFeatures(quest=False, quest8=True)])
def test_bad_keys_are_rejected_before_the_pool_is_touched(features):
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8,
                        features=features)
    writer = TorchSummaryWriter(model, device="cpu")
    pool = torch.zeros(3, 1, 2, writer.layout.record_words)
    writer.reset(pool, torch.arange(3))
    before = pool.clone()
    keys = torch.ones(2, 2, 8)
    keys[1, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="key 1 element 5 is nan"):
        writer.append(pool, 0, [0, 1], keys)
    assert torch.equal(pool, before)
    keys[1, 1, 5] = 1e6  # beyond binary16: refused with the 16-bit part, taken by quest8 alone
    if features.quest:
        with pytest.raises(ValueError, match="binary16"):
            writer.append(pool, 0, [0, 1], keys)
        assert torch.equal(pool, before)
    else:
        writer.append(pool, 0, [0, 1], keys)



def test_coarse_records_match_the_numpy_writer(rng):
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=32, block_size=4,
                        group_blocks=2, coarse_blocks=4,
                        phi_seed=int(rng.integers(0, 1 << 63)))
    keys = rng.standard_normal((50, 2, 32)).astype(np.float32)
    slots = np.arange(50) // model.group_tokens
    coarse_slots = np.arange(50) // (model.block_size * model.coarse_blocks)
    ref = SummaryWriter(model)
    words = ref.layout.record_words
    want_pool = np.zeros((7, 1, 2, words), np.float32)
    want_coarse = np.zeros((4, 1, 2, words), np.float32)
    ref.reset(want_pool)
    ref.reset(want_coarse)
    ref.append(want_pool, 0, slots, keys, coarse_pool=want_coarse, coarse_slots=coarse_slots)
    writer = TorchSummaryWriter(model, device="cpu")
    pool, coarse = torch.zeros(want_pool.shape), torch.zeros(want_coarse.shape)
    writer.reset(pool, torch.arange(7))
    writer.reset(coarse, torch.arange(4))
    writer.append(pool, 0, torch.from_numpy(slots), torch.from_numpy(keys), coarse_pool=coarse,
                  coarse_slots=torch.from_numpy(coarse_slots))
    np.testing.assert_allclose(pool.numpy(), want_pool, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(coarse.numpy(), want_coarse, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="3 coarse_slots for 50 keys"):
        writer.append(pool, 0, torch.from_numpy(slots), torch.from_numpy(keys),
                      coarse_pool=coarse, coarse_slots=torch.zeros(3, dtype=torch.long))
