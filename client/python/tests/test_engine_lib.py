"""eps_client.engine without a device: the EpsKeyAppend records match the C struct and the
record addresses follow the summary pool's layout."""

from __future__ import annotations

import ctypes

import numpy as np

from eps_client import ModelLayout, SummaryLayout
from eps_client.engine import KEY_APPEND, key_appends


class CKeyAppend(ctypes.Structure):  # client/cpp/engine_capi.h, field for field
    _fields_ = [("record", ctypes.c_uint64), ("keys", ctypes.c_uint64),
                ("count", ctypes.c_int64), ("stride", ctypes.c_int64),
                ("layer", ctypes.c_int32), ("kv_head", ctypes.c_int32)]


def test_key_append_dtype_is_the_c_struct():
    assert KEY_APPEND.itemsize == ctypes.sizeof(CKeyAppend)
    for name, _ in CKeyAppend._fields_:
        assert KEY_APPEND.fields[name][1] == getattr(CKeyAppend, name).offset


def test_key_appends_address_every_layer_and_head_of_each_slot():
    model = ModelLayout(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=64)
    words = SummaryLayout.for_model(model).record_words
    slots = np.array([5, 0, 9])
    ptrs = np.arange(3 * 3 * 2, dtype=np.uint64).reshape(3, 3, 2) * 1000 + 7
    a = key_appends(model, 1 << 20, slots, ptrs, count=np.array([16, 16, 3]), stride=128)
    assert len(a) == 18
    for i, rec in enumerate(a):
        layer, n, h = i // 6, (i // 2) % 3, i % 2
        assert rec["layer"] == layer and rec["kv_head"] == h
        assert rec["record"] == (1 << 20) + ((slots[n] * 3 + layer) * 2 + h) * words * 4
        assert rec["keys"] == ptrs[layer, n, h]
        assert rec["count"] == [16, 16, 3][n] and rec["stride"] == 128
