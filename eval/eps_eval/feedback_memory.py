"""Selection feedback with memory, simulated step by step in the harness (issue 19).

Selection feedback (docs/policy-selection.md): the attention of step t−1 reports, for every
block it visited, √d·log Σ exp(q·k/√d) under that step's query; step t, whose selection
reads the same (lag-1) query, ranks those blocks by it and every other block by its estimate
plus the head's median of (exact − estimate) over the fed candidate blocks. epsd consumes the
entries after one step. This module keeps them longer and asks whether that helps:

  K = 1        today's rule, but in its steady state: every list was itself chosen with
               feedback (the harness's fb- rows chose the previous list without it).
  K, old       a block visited at one of steps t−K … t−2 (not t−1) is ranked by its latest
               exact value, a log share of the attention of that step's list (the engine
               knows the list's total), whatever its coarse group; no rescaling: shares
               of one head drift slowly.
  K, oldmax    as old, but a candidate block takes max(old value, estimate + offset), so
               a block whose estimate rose is not held back by its old value.
  K, resid     a candidate block keeps the estimator's error instead of the value: when a
               fed block is scored at t, resid = exact − estimate − offset (its deviation
               from the head's median correction) is kept, and within K steps the block
               scores estimate + offset + resid, under the current query; blocks without
               a residual fall back to old.

  K = 0        no feedback (the c2f rows' rule), per-head top n or (union) the list-level rule.
  rot, rotunion  K = 1 (per-head top n, or the list-level rule of union_scores) with the
               estimates under the lag-1 query moved on one position by RoPE (q rotated by
               one position's angles, which is what RoPE does to a query between positions
               t−1 and t); the fed values stay the lag-1 query's.

The simulation runs the selection recursively from `warmup` positions before the first
measured one (each step's list decides what the next is fed), over the keys of that step,
for every budget of the sweep separately. Memory is charged per (block, KV head) as one
stamp byte and fp16 values for each query head of the KV head (`ENTRY_BYTES`); one-step
feedback (K = 1) is not charged, as the fb- and epsd-fb- rows are not.

Ceilings (no summary bytes, every block's exact mass known): maxlag{K} ranks each block by
its largest log share under the queries of steps t−1 … t−K, meanlag{K} by the log of its
mean share; against oracle_mass_lag (K = 1) they say what lag-K information could add at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from eps_eval import core
from eps_eval.metrics import BLOCK, Dense, dots, evaluate, group_sum

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
MODES = ("old", "oldmax", "resid")
ENTRY_BYTES = {"old": 2.0, "oldmax": 2.0, "resid": 4.0}  # fp16 per query head (resid: 2)
NEVER = -(1 << 40)
# (coarse [H, Gc], fine [H, nb]) estimates at a step of `tokens` keys for a query [H, d].
Estimates = Callable[[int, F32], tuple[F32, F32]]
# (method, params, met) of one sweep: what quality._rows formats.
Sweep = tuple[str, list[float], dict[str, F64]]


def block_log_mass(q: F32, k: F32) -> F64:
    """√d · log Σ_{i in block} exp(q·k_i/√d) [H, nb] of q [H, d] over keys k [kv, c, d]."""
    d = q.shape[1]
    c = k.shape[1]
    nb = -(-c // BLOCK)
    s = dots(q, k).astype(np.float64) / np.sqrt(d)
    s = np.pad(s, ((0, 0), (0, nb * BLOCK - c)), constant_values=-np.inf).reshape(-1, nb, BLOCK)
    top = s.max(axis=2, keepdims=True)
    return (np.log(np.exp(s - top).sum(axis=2)) + top[..., 0]) * np.sqrt(d)


def log_share(lse: F64, visited: npt.NDArray[np.bool_], d: int) -> F64:
    """lse [H, nb] (× √d) as a log share of the visited blocks' total, per head (× √d)."""
    x = lse / np.sqrt(d)
    sub = x[:, visited]
    top = sub.max(axis=1, keepdims=True)
    total = np.log(np.exp(sub - top).sum(axis=1, keepdims=True)) + top
    return (x - total) * np.sqrt(d)


def union_scores(sc: F64, d: int) -> F32:
    """One list-level score [1, n] from per-head scores [H, n] (√d·log units, −inf where a
    block is not allowed): each head's scores as shares of its allowed blocks' total, the
    log of their sum over heads. The mean of the heads' shares over a list is the list's
    recall (metrics.py), so the n best blocks by this score are the best n-block union list
    when the scores are exact; threshold budgets take each head's top n instead."""
    x = sc / np.sqrt(d)
    finite = np.isfinite(x)
    top = np.where(finite, x, -np.inf).max(axis=1, keepdims=True)
    total = np.log(np.where(finite, np.exp(x - top), 0.0).sum(axis=1, keepdims=True)) + top
    y = x - total
    ytop = y.max(axis=0, keepdims=True)
    safe = np.where(np.isfinite(ytop), ytop, 0.0)
    with np.errstate(divide="ignore"):
        u = np.log(np.exp(y - safe).sum(axis=0, keepdims=True)) + safe
    return (u * np.sqrt(d)).astype(np.float32)


@dataclass
class _Memory:
    """One simulated engine (variant, budget): per block, the latest exact log share and
    the step whose attention wrote it; per block, the latest residual and its step."""

    val: F64
    stamp: npt.NDArray[np.int64]
    resid: F64
    resid_stamp: npt.NDArray[np.int64]

    @staticmethod
    def empty(heads: int, blocks: int) -> _Memory:
        return _Memory(np.full((heads, blocks), np.nan), np.full(blocks, NEVER),
                       np.full((heads, blocks), np.nan), np.full(blocks, NEVER))


@dataclass
class _Candidates:
    """The coarse level's outcome at one budget: final block budget, candidate and forced
    blocks, as quality._c2f_pick computes them."""

    blocks: int
    cblock: npt.NDArray[np.bool_]
    forced: npt.NDArray[np.bool_]
    first_n: int
    last_n: int
    union: bool
    head_dim: int

    @staticmethod
    def of(coarse: F32, nb: int, gc: int, f: float, cand: float, kvh: int,
           union: bool = False, head_dim: int = 1) -> _Candidates:
        """With `union`, both levels rank by union_scores and take n blocks (or groups) for
        the whole list instead of n per head."""
        Gc = coarse.shape[1]
        blocks = max(1, round(f * max(1, nb - 3 * gc)))
        n_cand = max(1, min(Gc, round(cand * blocks / gc)))
        if union:
            u = union_scores(coarse.astype(np.float64), head_dim)
            cmask = core.mark(u, 1, [n_cand])[0, 0].astype(bool)
        else:
            cmask = core.mark(coarse, kvh, [n_cand])[0, 0].astype(bool)  # forced included
        forced = np.zeros(nb, dtype=bool)
        forced[: min(gc, nb)] = True
        forced[max(0, (Gc - 2) * gc):] = True
        return _Candidates(blocks, np.repeat(cmask, gc)[:nb], forced, gc,
                           nb - max(0, (Gc - 2) * gc), union, head_dim)

    def mark(self, sc: F64, allowed: npt.NDArray[np.bool_], kvh: int) -> npt.NDArray[np.uint8]:
        if self.union:
            u = union_scores(np.where(allowed[None], sc, -np.inf), self.head_dim)
            m = core.mark(u, 1, [self.blocks], first_n=self.first_n, last_n=self.last_n)[0]
        else:
            m = core.mark(sc.astype(np.float32), kvh, [self.blocks], first_n=self.first_n,
                          last_n=self.last_n)[0]
        m = m & allowed[None].astype(np.uint8)
        m[:, self.forced] = 1
        return m


@dataclass
class FeedbackMemory:
    """The step-by-step simulation of one layer (a harness simulation, not core's rule).

    Call `sweeps` with increasing positions; the first call simulates `warmup` unmeasured
    steps before its position, later calls the steps since the last one."""

    depths: tuple[int, ...]
    fractions: tuple[float, ...]
    gc: int
    cand: float
    record_bytes: float  # per (block or coarse group, KV head), both levels
    q_heads: int
    kv_heads: int
    max_blocks: int
    warmup: int
    label: str  # e.g. c2f4x2-questclt1
    # The lag-1 query moved one position on (RoPE of +1 applied to it): the rot variants'
    # estimates read it instead of the lag-1 query; None: no such variants.
    rotate: Callable[[F32], F32] | None = None
    next_step: int | None = None
    memory: dict[tuple[int, str, int], _Memory] = field(default_factory=dict)
    # Per budget, the last step's (age of each block's entry, candidate blocks) before
    # fbmem1's pick: what `misses` splits the missed mass by.
    before: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_],
                            npt.NDArray[np.bool_]]] = field(default_factory=dict)

    def variants(self) -> list[tuple[int, str]]:
        rot = [(1, "rot"), (1, "rotunion")] if self.rotate is not None else []
        return ([(0, "old"), (0, "union"), (1, "old"), (1, "union")] + rot
                + [(K, m) for K in self.depths if K > 1 for m in MODES])

    def sweeps(self, k: F32, q_by_pos: dict[int, F32], position: int, dn: Dense,
               estimates: Estimates) -> list[Sweep]:
        start = position - self.warmup if self.next_step is None else self.next_step
        lists: dict[tuple[int, str, int], tuple[npt.NDArray[np.uint8], int]] = {}
        for s in range(start, position + 1):
            lists = self._step(k, q_by_pos, s, estimates)
        self.next_step = position + 1
        nb = dn.mass.shape[1]
        Gc = -(-nb // self.gc)
        r = self.q_heads // self.kv_heads
        out: list[Sweep] = []
        for K, mode in self.variants():
            masks, per_block = [], []
            for fi in range(len(self.fractions)):
                m, fine_read = lists[(K, mode, fi)]
                masks.append(m)
                memory = 0.0 if K <= 1 else ENTRY_BYTES[mode] * r + 1.0
                per_block.append((Gc + fine_read) * self.record_bytes / nb + memory)
            met = evaluate(dn, 1, np.stack(masks), [1] * len(masks), per_block)
            name = f"fbmem{K}{'' if (K <= 1 and mode == 'old') else '-' + mode}-{self.label}"
            out.append((name, [float(f) for f in self.fractions], met))
            if (K, mode) == (1, "old"):
                out += self._misses([lists[(1, "old", fi)][0] for fi in range(len(masks))],
                                    dn, met)
        return out

    def _misses(self, masks: list[npt.NDArray[np.uint8]], dn: Dense, met: dict[str, F64]
                ) -> list[Sweep]:
        """fbmem1's missed attention (1 − recall, the current query's mass outside its list,
        mean over heads) split by what the step knew of each missed block: fed (its exact
        lag-1 value: lost to lag drift), old (visited 2-8 steps back only), cand (never
        visited in 8 steps, estimated), noncand (never visited, its coarse group not a
        candidate). Rows miss-{part}: `recall` holds that part, skip is fbmem1's. Rows
        xmiss-{part}: that part less the same part of the best list of as many blocks
        (union_scores of the current query's mass, the same forced blocks): the excess,
        whose sum is fbmem1's gap to that list at equal KV bytes (no summary bytes)."""
        names = ("fed", "old", "cand", "noncand")
        parts: dict[str, list[float]] = {p: [] for p in names}
        excess: dict[str, list[float]] = {p: [] for p in names}
        u = union_scores(np.log(np.maximum(dn.mass, 1e-300)), 1)[0]
        for fi, m in enumerate(masks):
            age, cblock, forced = self.before[fi]
            listed = m[0].astype(bool)
            best = forced.copy()
            free = np.flatnonzero(~forced)
            take = int(listed.sum() - forced.sum())
            best[free[np.argsort(-u[free], kind="stable")[:take]]] = True
            out_mass = (dn.mass * ~listed[None]).mean(axis=0)  # [nb]
            best_out = (dn.mass * ~best[None]).mean(axis=0)
            never = age > 8
            for part, sel in (("fed", age == 1), ("old", (age >= 2) & (age <= 8)),
                              ("cand", never & cblock), ("noncand", never & ~cblock)):
                parts[part].append(float(out_mass[sel].sum()))
                excess[part].append(float(out_mass[sel].sum() - best_out[sel].sum()))
        fr = [float(f) for f in self.fractions]
        return ([(f"miss-{p}-fbmem1", fr, {**met, "recall": np.asarray(v),
                                          "recall_min": np.asarray(v)})
                 for p, v in parts.items()]
                + [(f"xmiss-{p}-fbmem1", fr, {**met, "recall": np.asarray(v),
                                             "recall_min": np.asarray(v)})
                   for p, v in excess.items()])

    def _step(self, k: F32, q_by_pos: dict[int, F32], s: int, estimates: Estimates
              ) -> dict[tuple[int, str, int], tuple[npt.NDArray[np.uint8], int]]:
        """Step s: every variant's list with the lag-1 query, then the attention of the step
        (the query of s) writing each listed block's log share into that variant's memory."""
        c = s + 1
        q = q_by_pos[s - 1]
        queries = {False: q} if self.rotate is None else {False: q, True: self.rotate(q)}
        est = {}
        for rot, qq in queries.items():
            coarse, fine32 = estimates(c, qq)
            est[rot] = (coarse, fine32.astype(np.float64))
        nb = est[False][1].shape[1]
        written = block_log_mass(q_by_pos[s], k[:, :c])
        out = {}
        for fi, f in enumerate(self.fractions):
            by_rule = {(u, rot): _Candidates.of(est[rot][0], nb, self.gc, f, self.cand,
                                                self.kv_heads, union=u, head_dim=k.shape[2])
                       for u in (False, True) for rot in est}
            for K, mode in self.variants():
                rot = mode.startswith("rot")
                cands = by_rule[(mode.endswith("union"), rot)]
                fine_read = int((cands.cblock & ~cands.forced).sum())
                key = (K, mode, fi)
                mem = self.memory.setdefault(key, _Memory.empty(self.q_heads, self.max_blocks))
                if (K, mode) == (1, "old"):
                    self.before[fi] = (s - mem.stamp[:nb], cands.cblock, cands.forced)
                m = self._pick(mem, K, mode, s, est[rot][1], cands)
                visited = m[0].astype(bool)
                share = log_share(written, visited, k.shape[2])
                mem.val[:, :nb][:, visited] = share[:, visited]
                mem.stamp[:nb][visited] = s
                out[key] = (m, fine_read)
        return out

    def _pick(self, mem: _Memory, K: int, mode: str, s: int, fine: F64,
              cands: _Candidates) -> npt.NDArray[np.uint8]:
        nb = fine.shape[1]
        val = mem.val[:, :nb]
        age = s - mem.stamp[:nb]
        fed = (age == 1) if K >= 1 else np.zeros(nb, dtype=bool)
        both = fed & cands.cblock
        diff = np.where(both[None], val - fine, np.nan)
        offset = (np.nan_to_num(np.nanmedian(diff, axis=1, keepdims=True)) if both.any()
                  else np.zeros((fine.shape[0], 1)))
        est = np.where(cands.cblock[None], fine + offset, -np.inf)
        sc = est.copy()
        allowed = cands.cblock.copy()
        old = (age >= 2) & (age <= K)
        if mode == "oldmax":
            sc = np.where(old[None], np.where(cands.cblock[None], np.maximum(val, est), val), sc)
        elif K > 1:
            sc = np.where(old[None], val, sc)
        if mode == "resid" and K > 1:
            # Residuals of the blocks fed now and estimated now, kept for the steps after;
            # stamped with the step whose query both sides read.
            mem.resid[:, :nb][:, both] = (val - fine - offset)[:, both]
            mem.resid_stamp[:nb][both] = s - 1
            rage = s - mem.resid_stamp[:nb]
            has = (rage >= 2) & (rage <= K) & cands.cblock & ~fed
            sc = np.where(has[None], est + mem.resid[:, :nb], sc)
        allowed |= old
        sc = np.where(fed[None], val, sc)
        allowed |= fed
        return cands.mark(sc, allowed, self.kv_heads)


def lag_ceilings(dn: Dense, lag_mass: dict[int, F64], depths: tuple[int, ...], kvh: int,
                 tps: list[int]) -> list[Sweep]:
    """Zero-byte ceilings at g = 1 (threshold budget top_pages tps): every block ranked by
    its largest log share (maxlag{K}) or the log of its mean share (meanlag{K}) under the
    queries 1 … K positions back; lag_mass[j]: the per-block mass [H, nb] of lag j."""
    d = dn.head_dim
    out: list[Sweep] = []
    for K in depths:
        if K < 2 or any(j not in lag_mass for j in range(1, K + 1)):
            continue
        stack = np.stack([lag_mass[j] for j in range(1, K + 1)])
        logs = np.log(np.maximum(stack, 1e-300)) * np.sqrt(d)
        for name, sc in ((f"oracle_maxlag{K}", logs.max(axis=0)),
                         (f"oracle_meanlag{K}",
                          np.log(np.maximum(stack.mean(axis=0), 1e-300)) * np.sqrt(d))):
            masks = core.mark(sc.astype(np.float32), kvh, tps)
            out.append((name, [float(t) for t in tps],
                        evaluate(dn, 1, masks, tps, [0.0] * len(tps))))
    return out


def exact_c2f(dn: Dense, lag1_mass: F64, gc: int, cand: float, fractions: tuple[float, ...],
              kvh: int, record_bytes: float) -> list[Sweep]:
    """c2f{gc}x{cand} with a perfect lag-1 estimator at both levels (the exact lag-1 log
    mass of every block and coarse group) at the estimator's bytes: the ceiling of any
    estimator within this coarse-to-fine structure, feedback or not; per-head top n and,
    -union, the list-level rule (union_scores)."""
    d = dn.head_dim
    fine = np.log(np.maximum(lag1_mass, 1e-300)) * np.sqrt(d)
    coarse = (np.log(np.maximum(group_sum(lag1_mass, gc), 1e-300)) * np.sqrt(d)).astype(np.float32)
    nb = fine.shape[1]
    Gc = coarse.shape[1]
    out: list[Sweep] = []
    for union in (False, True):
        masks, per_block = [], []
        for f in fractions:
            cands = _Candidates.of(coarse, nb, gc, f, cand, kvh, union=union, head_dim=d)
            masks.append(cands.mark(np.where(cands.cblock[None], fine, -np.inf), cands.cblock,
                                    kvh))
            per_block.append((Gc + int((cands.cblock & ~cands.forced).sum())) * record_bytes / nb)
        out.append((f"c2f{gc}x{cand:g}-exactlag1{'-union' if union else ''}",
                    [float(f) for f in fractions],
                    evaluate(dn, 1, np.stack(masks), [1] * len(masks), per_block)))
    return out


def rotated_oracles(dn: Dense, q_rot: F32, k: F32, tps: list[int]) -> list[Sweep]:
    """Zero-byte g = 1 ceilings of the rotated lag-1 query q_rot (see `rotate`): its exact
    mass, per-head top n (oracle_mass_lagrot) and list-level (oracle_mass_lagrot-union)."""
    d = dn.head_dim
    lse = block_log_mass(q_rot, k[:, :dn.tokens])
    share = log_share(lse, np.ones(lse.shape[1], dtype=bool), d)
    out: list[Sweep] = []
    masks = core.mark(share.astype(np.float32), dn.kv_heads, tps)
    out.append(("oracle_mass_lagrot", [float(t) for t in tps],
                evaluate(dn, 1, masks, tps, [0.0] * len(tps))))
    masks = core.mark(union_scores(share, d), 1, tps)
    out.append(("oracle_mass_lagrot-union", [float(t) for t in tps],
                evaluate(dn, 1, masks, tps, [0.0] * len(tps))))
    return out


def union_oracles(dn: Dense, lag1_mass: F64, tps: list[int]) -> list[Sweep]:
    """Zero-byte g = 1 lists of the n blocks with the largest summed share over the heads
    (union_scores): of the current query (oracle_mass-union, the best n-block list there
    is) and of the lag-1 query (oracle_mass_lag-union); n = tps, forced blocks as
    core.mark's defaults."""
    d = dn.head_dim
    out: list[Sweep] = []
    for name, mass in (("oracle_mass-union", dn.mass), ("oracle_mass_lag-union", lag1_mass)):
        u = union_scores(np.log(np.maximum(mass, 1e-300)) * np.sqrt(d), d)
        masks = core.mark(u, 1, tps)
        out.append((name, [float(t) for t in tps], evaluate(dn, 1, masks, tps, [0.0] * len(tps))))
    return out
