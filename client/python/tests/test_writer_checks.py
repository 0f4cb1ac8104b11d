"""The torch-free checks the numpy and torch summary writers share (eps_client._writer_checks):
the torch writer's slot, layer and float-range checks run here without torch."""

from __future__ import annotations

import numpy as np
import pytest

from eps_client import _writer_checks


@pytest.mark.parametrize(("layer", "error"), [(-1, ValueError), (3, ValueError),
                                              (0.5, TypeError), (True, TypeError)])
def test_a_layer_outside_the_model_is_refused(layer, error):
    with pytest.raises(error, match="layer"):
        _writer_checks.layer_index(layer, 3)
    assert _writer_checks.layer_index(np.int64(2), 3) == 2


@pytest.mark.parametrize(("slots", "error", "message"), [
    ([-1], ValueError, r"slot out of range \[0, 4\): -1"),
    ([4], ValueError, r"slot out of range \[0, 4\): 4"),
    ([1.9], TypeError, "must be integers"),
    (np.array([True]), TypeError, "must be integers"),
    ([0, 1, 2], ValueError, "3 slots for 2 keys"),
])
def test_slots_outside_the_pool_or_not_integers_are_refused(slots, error, message):
    with pytest.raises(error, match=message):
        _writer_checks.slot_array("slots", slots, 2 if len(slots) == 3 else None, 4)
    assert _writer_checks.slot_array("slots", np.array([3, 0], np.uint8), 2, 4).tolist() == [3, 0]


def test_the_float_range_rule_counts_the_records_start_and_names_the_first_key():
    keys = np.full((3, 1, 8), 1e18, np.float32)  # each adds d * 8e36 = 6.4e37 to d * sum
    uniq, inv, rank = _writer_checks.ranks(np.array([0, 1, 0]))
    assert uniq.tolist() == [0, 1] and rank.tolist() == [0, 0, 1]
    assert _writer_checks.float_range_refusal(np.zeros((2, 1)), inv, rank, keys, 0) is None
    start = np.array([[4 * 8e36], [0.0]])  # slot 0 already holds four such keys
    message = _writer_checks.float_range_refusal(start, inv, rank, keys, 0)
    assert message is not None and message.startswith("key 2 (layer 0, kv_head 0)")
    nan_start = np.array([[np.nan], [-1.0]])  # read as 0, as core's max(0, fro2)
    assert _writer_checks.float_range_refusal(nan_start, inv, rank, keys, 0) is None
