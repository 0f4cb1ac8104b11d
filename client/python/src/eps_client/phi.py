"""Φ, the per-(layer, KV head) d×m random sign matrix of the JL sketch (docs/phi.md).

Bit-exact with core/phi.h: every element is a pure function of
(seed, layer, kv_head, index), computed here with numpy uint64 arithmetic
(which wraps modulo 2^64, as the specification requires).
"""

from __future__ import annotations

import numpy as np

from eps_client import _values

GOLDEN64 = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on a uint64 array."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def phi_hash(seed: int, layer: int, kv_head: int, index: np.ndarray | int) -> np.ndarray:
    """PhiHash(seed, layer, kv_head, index) for scalar or array indices (uint64).

    Each argument is an integer of its width (core/phi.h: a uint64 seed, 16-bit layer and
    head, 32-bit index), numpy's welcome: a bool, a float or a value outside it is refused
    (TypeError, ValueError naming it) rather than wrapped or truncated into another Φ."""
    seed = _values.integer("seed", seed, *_values.UINT64)
    layer = _values.integer("layer", layer)
    kv_head = _values.integer("kv_head", kv_head)
    if not (0 <= layer < 1 << 16 and 0 <= kv_head < 1 << 16):
        raise ValueError(f"(layer, kv_head)=({layer}, {kv_head}) outside [0, 65535]")
    idx = _values.integer_array("index", index)
    if idx.size and (idx.min() < 0 or idx.max() >= 1 << 32):
        raise ValueError(f"index must be in [0, 2^32), got {idx.min()}..{idx.max()}")
    idx = idx.astype(np.uint64)
    with np.errstate(over="ignore"):
        key = mix64(np.array([(seed + GOLDEN64) & _M64], dtype=np.uint64))[0]
        counter = np.uint64((layer << 48) | (kv_head << 32)) | idx
        return mix64(key ^ (counter * np.uint64(GOLDEN64)))


def phi_scale(m: int) -> np.float32:
    """1.0f / sqrtf(float(m)), correctly rounded in float32."""
    return np.float32(1.0) / np.sqrt(np.float32(m))


def phi_matrix(seed: int, layer: int, kv_head: int, head_dim: int, sketch_dim: int) -> np.ndarray:
    """Φ of one (layer, KV head): float32 [head_dim, sketch_dim], element (i, j) = index i*m + j.
    The dimensions are integers (a bool or a float is refused, naming it, as phi_hash's are)."""
    head_dim = _values.integer("head_dim", head_dim)
    sketch_dim = _values.integer("sketch_dim", sketch_dim)
    if head_dim < 1 or sketch_dim < 1 or head_dim * sketch_dim > 1 << 31:
        raise ValueError(f"head_dim={head_dim}, sketch_dim={sketch_dim} out of range")
    h = phi_hash(seed, layer, kv_head, np.arange(head_dim * sketch_dim, dtype=np.uint64))
    s = phi_scale(sketch_dim)
    negative = (h >> np.uint64(63)).astype(bool)
    return np.where(negative, -s, s).astype(np.float32).reshape(head_dim, sketch_dim)


def phi_bank(seed: int, num_layers: int, num_kv_heads: int, head_dim: int,
             sketch_dim: int) -> np.ndarray:
    """Φ of every (layer, KV head): float32 [layers, kv_heads, d, m] (core::PhiBank)."""
    num_layers = _values.integer("num_layers", num_layers)
    num_kv_heads = _values.integer("num_kv_heads", num_kv_heads)
    if not 1 <= num_layers <= 65535 or not 1 <= num_kv_heads <= 65535:
        raise ValueError(f"num_layers={num_layers}, num_kv_heads={num_kv_heads} not in [1, 65535]")
    return np.stack([
        np.stack([phi_matrix(seed, layer, head, head_dim, sketch_dim)
                  for head in range(num_kv_heads)])
        for layer in range(num_layers)
    ])


def project(phi: np.ndarray, x: np.ndarray) -> np.ndarray:
    """z = Φᵀx for x [..., d] and Φ [d, m] (or broadcastable [..., d, m]), bit-exact with
    PhiBank::Project: float32 products accumulated in order i = 0, 1, …, d-1."""
    x = np.asarray(x, dtype=np.float32)
    d = x.shape[-1]
    z = np.zeros(x.shape[:-1] + (phi.shape[-1],), dtype=np.float32)
    for i in range(d):
        z += phi[..., i, :] * x[..., i, None]
    return z
