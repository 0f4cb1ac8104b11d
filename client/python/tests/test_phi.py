"""Φ against the test vectors of docs/phi.md (shared with tests/core/phi_test.cc)."""

from __future__ import annotations

import numpy as np
import pytest

from eps_client.phi import phi_bank, phi_hash, phi_matrix, phi_scale

VECTORS = [
    (0, 0, 0, 0, 0x48218226FF3CD4BF, +1),
    (0, 0, 0, 1, 0x0397AB29740681D9, +1),
    (42, 3, 1, 17, 0xD24484C827FE9E72, -1),
    (42, 31, 7, 1023, 0x23451177BAC1C419, +1),
    (0xDEADBEEF, 65535, 65535, 4294967295, 0xFB6FB5EB66C208D4, -1),
    (1, 1, 0, 5, 0x88FA9F207C4DADDD, -1),
    (123456789, 12, 3, 511, 0x4DF00F40D90D3A4A, +1),
    ((1 << 64) - 1, 0, 2, 63, 0xE29B1B53F03F928C, -1),
]


@pytest.mark.parametrize(("seed", "layer", "head", "index", "expected", "sign"), VECTORS)
def test_hash_and_sign_match_the_test_vectors(seed, layer, head, index, expected, sign):
    h = int(phi_hash(seed, layer, head, index))
    assert h == expected
    assert (-1 if h >> 63 else 1) == sign


def test_sign_pattern_of_seed_42_matches_the_documented_string():
    m = phi_matrix(42, 0, 0, 4, 8).reshape(-1)
    assert "".join("-" if x < 0 else "+" for x in m) == "--+----+-+-+-+-++-+++-++++--+++-"


@pytest.mark.parametrize(("m", "bits"), [(4, 0x3F000000), (8, 0x3EB504F3), (16, 0x3E800000)])
def test_scale_is_the_correctly_rounded_float32(m, bits):
    assert np.array(phi_scale(m), dtype=np.float32).view(np.uint32) == bits


def test_bank_stacks_every_layer_and_head_in_order():
    bank = phi_bank(7, 3, 2, 16, 8)
    assert bank.shape == (3, 2, 16, 8) and bank.dtype == np.float32
    np.testing.assert_array_equal(bank[2, 1], phi_matrix(7, 2, 1, 16, 8))
    assert set(np.unique(np.abs(bank))) == {phi_scale(8)}


def test_out_of_range_coordinates_are_rejected():
    with pytest.raises(ValueError, match="layer"):
        phi_hash(0, 1 << 16, 0, 0)
    with pytest.raises(ValueError, match="index"):
        phi_hash(0, 0, 0, np.array([1 << 32], dtype=np.uint64))


@pytest.mark.parametrize(("args", "error", "message"), [
    ((-1, 0, 0, 0), ValueError, r"seed=-1 is not in \[0, 18446744073709551615\]"),
    ((np.int64(-1), 0, 0, 0), ValueError, r"seed=-1 is not in"),
    ((1 << 64, 0, 0, 0), ValueError, r"seed=18446744073709551616 is not in"),
    ((True, 0, 0, 0), TypeError, "seed=True is a bool"),
    ((1.0, 0, 0, 0), TypeError, r"seed=1.0 is not an integer"),
    ((0, 1.0, 0, 0), TypeError, r"layer=1.0 is not an integer"),
    ((0, 0, True, 0), TypeError, "kv_head=True is a bool"),
    ((0, 0, 0, -1), ValueError, "index must be in"),
    ((0, 0, 0, np.array([0.5])), TypeError, "index must be integers"),
])
def test_a_seed_or_coordinate_that_is_no_uint_of_its_width_is_refused_naming_it(args, error,
                                                                               message):
    # -1 was hashed as seed 2**64 - 1 (and np.int64(-1) raised OverflowError), True as seed
    # 1, 0.5 as index 0: each a Φ of another model, where ModelLayout refuses the value.
    with pytest.raises(error, match=message):
        phi_hash(*args)


def test_numpy_integer_seeds_hash_as_the_same_ints():
    for seed in (5, 2**63 + 7, 2**64 - 1):
        assert phi_hash(np.uint64(seed), 1, 2, 3) == phi_hash(seed, 1, 2, 3)


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: phi_matrix(0, 0, 0, True, 8), TypeError, "head_dim=True is a bool"),
    (lambda: phi_matrix(0, 0, 0, 64, 8.0), TypeError, "sketch_dim=8.0 is not an integer"),
    (lambda: phi_bank(0, True, 1, 64, 8), TypeError, "num_layers=True is a bool"),
    (lambda: phi_bank(0, 1, 2.0, 64, 8), TypeError, "num_kv_heads=2.0 is not an integer"),
])
def test_a_dimension_that_is_no_integer_is_refused_naming_it(call, error, match):
    """A bool dimension was taken as 1 (True) and a float reached numpy's arange deep inside."""
    with pytest.raises(error, match=match):
        call()


def test_numpy_integer_dimensions_give_the_same_bank():
    assert np.array_equal(phi_bank(3, np.int32(2), np.int64(1), np.uint16(16), np.int8(4)),
                          phi_bank(3, 2, 1, 16, 4))
