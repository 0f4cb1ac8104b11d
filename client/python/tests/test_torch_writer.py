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
        if call >= 9:  # a large key beside channels whose quotient falls below the float range
            keys[:, :, 1:3] = 0.0
            keys[0, :, 0] = 1e17
            keys[-1, :, 1], keys[-1, :, 2] = -1e-32, 3e-33
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


@pytest.mark.parametrize(("keys", "match"), [
    (lambda: torch.ones(2, 1, 8, dtype=torch.int32), "keys.dtype=torch.int32 is not a floating"),
    (lambda: torch.ones(2, 1, 8, dtype=torch.bool), "keys.dtype=torch.bool is not a floating"),
    (lambda: np.ones((2, 1, 8), np.float32), "keys must be a torch.Tensor, not ndarray"),
])
def test_keys_that_are_no_float_tensor_are_refused_before_the_pool_is_touched(keys, match):
    """Integer and bool keys were converted to float32 and written (the numpy writer refuses
    them); numpy keys failed with an AttributeError from inside the writer."""
    model = ModelLayout(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=8)
    writer = TorchSummaryWriter(model, device="cpu")
    pool = torch.zeros(3, 1, 1, writer.layout.record_words)
    writer.reset(pool, torch.arange(3))
    before = pool.clone()
    with pytest.raises(TypeError, match=match):
        writer.append(pool, 0, [0, 1], keys())
    assert torch.equal(pool, before)


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


@pytest.mark.parametrize(("layer", "slots", "error", "message"), [
    (-1, [0, 1], ValueError, r"layer=-1 not in \[0, 2\)"),  # wrote another group's record
    (2, [0, 1], ValueError, "layer=2"),
    (0, [0, 3], ValueError, r"slots: slot out of range \[0, 3\)"),  # index_add_ out of range
    (0, [-1, 0], ValueError, "slot out of range"),
    (0, [1.9, 0.0], TypeError, "must be integers"),  # truncated to slot 1
    (0, torch.tensor([1.0, 0.0]), TypeError, "must be integers"),
])
def test_bad_layers_and_slots_are_refused_before_the_pool_is_touched(layer, slots, error,
                                                                     message):
    model = ModelLayout(num_layers=2, num_q_heads=2, num_kv_heads=2, head_dim=8)
    writer = TorchSummaryWriter(model, device="cpu")
    pool = torch.zeros(3, 2, 2, writer.layout.record_words)
    writer.reset(pool, torch.arange(3))
    before = pool.clone()
    with pytest.raises(error, match=message):
        writer.append(pool, layer, slots, torch.ones(2, 2, 8))
    assert torch.equal(pool, before)


def test_reset_checks_its_pool_and_slots():
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8)
    writer = TorchSummaryWriter(model, device="cpu")
    pool = torch.zeros(3, 1, 2, writer.layout.record_words)
    with pytest.raises(ValueError, match="slot out of range"):
        writer.reset(pool, [-1])  # wrapped to the last slot
    with pytest.raises(TypeError, match="must be integers"):
        writer.reset(pool, [1.9])
    with pytest.raises(ValueError, match="pool must be float32"):
        writer.reset(torch.zeros(3, 1, 2, 5), [0])
    assert not pool.any()


def test_a_refused_coarse_append_leaves_the_fine_pool_unchanged():
    # The fine pool was written before the coarse one failed.
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8,
                        coarse_blocks=4, features=SummaryFeatures(quest=False))
    writer = TorchSummaryWriter(model, device="cpu")
    pool = torch.zeros(2, 1, 2, writer.layout.record_words)
    coarse = torch.zeros(1, 1, 2, writer.layout.record_words)
    with pytest.raises(ValueError, match="coarse_slots: slot out of range"):
        writer.append(pool, 0, [0], torch.ones(1, 2, 8), coarse_pool=coarse, coarse_slots=[1])
    coarse[..., writer.layout.fro2] = 4e37  # d * (4e37 + 8e36) >= FLT_MAX
    with pytest.raises(ValueError, match="float range"):
        writer.append(pool, 0, [0], torch.full((1, 2, 8), 1e18), coarse_pool=coarse,
                      coarse_slots=[0])
    assert not pool.any()


@pytest.mark.parametrize(("features", "value", "n"), [
    (SummaryFeatures(key_sum=False, quest=False, quest8=True), 3e18, 1),
    (SummaryFeatures(key_sum=True, quest=False), 1e19, 1),
    (SummaryFeatures(key_sum=True, quest=False), 1e18, 5),
    (SummaryFeatures(key_sum=True, quest=False), 1e18, 6),
])
def test_the_float_range_rule_is_the_numpy_writers(features, value, n):
    # The numpy writer's decision is core's (test_summary.py); torch stored fro2=inf instead.
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8,
                        features=features)
    keys = np.full((n, 2, 8), value, np.float32)
    ref = SummaryWriter(model)
    expected = np.zeros((2, 1, 2, ref.layout.record_words), np.float32)
    ref.reset(expected)
    try:
        ref.append(expected, 0, [1] * n, keys)
        refused = None
    except ValueError as e:
        refused = str(e)
    writer = TorchSummaryWriter(model, device="cpu")
    pool = torch.zeros(expected.shape)
    writer.reset(pool, [0, 1])
    if refused is None:
        writer.append(pool, 0, [1] * n, torch.from_numpy(keys))
        assert torch.isfinite(pool).all()
    else:
        with pytest.raises(ValueError, match="float range") as e:
            writer.append(pool, 0, [1] * n, torch.from_numpy(keys))
        assert str(e.value) == refused


def test_a_key_beyond_binary16_is_named_with_its_element():
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8)
    writer = TorchSummaryWriter(model, device="cpu")
    pool = torch.zeros(2, 1, 2, writer.layout.record_words)
    keys = torch.ones(2, 2, 8)
    keys[1, 0, 6] = 7e4
    with pytest.raises(ValueError, match=r"key 1 element 6 is 70000.0 \(layer 0, kv_head 0\): "
                                         "beyond the binary16 range"):
        writer.append(pool, 0, [0, 1], keys)


def test_quest8_scale_at_the_power_of_two_edges_is_the_numpy_writers(quest8_edges):
    from eps_client.summary import quest8_scale_for
    from eps_client.torch_writer import _scale_for

    got = _scale_for(torch.from_numpy(quest8_edges)).numpy()
    assert np.array_equal(got, quest8_scale_for(quest8_edges))


def test_quest8_codes_that_read_as_a_signalling_nan_survive_an_append():
    # Minimum codes 1, 0, -100, -1 in channels 0-3 pack into the word 0xFF9C0001, a
    # signalling NaN when read as float32: the sums' update must not touch that word
    # (adding 0.0 quieted it, turning code -100 into -36).
    model = ModelLayout(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=8,
                        features=SummaryFeatures(key_sum=False, quest=False, quest8=True))
    key = np.array([[[1.0, 0.0, -100.0, -1.0, 127.0, 5.0, 6.0, 7.0]]], np.float32)
    ref = SummaryWriter(model)
    expected = np.zeros((1, 1, 1, ref.layout.record_words), np.float32)
    ref.reset(expected)
    writer = TorchSummaryWriter(model, device="cpu")
    pool = torch.zeros(expected.shape)
    writer.reset(pool, torch.arange(1))
    for _ in range(2):
        ref.append(expected, 0, [0], key)
        writer.append(pool, 0, torch.tensor([0]), torch.from_numpy(key))
    lay = ref.layout
    assert expected[0, 0, 0, lay.quest8 : lay.quest8 + 1].view(np.uint32)[0] == 0xFF9C0001
    span = slice(lay.quest8, lay.quest8 + model.head_dim // 2 + 1)
    assert pool.numpy()[..., span].tobytes() == expected[..., span].tobytes()
