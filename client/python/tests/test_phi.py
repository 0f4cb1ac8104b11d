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
