"""The checks every Python summary writer (numpy, torch) makes before it writes, torch-free
so that they are tested without torch: the layer, the slots, and core's float-range rule.

Each raises as core/'s SummaryWriter refuses (ValueError for values, TypeError for types),
with a message that names the field and the value, before anything is written.
"""

from __future__ import annotations

import numpy as np

from eps_client import _values


def layer_index(layer: object, num_layers: int) -> int:
    """``layer`` as an int in [0, num_layers): -1 is not the last layer."""
    out = _values.integer("layer", layer)
    if not 0 <= out < num_layers:
        raise ValueError(f"layer={out} not in [0, {num_layers})")
    return out


def slot_array(name: str, slots: object, n: int | None, num_slots: int) -> np.ndarray:
    """``slots`` as int64 [n] in [0, num_slots): floats and bools refused (1.9 is not slot 1),
    negative slots too (-1 is not the last slot). ``n`` None: any count."""
    out = _values.integer_array(name, slots).reshape(-1)
    if n is not None and out.size != n:
        raise ValueError(f"{out.size} {name} for {n} keys")
    if out.size and (out.min() < 0 or out.max() >= num_slots):
        raise ValueError(f"{name}: slot out of range [0, {num_slots}): {out.min()}..{out.max()}")
    return out


def float_range_refusal(fro2: np.ndarray, inv: np.ndarray, rank: np.ndarray, keys: np.ndarray,
                        layer: int) -> str | None:
    """core's rule (core/summary.cc CheckKeys): a record's d·Σ‖k‖², in double from the
    record's fro2 (``fro2`` [u, H], a record's start; NaN or negative read as 0) and adding
    its keys in order, element by element, must stay below FLT_MAX (every Gram term is
    bounded by it). ``inv`` [n] is key t's record row in ``fro2``, ``rank`` [n] its place
    among that record's keys, ``keys`` [n, H, d]. Returns the message of the first key that
    breaks the rule, or None."""
    if inv.size == 0:
        return None
    d = keys.shape[-1]
    start = np.asarray(fro2, dtype=np.float64)
    acc = np.where(start > 0, start, 0.0)  # std::max(0.0f, fro2)
    k64 = np.asarray(keys, dtype=np.float64)
    # Far below the limit (a bound with room for rounding): nothing to replay.
    if (acc.max(initial=0.0) + float(np.sum(k64 * k64))) * d < _values.FLOAT32_MAX * (1 - 1e-9):
        return None
    for r in range(int(rank.max()) + 1):
        sel = np.nonzero(rank == r)[0]
        a = acc[inv[sel]]
        for i in range(d):
            a = a + k64[sel, :, i] * k64[sel, :, i]
        acc[inv[sel]] = a
        over = np.argwhere(a * d >= _values.FLOAT32_MAX)
        if over.size:
            j, h = over[0]
            return (f"key {sel[j]} (layer {layer}, kv_head {h}) brings the record's sum of "
                    f"squared key norms to {a[j, h]}: its sums would leave the float range "
                    f"(d * sum must stay below {_values.FLOAT32_MAX})")
    return None


def ranks(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unique slots [u], each key's row in them [n], each key's rank among its slot's keys
    [n]): round r of a writer applies the r-th key of every slot."""
    uniq, inv = np.unique(slots, return_inverse=True)
    order = np.argsort(slots, kind="stable")
    sorted_slots = slots[order]
    first = np.searchsorted(sorted_slots, sorted_slots, side="left")
    rank = np.empty_like(slots)
    rank[order] = np.arange(slots.size) - first
    return uniq, inv.reshape(-1), rank
