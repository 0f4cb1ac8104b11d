"""The numpy SummaryWriter equals core/'s SummaryWriter bit for bit (via eps_core_reference)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from eps_client.layout import (
    ModelLayout,
    SummaryFeatures,
    SummaryLayout,
    coarse_group_of,
    coarse_groups_for,
)
from eps_client.summary import (
    SummaryWriter,
    half_down,
    half_up,
    quest8_parts,
    quest8_scale_for,
    quest_halves,
)


def core_pool(tool: str, tmp: Path, model: ModelLayout, slots: int,
              ops: list[tuple[int, int, np.ndarray]], dtype: str,
              seals: list[int] | None = None) -> np.ndarray:
    """Runs core/'s writer on ops (layer, slot, keys [count, H, d]); op j is a Seal when
    j is in ``seals``, else an Append. Returns core/'s pool."""
    seals = seals or []
    (tmp / "ops.txt").write_text("".join(f"{ly} {s} {k.shape[0]} {int(j in seals)}\n"
                                         for j, (ly, s, k) in enumerate(ops)))
    with open(tmp / "keys.bin", "wb") as f:
        for _, _, k in ops:
            f.write(np.ascontiguousarray(k).tobytes())
    f = model.features
    subprocess.run([tool, "summaries", str(model.num_layers), str(model.num_kv_heads),
                    str(model.head_dim), str(model.sketch_dim), str(model.phi_seed),
                    str(int(f.key_sum)), str(int(f.quest)), str(int(f.principal)),
                    str(int(f.quest8)), str(slots),
                    dtype,
                    str(tmp / "ops.txt"), str(tmp / "keys.bin"), str(tmp / "pool.bin")],
                   check=True)
    words = SummaryLayout.for_model(model).record_words
    raw = np.fromfile(tmp / "pool.bin", dtype=np.float32)
    return raw.reshape(slots, model.num_layers, model.num_kv_heads, words)


def random_keys(rng: np.random.Generator, n: int, model: ModelLayout) -> np.ndarray:
    # Heavy-tailed, with outlier channels, like real keys.
    k = rng.standard_normal((n, model.num_kv_heads, model.head_dim)).astype(np.float32)
    k[..., rng.integers(0, model.head_dim, 3)] *= 20
    return k


@pytest.mark.parametrize("features", [SummaryFeatures(), SummaryFeatures(key_sum=False),
                                      SummaryFeatures(key_sum=True, quest=False),
                                      SummaryFeatures(quest8=True),
                                      SummaryFeatures(key_sum=False, quest=False, quest8=True)])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_records_equal_core_bit_for_bit(core_reference, tmp_path, rng, features, m):
    model = ModelLayout(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=64, sketch_dim=m,
                        phi_seed=int(rng.integers(0, 1 << 63)), features=features)
    slots = 5
    ops = [(int(rng.integers(0, 3)), int(rng.integers(0, slots)),
            random_keys(rng, int(rng.integers(0, 20)), model)) for _ in range(25)]
    expected = core_pool(core_reference, tmp_path, model, slots, ops, "f32")
    writer = SummaryWriter(model)
    pool = np.zeros_like(expected)
    writer.reset(pool)
    for layer, slot, keys in ops:
        writer.append(pool, layer, [slot] * keys.shape[0], keys)
    assert pool.tobytes() == expected.tobytes()


def test_prefill_with_interleaved_slots_equals_core_per_slot_appends(core_reference, tmp_path,
                                                                     rng):
    model = ModelLayout(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=128,
                        phi_seed=int(rng.integers(0, 1 << 63)),
                        features=SummaryFeatures(quest8=True))
    slots = 6
    token_slots = rng.integers(0, slots, 300)
    keys = random_keys(rng, 300, model)
    # core/ sees each slot's keys in token order, slot by slot.
    ops = [(1, s, keys[token_slots == s]) for s in range(slots)]
    expected = core_pool(core_reference, tmp_path, model, slots, ops, "f32")
    pool = np.zeros_like(expected)
    writer = SummaryWriter(model)
    writer.reset(pool)
    writer.append(pool, 1, token_slots, keys)
    assert pool.tobytes() == expected.tobytes()


def test_quest8_scale_steps_and_zero_keys_equal_core_bit_for_bit(core_reference, tmp_path, rng):
    # Magnitudes from 1e-3 to 1e4 one key at a time (the scale steps up by one and by
    # many powers of two, requantizing the codes each time), zero keys among them.
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=64,
                        phi_seed=int(rng.integers(0, 1 << 63)),
                        features=SummaryFeatures(key_sum=False, quest=False, quest8=True))
    n = 60
    keys = random_keys(rng, n, model) * np.logspace(-3, 4, n, dtype=np.float32)[:, None, None]
    keys[::7] = 0.0
    keys = keys[rng.permutation(n)]
    # A large key first, then two channels whose quotient by its scale falls below the
    # float range (they rounded to 0: codes 0 for keys of either sign).
    keys[0, :, 0] = 1e17
    keys[:, :, 1:3] = 0.0
    keys[-1, :, 1], keys[-2, :, 2] = -1e-32, 3e-33
    ops = [(0, 1, keys[t : t + 1]) for t in range(n)]
    expected = core_pool(core_reference, tmp_path, model, 2, ops, "f32")
    writer = SummaryWriter(model)
    pool = np.zeros_like(expected)
    writer.reset(pool)
    for t in range(n):
        writer.append(pool, 0, [1], keys[t : t + 1])
    assert pool.tobytes() == expected.tobytes()
    lo, hi, scale = quest8_parts(pool[1, 0], writer.layout, 64)
    assert np.all(lo.astype(np.float32) * scale[:, None] <= keys.min(axis=0))
    assert np.all(hi.astype(np.float32) * scale[:, None] >= keys.max(axis=0))
    assert np.all(scale == quest8_scale_for(np.abs(keys).max(axis=(0, 2))))


def plain_quest8_scale(a: float) -> float:
    """The definition itself, in exact float64 arithmetic: the smallest power of two
    s >= 2^-149 with 127·s >= a."""
    e = -149
    while 127.0 * 2.0**e < a:
        e += 1
    return 2.0**e


def test_quest8_scale_at_the_power_of_two_edges_is_the_definition(quest8_edges):
    a = quest8_edges
    expected = np.array([plain_quest8_scale(float(x)) for x in a], dtype=np.float32)
    assert np.array_equal(quest8_scale_for(a), expected)
    assert quest8_scale_for(np.zeros(1, np.float32))[0] == 0.0


def test_quest8_records_at_the_power_of_two_edges_equal_core_bit_for_bit(core_reference,
                                                                       tmp_path, rng,
                                                                       quest8_edges):
    # One group per slot whose largest |k| is 127·2^e, or the float32 just below or above it,
    # in a random channel and sign, the other keys smaller: core's scale and codes exactly.
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=64,
                        phi_seed=int(rng.integers(0, 1 << 63)),
                        features=SummaryFeatures(key_sum=False, quest=False, quest8=True))
    # keys past ~3e18 overflow the records' header sums
    edges = quest8_edges[quest8_edges <= 1e17]
    picks = edges[rng.choice(edges.size, size=24, replace=False)]
    ops = []
    for slot, amax in enumerate(picks):
        keys = (random_keys(rng, 3, model) * 0.1 * amax).astype(np.float32)
        keys = np.clip(keys, -0.99 * amax, 0.99 * amax).astype(np.float32)
        t, h, c = rng.integers(0, 3), rng.integers(0, 2), rng.integers(0, 64)
        keys[t, h, c] = amax if rng.integers(0, 2) else -amax
        ops.append((0, slot, keys))
    expected = core_pool(core_reference, tmp_path, model, len(picks), ops, "f32")
    writer = SummaryWriter(model)
    pool = np.zeros_like(expected)
    writer.reset(pool)
    for _, slot, keys in ops:
        writer.append(pool, 0, [slot] * keys.shape[0], keys)
    assert pool.tobytes() == expected.tobytes()


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_precision_keys_equal_core_bit_for_bit(core_reference, tmp_path, rng, dtype):
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=32,
                        phi_seed=int(rng.integers(0, 1 << 63)))
    f32 = random_keys(rng, 40, model)
    if dtype == "f16":
        keys = f32.astype(np.float16)
    else:
        keys = (f32.view(np.uint32) >> np.uint32(16)).astype(np.uint16)  # truncated bf16 bits
    expected = core_pool(core_reference, tmp_path, model, 2, [(0, 1, keys)], dtype)
    pool = np.zeros_like(expected)
    writer = SummaryWriter(model)
    writer.reset(pool)
    writer.append(pool, 0, [1] * 40, keys, bf16_bits=dtype == "bf16")
    assert pool.tobytes() == expected.tobytes()


@pytest.mark.parametrize("d", [64, 30 * 4 + 2 * 2])
def test_sealed_principal_pairs_equal_core_bit_for_bit(core_reference, tmp_path, rng, d):
    model = ModelLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=d,
                        phi_seed=int(rng.integers(0, 1 << 63)),
                        features=SummaryFeatures(key_sum=True, quest=True, principal=True))
    ops, seals = [], []
    groups = [(0, 0, 64), (1, 0, 128), (0, 2, 1), (1, 3, 0), (0, 1, 40)]
    for layer, slot, n in groups:
        keys = random_keys(rng, n, model)
        keys[:, :, 0] += rng.standard_normal() * 10  # a dominant direction
        ops.append((layer, slot, keys))
        seals.append(len(ops))
        ops.append((layer, slot, keys))  # Seal with all the group's keys
    ops.append((0, 1, random_keys(rng, 3, model)))  # a later Append clears the pair's scale
    expected = core_pool(core_reference, tmp_path, model, 4, ops, "f32", seals)
    writer = SummaryWriter(model)
    pool = np.zeros_like(expected)
    writer.reset(pool)
    for j, (layer, slot, keys) in enumerate(ops):
        if j in seals:
            writer.seal(pool, layer, slot, keys)
        else:
            writer.append(pool, layer, [slot] * keys.shape[0], keys)
    assert pool.tobytes() == expected.tobytes()
    p = writer.layout.principal
    assert pool[0, 0, :, p + 2].all() and not pool[1, 0, :, p + 2].any()


def test_seal_with_the_wrong_key_count_is_rejected():
    model = ModelLayout(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=8,
                        features=SummaryFeatures(principal=True))
    writer = SummaryWriter(model)
    pool = np.zeros((1, 1, 1, writer.layout.record_words), np.float32)
    writer.append(pool, 0, [0, 0], np.ones((2, 1, 8), np.float32))
    with pytest.raises(ValueError, match="seal got 3 keys"):
        writer.seal(pool, 0, 0, np.ones((3, 1, 8), np.float32))


def test_one_key_at_a_time_equals_one_call():
    rng = np.random.default_rng(3)
    model = ModelLayout(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=16)
    keys = random_keys(rng, 17, model)
    writer = SummaryWriter(model)
    words = writer.layout.record_words
    a = np.zeros((1, 1, 1, words), np.float32)
    b = np.zeros_like(a)
    writer.append(a, 0, [0] * 17, keys)
    for t in range(17):
        writer.append(b, 0, [0], keys[t : t + 1])
    assert a.tobytes() == b.tobytes()


def test_non_finite_key_is_rejected_and_leaves_the_pool_unchanged():
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8)
    writer = SummaryWriter(model)
    pool = np.zeros((2, 1, 2, writer.layout.record_words), np.float32)
    keys = np.ones((3, 2, 8), np.float32)
    keys[2, 1, 5] = np.nan
    with pytest.raises(ValueError, match=r"key 2 element 5 is nan \(layer 0, kv_head 1\)"):
        writer.append(pool, 0, [0, 1, 0], keys)
    assert not pool.any()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"layer": 1}, "layer=1"),
    ({"slots": [0, 7]}, "slot out of range"),
    ({"keys": np.ones((2, 2, 4), np.float32)}, "keys.shape"),
    ({"keys": np.ones((2, 2, 8), np.int32)}, "key dtype"),
])
def test_bad_arguments_get_a_clear_error(kwargs, message):
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8)
    writer = SummaryWriter(model)
    pool = np.zeros((2, 1, 2, writer.layout.record_words), np.float32)
    args = {"layer": 0, "slots": [0, 1], "keys": np.ones((2, 2, 8), np.float32)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        writer.append(pool, args["layer"], args["slots"], args["keys"])


def test_layout_offsets_match_the_documented_worked_example():
    def words(**f: bool) -> int:
        model = ModelLayout(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=128,
                            features=SummaryFeatures(**f))
        return SummaryLayout.for_model(model).record_words
    assert words(key_sum=False, quest=False) == 40
    assert words(quest=False) == 168
    assert words(principal=True, quest=False) == 204
    assert words(quest=True, principal=True) == 332  # quest: 128 words of float16 min and max


def test_quest_halves_round_outward_and_reject_keys_beyond_float16(rng):
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=16,
                        features=SummaryFeatures(key_sum=False, quest=True))
    writer = SummaryWriter(model)
    lay = writer.layout
    pool = np.zeros((1, 1, 2, lay.record_words), np.float32)
    writer.reset(pool)
    keys = (rng.standard_normal((9, 2, 16)) * 10).astype(np.float32)
    writer.append(pool, 0, [0] * 9, keys)
    lo, hi = quest_halves(pool[0, 0], lay, 16)
    true_lo, true_hi = keys.min(axis=0), keys.max(axis=0)
    assert np.all(lo.astype(np.float32) <= true_lo) and np.all(hi.astype(np.float32) >= true_hi)
    # the nearest float16 on the outward side: one step inward crosses the true value
    assert np.all(np.nextafter(lo, np.float16(np.inf)).astype(np.float32) > true_lo)
    assert np.all(np.nextafter(hi, np.float16(-np.inf)).astype(np.float32) < true_hi)
    keys[4, 1, 7] = 7e4
    with pytest.raises(ValueError, match="key 4 element 7 is 70000.0 .*binary16 range"):
        writer.append(pool, 0, [0] * 9, keys)


def test_directed_float16_rounding_at_zero_and_the_range_ends():
    x = np.array([0.0, -1e-9, 1e-9, 7e4, -7e4], np.float32)
    assert half_down(x).view(np.uint16).tolist() == [0x0000, 0x8001, 0x0000, 0x7BFF, 0xFC00]
    assert half_up(x).view(np.uint16).tolist() == [0x0000, 0x8000, 0x0001, 0x7C00, 0xFBFF]


def test_coarse_records_equal_the_keys_of_each_coarse_group_appended_alone(rng):
    model = ModelLayout(num_layers=2, num_q_heads=2, num_kv_heads=2, head_dim=16, block_size=4,
                        group_blocks=2, coarse_blocks=6,
                        features=SummaryFeatures(quest8=True))
    writer = SummaryWriter(model)
    words = writer.layout.record_words
    tokens = 61  # 16 blocks: coarse groups of 24, 24 and 13 tokens
    keys = random_keys(rng, tokens, model)
    pool = np.zeros((8, 2, 2, words), np.float32)
    coarse = np.zeros((3, 2, 2, words), np.float32)
    writer.reset(pool)
    writer.reset(coarse)
    positions = np.arange(tokens)
    slots = positions // model.group_tokens
    coarse_table = np.array([2, 0, 1])  # coarse group -> coarse slot
    coarse_slots = coarse_table[coarse_group_of(positions, model)]
    writer.append(pool, 1, slots, keys, coarse_pool=coarse, coarse_slots=coarse_slots)
    fine_only = np.zeros_like(pool)
    writer.reset(fine_only)
    writer.append(fine_only, 1, slots, keys)
    assert pool.tobytes() == fine_only.tobytes()
    for c, (begin, end) in enumerate([(0, 24), (24, 48), (48, 61)]):
        alone = np.zeros((1, 2, 2, words), np.float32)
        writer.reset(alone)
        writer.append(alone, 1, [0] * (end - begin), keys[begin:end])
        assert coarse[coarse_table[c], 1].tobytes() == alone[0, 1].tobytes(), c
    assert coarse_groups_for(tokens, model) == 3


def test_bad_coarse_arguments_leave_both_pools_unchanged():
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8,
                        coarse_blocks=4)
    writer = SummaryWriter(model)
    pool = np.zeros((2, 1, 2, writer.layout.record_words), np.float32)
    coarse = np.zeros((1, 1, 2, writer.layout.record_words), np.float32)
    keys = np.ones((2, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"coarse_slots: slot out of range \[0, 1\)"):
        writer.append(pool, 0, [0, 1], keys, coarse_pool=coarse, coarse_slots=[0, 1])
    with pytest.raises(ValueError, match="1 coarse_slots for 2 keys"):
        writer.append(pool, 0, [0, 1], keys, coarse_pool=coarse, coarse_slots=[0])
    with pytest.raises(ValueError, match="go together"):
        writer.append(pool, 0, [0, 1], keys, coarse_pool=coarse)
    bad = keys.copy()
    bad[1, 0, 3] = np.inf
    with pytest.raises(ValueError, match="key 1 element 3 is inf"):
        writer.append(pool, 0, [0, 1], bad, coarse_pool=coarse, coarse_slots=[0, 0])
    assert not pool.any() and not coarse.any()
    flat = SummaryWriter(ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="without a coarse level"):
        flat.append(pool, 0, [0, 1], keys, coarse_pool=coarse, coarse_slots=[0, 0])


@pytest.mark.parametrize("read_only", ["pool", "coarse_pool"])
def test_a_read_only_pool_is_refused_before_either_pool_is_written(read_only):
    # A read-only coarse pool was found only when its write failed, after the fine pool had
    # taken the keys: a retry then appended them to the fine records twice.
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8,
                        coarse_blocks=4)
    writer = SummaryWriter(model)
    pools = {"pool": np.zeros((2, 1, 2, writer.layout.record_words), np.float32),
             "coarse_pool": np.zeros((1, 1, 2, writer.layout.record_words), np.float32)}
    for p in pools.values():
        writer.reset(p)
    before = {name: p.copy() for name, p in pools.items()}
    pools[read_only].flags.writeable = False
    with pytest.raises(ValueError, match=f"^{read_only} is read-only$"):
        writer.append(pools["pool"], 0, [0, 1], np.ones((2, 2, 8), np.float32),
                      coarse_pool=pools["coarse_pool"], coarse_slots=[0, 0])
    for name, p in pools.items():
        assert p.tobytes() == before[name].tobytes(), name


def test_a_bad_coarse_level_is_refused_naming_it():
    with pytest.raises(ValueError, match="coarse_blocks=3 must be 0"):
        ModelLayout(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=4, group_blocks=2,
                    coarse_blocks=3)
    with pytest.raises(ValueError, match="coarse_blocks=2 must be 0"):
        ModelLayout(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=4, group_blocks=2,
                    coarse_blocks=2)
    assert ModelLayout(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=4,
                       coarse_blocks=8).to_proto().coarse_blocks == 8


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"slots": [1.9, 0.0]}, TypeError, "slots must be integers, got dtype float64"),
    ({"slots": np.array([1.0, 0.0], np.float32)}, TypeError, "got dtype float32"),
    ({"slots": [True, False]}, TypeError, "got dtype bool"),
    ({"slots": np.array([2**64 - 1, 0], np.uint64)}, ValueError, "beyond int64"),
    ({"layer": 0.5}, TypeError, "layer=0.5 is not an integer"),
    ({"layer": True}, TypeError, "layer=True is a bool"),
    ({"layer": None}, TypeError, "layer=None is not an integer"),
])
def test_slots_and_layers_that_are_not_integers_are_refused_not_truncated(kwargs, error,
                                                                          message):
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8)
    writer = SummaryWriter(model)
    pool = np.zeros((2, 1, 2, writer.layout.record_words), np.float32)
    args = {"layer": 0, "slots": [0, 1], "keys": np.ones((2, 2, 8), np.float32), **kwargs}
    with pytest.raises(error, match=message):
        writer.append(pool, args["layer"], args["slots"], args["keys"])
    assert not pool.any()
    writer.append(pool, np.int64(0), np.array([1, 0], np.uint8), args["keys"])  # integers
    assert pool.any()


@pytest.mark.parametrize("records", [
    np.zeros((2, 1, 2, 56)),                               # float64
    np.zeros((2, 1, 2, 56), np.int32),
    np.zeros((2, 1, 2, 48), np.float32),                   # not record_words
    np.zeros((2, 1, 2, 112), np.float32)[..., ::2],         # strided last axis
    np.zeros((2, 1, 2, 56), np.float32).astype(">f4"),     # big-endian
])
def test_reset_checks_the_records_as_append_checks_a_pool(records):
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8)
    writer = SummaryWriter(model)
    assert writer.layout.record_words == 56
    before = records.copy()
    with pytest.raises(ValueError, match="records"):
        writer.reset(records)
    assert np.array_equal(records, before)  # nothing written
    pool = np.zeros((2, 1, 2, 56), np.float32)
    writer.reset(pool[1])  # any leading shape
    assert pool[1].any() and not pool[0].any()


def core_refusal(tool: str, tmp: Path, model: ModelLayout, slots: int,
                 ops: list[tuple[int, int, np.ndarray]]) -> str | None:
    """core/'s message when its writer refuses one of ``ops`` (all appends), else None."""
    try:
        core_pool(tool, tmp, model, slots, ops, "f32")
    except subprocess.CalledProcessError as e:
        return str(e.stderr or e.returncode)
    return None


@pytest.mark.parametrize(("features", "value", "keys_per_op", "refused"), [
    (SummaryFeatures(key_sum=False, quest=False, quest8=True), 3e18, 1, True),
    (SummaryFeatures(key_sum=True, quest=False), 1e19, 1, True),
    (SummaryFeatures(key_sum=True, quest=False), 1e18, 5, False),  # 64e36 * 5 < FLT_MAX
    (SummaryFeatures(key_sum=True, quest=False), 1e18, 6, True),   # 64e36 * 6 >= FLT_MAX
])
def test_keys_beyond_the_float_range_of_the_sums_are_refused_as_core_refuses_them(
        core_reference, tmp_path, features, value, keys_per_op, refused):
    # numpy stored fro2 = 7.2e37 (quest8 only, 3e18) or inf (key_sum, 1e19) where core refuses.
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8,
                        features=features)
    writer = SummaryWriter(model)
    one = np.full((1, 2, 8), value, np.float32)
    ops = [(0, 1, one)] * keys_per_op
    assert (core_refusal(core_reference, tmp_path, model, 2, ops) is not None) == refused
    pool = np.zeros((2, 1, 2, writer.layout.record_words), np.float32)
    writer.reset(pool)
    one_call = pool.copy()
    for j in range(keys_per_op):  # one key a call: the record's fro2 counts
        if refused and j == keys_per_op - 1:
            before = pool.copy()
            with pytest.raises(ValueError, match="float range"):
                writer.append(pool, 0, [1], one)
            assert np.array_equal(pool, before)
        else:
            writer.append(pool, 0, [1], one)
    if not refused:
        assert pool.tobytes() == core_pool(core_reference, tmp_path, model, 2, ops, "f32").tobytes()
    keys = np.repeat(one, keys_per_op, axis=0)  # all in one call
    if refused:
        with pytest.raises(ValueError, match=f"key {keys_per_op - 1} .*float range"):
            writer.append(one_call, 0, [1] * keys_per_op, keys)
    else:
        writer.append(one_call, 0, [1] * keys_per_op, keys)
        assert one_call.tobytes() == pool.tobytes()


def test_a_coarse_pool_beyond_the_float_range_leaves_the_fine_pool_unchanged():
    # The fine pool was written before the coarse pool's checks ran.
    model = ModelLayout(num_layers=1, num_q_heads=2, num_kv_heads=2, head_dim=8,
                        coarse_blocks=4, features=SummaryFeatures(quest=False))
    writer = SummaryWriter(model)
    pool = np.zeros((2, 1, 2, writer.layout.record_words), np.float32)
    coarse = np.zeros((1, 1, 2, writer.layout.record_words), np.float32)
    coarse[..., writer.layout.fro2] = 4e37  # its old keys: d * (4e37 + 8e36) >= FLT_MAX
    keys = np.full((1, 2, 8), 1e18, np.float32)
    with pytest.raises(ValueError, match="float range"):
        writer.append(pool, 0, [0], keys, coarse_pool=coarse, coarse_slots=[0])
    assert not pool.any()
