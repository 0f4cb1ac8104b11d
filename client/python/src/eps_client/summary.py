"""The CPU (numpy) summary writer: bit-exact with core/'s SummaryWriter (Append and Seal).

Records follow docs/summaries.md. The float32 additions happen in the order
core/summary.cc performs them (keys in order, products accumulated over i =
0..d-1), so a record built here equals core/'s bit for bit; tests check it
against the C++ writer. Vectorised over records: each key's update is applied
to all the records it touches at once, keys of one record strictly in order.
"""

from __future__ import annotations

import numpy as np

from eps_client import _values, _writer_checks
from eps_client.layout import ModelLayout, SummaryLayout, packed_index
from eps_client.phi import phi_bank, project


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """Widens bfloat16 values given as their uint16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _as_float32(keys: np.ndarray, bf16_bits: bool) -> np.ndarray:
    if bf16_bits:
        if keys.dtype != np.uint16:
            raise ValueError(
                f"bfloat16 keys must be passed as uint16 bit patterns, got {keys.dtype}")
        return bfloat16_to_float32(keys)
    if keys.dtype not in (np.float32, np.float16):
        raise ValueError(f"key dtype {keys.dtype} is not float32, float16 or bfloat16")
    return keys.astype(np.float32)  # float16 -> float32 is exact


HALF_MAX = 65504.0  # the largest binary16 value: the quest part's range


def half_down(x: np.ndarray) -> np.ndarray:
    """The largest float16 <= x (core FloatToHalfDown), for float32 x within the float16 range."""
    with np.errstate(over="ignore"):  # beyond ±65504: inf, then stepped in
        h = np.asarray(x, dtype=np.float32).astype(np.float16)  # nearest, ties to even
        return np.where(h.astype(np.float32) > x, np.nextafter(h, np.float16(-np.inf)), h)


def half_up(x: np.ndarray) -> np.ndarray:
    """The smallest float16 >= x (core FloatToHalfUp)."""
    with np.errstate(over="ignore"):  # nextafter(65504, inf) is inf, where it is not taken
        h = np.asarray(x, dtype=np.float32).astype(np.float16)
        return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def quest_halves(records: np.ndarray, lay: SummaryLayout, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Views of the quest min and max ``[..., d]`` float16 of float32 records ``[..., W]``."""
    halves = records.view(np.float16)  # [..., 2W]
    return (halves[..., 2 * lay.quest_min : 2 * lay.quest_min + d],
            halves[..., 2 * lay.quest_max : 2 * lay.quest_max + d])


def quest8_scale_for(amax: np.ndarray) -> np.ndarray:
    """The smallest power of two s >= 2^-149 with 127·s >= amax (core Quest8ScaleFor), float32;
    0 where amax is 0."""
    a = np.asarray(amax, dtype=np.float32)
    _, e = np.frexp(a)
    e = e.astype(np.int32) - 7
    e = np.where(np.ldexp(np.float32(127.0), e).astype(np.float32) < a, e + 1, e)
    s = np.ldexp(np.float32(1.0), np.maximum(e, -149)).astype(np.float32)
    return np.where(a > 0, s, np.float32(0.0)).astype(np.float32)


def quest8_parts(records: np.ndarray, lay: SummaryLayout,
                 d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of the quest8 min and max codes ``[..., d]`` int8 and the scale ``[...]`` float32
    of float32 records ``[..., W]``."""
    raw = records.view(np.int8)  # [..., 4W]
    base = 4 * lay.quest8
    return (raw[..., base : base + d], raw[..., base + d : base + 2 * d],
            records[..., lay.quest8 + d // 2])


def fold_quest8(lo: np.ndarray, hi: np.ndarray, scale: np.ndarray,
                k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Folds one key per record, k ``[..., d]`` float32, into quest8 codes ``[..., d]`` int8 and
    scales ``[...]`` (core FoldQuest8): a larger scale requantizes the codes first (floor for
    minima, ceil for maxima), so the result does not depend on the order of the keys."""
    amax = np.abs(k).max(axis=-1)
    grow = amax > np.float32(127.0) * scale
    new = np.where(grow, quest8_scale_for(amax), scale).astype(np.float32)
    lo32, hi32 = lo.astype(np.int32), hi.astype(np.int32)
    old = scale > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(old & grow, new.astype(np.float64) / np.where(old, scale, 1), 1)
    ratio = ratio[..., None]
    lo32 = np.where(ratio > 1, np.floor(lo32 / ratio), lo32).astype(np.int32)
    hi32 = np.where(ratio > 1, np.ceil(hi32 / ratio), hi32).astype(np.int32)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(new[..., None] > 0, k / np.where(new > 0, new, 1)[..., None], 0)
    # exact (a power of two) unless below the float range: then the codes follow the sign
    down = np.where(x != 0, np.floor(x), np.where(k < 0, -1, 0))
    up = np.where(x != 0, np.ceil(x), np.where(k > 0, 1, 0))
    lo32 = np.minimum(lo32, down.astype(np.int32))
    hi32 = np.maximum(hi32, up.astype(np.int32))
    return lo32.astype(np.int8), hi32.astype(np.int8), new


class SummaryWriter:
    """Writes summary records into a pool ``[slots, layers, kv_heads, record_words]`` float32.

    Immutable after construction (Φ is generated once); distinct records may be
    written from different threads.
    """

    def __init__(self, model: ModelLayout) -> None:
        self.model = model
        self.layout = SummaryLayout.for_model(model)
        self.phi = phi_bank(model.phi_seed, model.num_layers, model.num_kv_heads, model.head_dim,
                            model.sketch_dim)
        m = model.sketch_dim
        pairs = [(i, j) for i in range(m) for j in range(i, m)]
        assert [packed_index(m, i, j) for i, j in pairs] == list(range(len(pairs)))
        self._gi = np.array([i for i, _ in pairs])
        self._gj = np.array([j for _, j in pairs])

    def reset(self, records: np.ndarray) -> None:
        """Empties records ``[..., record_words]`` in place: zeros, quest min +inf, max -inf,
        quest8 min codes 127, max codes -128, scale 0. The records are checked as append checks
        a pool (float32, last dim record_words, contiguous) before anything is written."""
        lay = self.layout
        self._check_records(records)
        records[...] = 0.0
        if lay.quest_min >= 0:
            lo, hi = quest_halves(records, lay, self.model.head_dim)
            lo[...] = np.inf
            hi[...] = -np.inf
        if lay.quest8 >= 0:
            lo8, hi8, _ = quest8_parts(records, lay, self.model.head_dim)
            lo8[...] = 127
            hi8[...] = -128

    def append(self, pool: np.ndarray, layer: int, slots: np.ndarray | list[int],
               keys: np.ndarray, *, bf16_bits: bool = False,
               coarse_pool: np.ndarray | None = None,
               coarse_slots: np.ndarray | list[int] | None = None) -> None:
        """Adds keys ``[n, kv_heads, d]`` (token t to the records of ``slots[t]``, layer ``layer``).

        Tokens are added in order; several tokens may share a slot (prefill).
        With a coarse level, ``coarse_pool`` and ``coarse_slots`` (token t's coarse slot:
        ``coarse_table[row, coarse_group_of(position)]``) add the same keys to the coarse
        records too. Refuses what core's Append refuses (non-finite keys, keys beyond binary16
        with quest, keys that would take a record's sums out of the float range), bad
        indices and a pool that is read-only, before touching either pool.
        """
        if (coarse_pool is None) != (coarse_slots is None):
            raise ValueError("coarse_pool and coarse_slots go together")
        if coarse_pool is not None and coarse_slots is not None:
            if not self.model.has_coarse_level:
                raise ValueError("coarse records without a coarse level (coarse_blocks=0)")
            fine = self._prepare(pool, layer, slots, keys, bf16_bits, "slots")
            coarse = self._prepare(coarse_pool, layer, coarse_slots, keys, bf16_bits,
                                   "coarse_slots")
            self._write(pool, *fine)
            self._write(coarse_pool, *coarse)
            return
        self._write(pool, *self._prepare(pool, layer, slots, keys, bf16_bits, "slots"))

    def _prepare(self, pool: np.ndarray, layer: int, slots: np.ndarray | list[int],
                 keys: np.ndarray, bf16_bits: bool,
                 name: str) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Every check of an append into ``pool``: returns (layer, slots, float32 keys, the rank
        of each key among its slot's keys), or raises having touched nothing."""
        model, lay = self.model, self.layout
        self._check_pool(pool, "pool" if name == "slots" else "coarse_pool")
        layer = _writer_checks.layer_index(layer, model.num_layers)
        slots = _writer_checks.slot_array(name, slots, None, pool.shape[0])  # 1.9 is not slot 1
        k = _as_float32(np.asarray(keys), bf16_bits)
        if k.ndim >= 1 and name != "slots" and k.shape[0] != slots.size:
            raise ValueError(f"{slots.size} {name} for {k.shape[0]} keys")
        want = (slots.size, model.num_kv_heads, model.head_dim)
        if k.shape != want:
            raise ValueError(f"keys.shape={k.shape}, expected {want}")
        bad = np.argwhere(~np.isfinite(k))
        if bad.size:
            t, h, i = bad[0]
            raise ValueError(f"key {t} element {i} is {k[t, h, i]} (layer {layer}, kv_head {h})")
        if lay.quest_min >= 0:
            big = np.argwhere(np.abs(k) > HALF_MAX)
            if big.size:
                t, h, i = big[0]
                raise ValueError(
                    f"key {t} element {i} is {k[t, h, i]} (layer {layer}, kv_head {h}): beyond "
                    f"the binary16 range of the quest summary, |k| <= 65504")
        # Round r applies the r-th key of every slot; slots are distinct within a round.
        uniq, inv, rank = _writer_checks.ranks(slots)
        refusal = _writer_checks.float_range_refusal(pool[uniq, layer, :, lay.fro2], inv, rank, k,
                                                     layer)
        if refusal is not None:
            raise ValueError(refusal)
        return layer, slots, k, rank

    def _write(self, pool: np.ndarray, layer: int, slots: np.ndarray, k: np.ndarray,
               rank: np.ndarray) -> None:
        if slots.size == 0:
            return
        y_all = project(self.phi[layer][None], k)  # [n, H, m]
        for r in range(int(rank.max()) + 1):
            sel = np.nonzero(rank == r)[0]
            self._apply(pool, layer, slots[sel], k[sel], y_all[sel], self.layout)

    def _apply(self, pool: np.ndarray, layer: int, slots: np.ndarray, k: np.ndarray,
               y: np.ndarray, lay: SummaryLayout) -> None:
        rec = pool[slots, layer]  # [s, H, W], a copy
        rec[..., : lay.gram_words] += y[..., self._gi] * y[..., self._gj]
        norm2 = np.zeros(k.shape[:-1], dtype=np.float32)
        for i in range(k.shape[-1]):
            norm2 += k[..., i] * k[..., i]
        rec[..., lay.fro2] += norm2
        rec[..., lay.max_norm] = np.maximum(rec[..., lay.max_norm], np.sqrt(norm2))
        rec[..., lay.count] += np.float32(1.0)
        if lay.principal >= 0:
            rec[..., lay.principal + 2] = 0.0  # a principal pair describes the sealed keys only
        d = self.model.head_dim
        if lay.key_sum >= 0:
            rec[..., lay.key_sum : lay.key_sum + d] += k
        if lay.quest_min >= 0:  # float16, rounded outward: still a min and a max
            lo, hi = quest_halves(rec, lay, d)
            lo[...] = np.minimum(lo, half_down(k))
            hi[...] = np.maximum(hi, half_up(k))
        if lay.quest8 >= 0:
            lo8, hi8, _ = quest8_parts(rec, lay, d)
            lo8[...], hi8[...], rec[..., lay.quest8 + d // 2] = fold_quest8(
                lo8, hi8, rec[..., lay.quest8 + d // 2], k)
        pool[slots, layer] = rec

    def seal(self, pool: np.ndarray, layer: int, slot: int, keys: np.ndarray, *,
             bf16_bits: bool = False) -> None:
        """Fits the top-1 principal pair of a full group (core's SummaryWriter::Seal) for every
        KV head of (slot, layer). ``keys`` [n, kv_heads, d] are all the group's keys, exactly as
        appended. A no-op without features.principal."""
        model, lay = self.model, self.layout
        if lay.principal < 0:
            return
        self._check_pool(pool)
        layer, slot = _values.integer("layer", layer), _values.integer("slot", slot)
        if not 0 <= layer < model.num_layers or not 0 <= slot < pool.shape[0]:
            raise ValueError(f"(layer, slot)=({layer}, {slot}) out of range")
        k = _as_float32(np.asarray(keys), bf16_bits)
        n, d = k.shape[0], model.head_dim
        if k.shape != (n, model.num_kv_heads, d):
            raise ValueError(f"keys.shape={k.shape}, expected [n, {model.num_kv_heads}, {d}]")
        if not np.all(np.isfinite(k)):
            raise ValueError("non-finite key passed to seal")
        rec = pool[slot, layer]  # [H, W] view
        counts = rec[:, lay.count]
        if np.any(counts != np.float32(n)):
            raise ValueError(f"seal got {n} keys but the records summarise {counts.tolist()}")
        kh = np.ascontiguousarray(k.transpose(1, 0, 2))  # [H, n, d] float32
        kd = kh.astype(np.float64)
        H = kh.shape[0]
        # Power iteration in double from the longest key (the first on ties), 32 rounds.
        n2 = np.zeros((H, n))
        for i in range(d):
            n2 += kd[..., i] * kd[..., i]
        v: np.ndarray = np.zeros((H, d))
        best: np.ndarray = np.full(H, -1.0)
        for t in range(n):
            longer = n2[:, t] > best
            best = np.where(longer, n2[:, t], best)
            v[longer] = kd[longer, t]
        active = best > 0
        for _ in range(32):
            if not active.any():
                break
            dot = np.zeros((H, n))
            for i in range(d):
                dot += kd[..., i] * v[:, None, i]
            nxt = np.zeros((H, d))
            for t in range(n):
                nxt += dot[:, t, None] * kd[:, t]
            norm: np.ndarray = np.zeros(H)
            for i in range(d):
                norm += nxt[:, i] * nxt[:, i]
            norm = np.sqrt(norm)
            active &= norm != 0
            v = np.where(active[:, None], nxt / np.where(norm == 0, 1.0, norm)[:, None], v)
        # Quantise (lround: half away from zero) and measure λ1 along the dequantised direction.
        peak = np.abs(v).max(axis=1)
        ok = (peak != 0) & (n > 0)
        x = v / np.where(ok, peak, 1.0)[:, None] * 127.0
        u = (np.sign(x) * np.floor(np.abs(x) + 0.5)).astype(np.int8)
        uf = u.astype(np.float32)
        unorm2 = np.zeros(H, np.float32)
        for i in range(d):
            unorm2 += uf[:, i] * uf[:, i]
        with np.errstate(divide="ignore", invalid="ignore"):  # heads without a pair: unused
            scale = np.float32(1.0) / np.sqrt(unorm2)
            direction = uf * scale[:, None]  # u[i] * scale, float32
        lam = np.zeros(H, np.float32)
        for t in range(n):
            dot32 = np.zeros(H, np.float32)
            for i in range(d):
                dot32 += kh[:, t, i] * direction[:, i]
            lam += dot32 * dot32
        p = lay.principal
        resid = np.maximum(rec[:, lay.fro2] - lam, np.float32(0.0))
        rec[:, p] = np.where(ok, lam, 0.0)
        rec[:, p + 1] = np.where(ok, resid, 0.0)
        rec[:, p + 2] = np.where(ok, scale, 0.0)
        raw = rec.view(np.uint8)  # [H, W*4]: u1 bytes from word p + 3
        raw[:, 4 * (p + 3) : 4 * (p + 3) + d] = np.where(ok[:, None], u, 0).view(np.uint8)

    def _check_records(self, records: np.ndarray, name: str = "records") -> None:
        """Records ``[..., record_words]`` float32 whose words are contiguous: the parts are
        read and written through views of another dtype, which a strided last axis breaks.
        Writeable too: an append checks every pool it writes before writing any, so a
        read-only coarse pool must not be found only after the fine pool was written."""
        words = self.layout.record_words
        if not isinstance(records, np.ndarray) or records.dtype != np.float32 \
                or records.ndim < 1 or records.shape[-1] != words:
            raise ValueError(f"{name} must be float32 [..., {words}], got "
                             f"{getattr(records, 'dtype', type(records).__name__)} "
                             f"{list(getattr(records, 'shape', ()))}")
        if records.strides[-1] != records.itemsize:
            raise ValueError(f"{name}'s last axis must be contiguous, got a stride of "
                             f"{records.strides[-1]} bytes")
        if not records.flags.writeable:
            raise ValueError(f"{name} is read-only")

    def _check_pool(self, pool: np.ndarray, name: str = "pool") -> None:
        m = self.model
        want = (m.num_layers, m.num_kv_heads, self.layout.record_words)
        if not isinstance(pool, np.ndarray) or pool.dtype != np.float32 or pool.ndim != 4 \
                or pool.shape[1:] != want:
            raise ValueError(
                f"{name} must be float32 [slots, {want[0]}, {want[1]}, {want[2]}], got "
                f"{getattr(pool, 'dtype', type(pool).__name__)} "
                f"{list(getattr(pool, 'shape', ()))}")
        self._check_records(pool, name)
