"""Issue 19's measurements for one (layer, step): group sizes, reuse, 8-bit quest,
coarse-to-fine selection and the adaptive mass budget.

Scores of jl8, 1pc, fro and quest come from core/bounds.h through libeps_eval;
the threshold marks from core/select.h's MarkByThreshold, the mass-budget marks
from MarkByMass (core.mark_mass). Two experimental scorers live here until
they prove themselves:

  quest8  Quest's per-channel min/max stored in int8 with one fp32 scale per
          (group, KV head), scale = max_j max(|min_j|, |max_j|) / 127, min
          rounded down and max rounded up (float64), so the bound stays an
          upper bound of max_i q·k_i. Record: 2·d + 4 bytes.
  c2f     coarse-to-fine: every g_c-block group is scored with its quest8
          record; the best groups (a candidate budget per head, OR-ed over
          heads) have their 16-token blocks scored with block-level quest8
          records, read for those groups only; the final list is
          block-granular (MarkByThreshold over blocks, forced = the blocks of
          the first group and of the last two groups, as at g = g_c).

  massunion  the mass budget over the list rather than each head (core
          MarkByMassList, epsd's mass_scope=list): a group's estimated share of
          the attention (MarkByMass's w over its sum, per head) summed over the
          list's heads, groups taken by decreasing share until the forced groups
          and the taken ones hold `target` of the list's total.
          The union of per-head mass budgets (core MarkByMass, budget "mass")
          gives every head the target, more than a union list needs: a group
          one head takes counts for every head; and the mean over heads of the
          exact shares is exactly the union list's recall (metrics.py), so with
          exact masses this takes the fewest groups that reach the target.

Estimators (eps_eval.estimators: questclt, questblend, questlgn) read quest8's
record and are scored at its bytes, at every g and as both levels of c2f
(`c2f8x2-questclt1`, ...); QualityPlan.estimators and .c2f_scorers pick them.

Rows carry `budget` (threshold, mass or c2f) and its parameters; `skip` counts
summary bytes read (see metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from eps_eval import core, estimators, feedback_rows
from eps_eval.feedback_memory import (
    FeedbackMemory,
    Sweep,
    exact_c2f,
    lag_ceilings,
    rotated_oracles,
    union_oracles,
)
from eps_eval.list_count import ListCountSim
from eps_eval.metrics import BLOCK, Dense, dense, evaluate, group_max, group_sum
from eps_eval.plans import QualityPlan

F32 = npt.NDArray[np.float32]
CORE_METHODS = ("jl8", "1pc", "fro", "quest", "questclt")  # questclt: core's, on the fp16 record
MASS_TARGETS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999)
MASS_TEMPERATURES = (0.25, 0.5, 1.0, 2.0, 4.0)
MASS_FLOORS = (0.0, 0.05, 0.1, 0.2)  # min_pages as a share of the unforced groups


def record_bytes(method: str, d: int) -> float:
    """Summary bytes per (group, KV head) read by `method`."""
    if method == "jl8":
        return core.record_bytes(d, 8, 0)
    if method == "fro":
        return core.record_bytes(d, 8, 0)
    if method == "1pc":
        return core.record_bytes(d, 8, core.PRINCIPAL)
    if method in ("quest", "questclt"):
        return 4.0 * d  # Quest's fp16 min and max
    if method == "quest8":
        return 2.0 * d + 4.0
    if method == "questmid":
        return 6.0 * d  # quest fp16 plus the key sum in fp16
    if estimators.reads_mean(method):
        return 3.0 * d + 8.0  # quest8's record and the int8 mean key with its scale
    if estimators.is_estimator(method):
        return 2.0 * d + 4.0  # quest8's record
    if method == "momentlgn":
        return 2.0 * d + 8.0  # int8 mean and std, a scale each
    return 0.0  # oracles


def quest8_scores(q: F32, min8: npt.NDArray[np.float64], max8: npt.NDArray[np.float64]) -> F32:
    """Scores [H, G] of q [H, d] against int8-rounded ranges [kv, G, d] (GQA by head // r)."""
    h = q.shape[0]
    r = h // min8.shape[0]
    qd = q.astype(np.float64)
    out = np.empty((h, min8.shape[1]))
    for i in range(h):
        out[i] = np.maximum(qd[i], 0) @ max8[i // r].T + np.minimum(qd[i], 0) @ min8[i // r].T
    return out.astype(np.float32)


QUEST8_SCALES = ("fp32", "pow2")


def quest8_pow2_scale(amax: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """core's Quest8ScaleFor, called through libeps_eval (core.quest8_scales): the smallest
    power of two s with 127·s >= amax (2^-149 at least; 1 where amax is 0, whose codes are
    0 at any scale). A max |k| of exactly 127·2^e gets 2^e, as core's writer stores it."""
    positive = amax > 0
    a = np.where(positive, amax, 1.0)
    # Core reads float32: the smallest float32 >= amax (amax itself for float32 keys) has
    # the same scale, since every 127·2^e it is compared with is a float32.
    a32 = a.astype(np.float32)
    a32 = np.where(a32 < a, np.nextafter(a32, np.float32(np.inf)), a32)
    return np.where(positive, core.quest8_scales(a32).astype(np.float64), 1.0)


class QuestTables:
    """Per-group key min/max [kv, G, d] (float64) of one layer, for quest8.

    scale "pow2" rounds each group's scale up to a power of two. A writer that sees keys
    one at a time can then keep int8 codes exactly: when a new key needs a larger scale,
    2^j times the old one, floor(code / 2^j) of a minimum (ceil of a maximum) is the code
    the final scale gives the true value, so the record equals this one whatever the order
    of the keys. It costs up to one bit of each code's resolution."""

    def __init__(self, k: F32, tokens: int, g: int, scale_mode: str = "fp32") -> None:
        if scale_mode not in QUEST8_SCALES:
            raise ValueError(f"quest8 scale {scale_mode!r} is not one of {QUEST8_SCALES}")
        kv, _, d = k.shape
        gt = g * BLOCK
        G = -(-tokens // gt)
        kk = k[:, :tokens].astype(np.float64)
        pad = G * gt - tokens
        lo = np.pad(kk, ((0, 0), (0, pad), (0, 0)), constant_values=np.inf)
        hi = np.pad(kk, ((0, 0), (0, pad), (0, 0)), constant_values=-np.inf)
        kmin = lo.reshape(kv, G, gt, d).min(axis=2)
        kmax = hi.reshape(kv, G, gt, d).max(axis=2)
        amax = np.maximum(np.abs(kmin), np.abs(kmax)).max(axis=2, keepdims=True)
        if scale_mode == "pow2":
            scale = quest8_pow2_scale(amax)
        else:
            # The scale is widened by 1e-6 so every |code| stays below 127 after rounding.
            scale = np.where(amax > 0, amax / 127.0 * (1 + 1e-6), 1.0)
        # Outward rounding: the int8 codes bracket the true range (one code more
        # where the product code·scale rounded back inside it).
        lo_code = np.floor(kmin / scale)
        hi_code = np.ceil(kmax / scale)
        lo_code -= lo_code * scale > kmin
        hi_code += hi_code * scale < kmax
        lo_code, hi_code = np.clip(lo_code, -128, 127), np.clip(hi_code, -128, 127)
        self.min8, self.max8 = lo_code * scale, hi_code * scale
        counts = np.minimum(gt, tokens - np.arange(G) * gt)
        self.mean = np.pad(kk, ((0, 0), (0, pad), (0, 0))).reshape(kv, G, gt, d).sum(axis=2)
        self.mean /= counts[None, :, None]
        self.mean8 = estimators.int8_per_group(self.mean)  # meanclt's centre
        assert np.all(self.min8 <= kmin) and np.all(self.max8 >= kmax)
        self.kv = kv

    def scores(self, q: F32) -> F32:
        """quest8 scores [H, G]: Σ_j max(q_j·min_j, q_j·max_j) ≥ max_i q·k_i."""
        return quest8_scores(q, self.min8, self.max8)

    def estimate(self, name: str, q: F32) -> F32:
        """Scores [H, G] of an eps_eval.estimators estimator from the same int8 record."""
        if name == "quest8":
            return self.scores(q)
        return estimators.estimate(name, q, self.min8, self.max8, self.mean8)

    def mean_scores(self, q: F32) -> F32:
        """q·k̄ [H, G]: the mean key's score, a lower bound of max_i q·k_i (key_sum / count)."""
        h = q.shape[0]
        r = h // self.kv
        return np.stack([self.mean[i // r] @ q[i].astype(np.float64) for i in range(h)]).astype(
            np.float32)


class GrowingQuestTables:
    """quest8 scores over keys that grow (a decode): a group's int8 record depends on its
    own keys only, so complete groups are built once and only the open group each call.
    Scores equal QuestTables(keys, tokens, g).scores(q)."""

    def __init__(self, g: int) -> None:
        self.g = g
        self.done = 0  # tokens in the complete groups built so far
        self.min8: npt.NDArray[np.float64] | None = None  # [kv, groups, d]
        self.max8: npt.NDArray[np.float64] | None = None

    def copy(self) -> GrowingQuestTables:
        """An independent copy (the built groups are shared read-only)."""
        other = GrowingQuestTables(self.g)
        other.done, other.min8, other.max8 = self.done, self.min8, self.max8
        return other

    def grow(self, keys: F32, tokens: int) -> None:
        """Builds the complete groups of keys [kv, >= tokens, d] not yet built."""
        gt = self.g * BLOCK
        full = tokens // gt * gt
        if full > self.done:
            t = QuestTables(keys[:, self.done:full], full - self.done, self.g)
            cat = self.min8 is not None
            self.min8 = np.concatenate([self.min8, t.min8], axis=1) if cat else t.min8
            self.max8 = np.concatenate([self.max8, t.max8], axis=1) if cat else t.max8
            self.done = full

    def scores(self, keys: F32, tokens: int, q: F32) -> F32:
        """quest8 scores [H, G] of q [H, d] over keys[:, :tokens]."""
        self.grow(keys, tokens)
        lo = [] if self.min8 is None else [self.min8]
        hi = [] if self.max8 is None else [self.max8]
        if tokens > self.done:
            t = QuestTables(keys[:, self.done:tokens], tokens - self.done, self.g)
            lo.append(t.min8)
            hi.append(t.max8)
        return quest8_scores(q, np.concatenate(lo, axis=1), np.concatenate(hi, axis=1))


def mark_mass_union(scores: F32, targets: list[float], *, temperature: float, head_dim: int,
                    min_pages: int = 0, first_n: int = 1, last_n: int = 2
                    ) -> npt.NDArray[np.uint8]:
    """The list-level mass budget (massunion above) from scores [q_heads, n]: marks
    [len(targets), 1, n], core MarkByMassList over the one union list (epsd's budget mass
    with mass_scope list)."""
    return core.mark_mass(scores, 1, targets, temperature=temperature, head_dim=head_dim,
                          min_pages=min_pages, first_n=first_n, last_n=last_n, scope="list")


def top_pages_for(groups: int, fractions: tuple[float, ...], forced: int = 3) -> list[int]:
    unforced = max(1, groups - forced)
    return sorted({max(1, round(f * unforced)) for f in fractions})


def _row(workload: dict[str, object], budget: str, method: str, g: int, lag: int, param: float,
         temperature: float, groups: int, met: dict[str, float]) -> dict[str, object]:
    row: dict[str, object] = {**workload, "budget": budget, "method": method, "g": g, "lag": lag,
                              "param": param, "temperature": temperature, "floor": 0.0,
                              "groups": groups}
    row.update({k: float(v) for k, v in met.items()})
    return row


def _rows(workload: dict[str, object], budget: str, method: str, g: int, lag: int,
          params: list[float], temperature: float, groups: int,
          met: dict[str, npt.NDArray[np.float64]]) -> list[dict[str, object]]:
    keep = ("recall", "recall_min", "top10", "out_err", "visited", "summary_frac", "skip")
    return [_row(workload, budget, method, g, lag, p, temperature, groups,
                 {k: met[k][i] for k in keep}) for i, p in enumerate(params)]


class LayerState:
    """The core's summaries of one layer at every group size (m = 8, every feature)."""

    def __init__(self, plan: QualityPlan, q_heads: int, kv_heads: int, d: int,
                 max_tokens: int, rotate_lag: Callable[[F32], F32] | None = None) -> None:
        """rotate_lag: RoPE of one position applied to a query (the model's), for the
        feedback-memory rows' rot variants; None leaves them out."""
        self.plan = plan
        gs = sorted(set(plan.group_blocks) | {1} | set(plan.c2f_coarse))
        self.seqs = {g: core.Sequence(q_heads=q_heads, kv_heads=kv_heads, head_dim=d,
                                      group_blocks=g, sketch_dim=8, features=core.ALL_FEATURES,
                                      max_tokens=max_tokens) for g in gs}
        # epsd's coarse level: g = 1 with quest8 records (what questclt reads) under coarse
        # groups of gc blocks.
        self.coarse_seqs = {
            gc: core.Sequence(q_heads=q_heads, kv_heads=kv_heads, head_dim=d, group_blocks=1,
                              sketch_dim=8, features=core.KEY_SUM | core.QUEST8,
                              max_tokens=max_tokens, coarse_blocks=gc)
            for gc in sorted({gc for gc, _ in plan.epsd_c2f})}
        self.tokens = 0
        self.fb_memory = None
        if plan.fb_memory:
            gc, cand, scorer = plan.c2f_coarse[0], plan.c2f_candidates[0], plan.c2f_scorers[0]
            self.fb_memory = FeedbackMemory(
                plan.fb_memory, plan.fractions, gc, cand, record_bytes(scorer, d), q_heads,
                kv_heads, -(-max_tokens // BLOCK), plan.fb_memory_warmup,
                f"c2f{gc}x{cand:g}-{scorer}", rotate=rotate_lag)
        self.list_count = (ListCountSim(plan.list_count, plan.fractions, q_heads, kv_heads, d,
                                        max_tokens, plan.list_count_warmup,
                                        record_bytes("quest8", d)) if plan.list_count else None)

    def extend_to(self, k: F32, tokens: int) -> None:
        if tokens > self.tokens:
            chunk = np.ascontiguousarray(k[:, self.tokens:tokens])
            for s in [*self.seqs.values(), *self.coarse_seqs.values()]:
                s.append(chunk)
            self.tokens = tokens


def step_rows(state: LayerState, k: F32, v: F32, q_by_pos: dict[int, F32], position: int,
              workload: dict[str, object]) -> list[dict[str, object]]:
    plan = state.plan
    c = position + 1
    state.extend_to(k, c)
    kc, vc = k[:, :c], v[:, :c]
    kvh, d = k.shape[0], k.shape[2]
    dn: Dense = dense(q_by_pos[position], kc, vc)
    rows: list[dict[str, object]] = []
    q8 = {g: QuestTables(k, c, g, plan.quest8_scale)
          for g in sorted(set(plan.group_blocks) | set(plan.c2f_coarse))}
    lag_mass: dict[int, npt.NDArray[np.float64]] = {}

    def mass_of(lag: int) -> npt.NDArray[np.float64]:
        """Per-block attention mass of the query `lag` positions back, computed once."""
        if lag not in lag_mass:
            lag_mass[lag] = dense(q_by_pos[position - lag], kc, vc).mass
        return lag_mass[lag]

    moments = ({g: estimators.MomentTables(k, c, g) for g in plan.group_blocks}
               if "momentlgn" in plan.methods else {})
    for g in plan.group_blocks:
        s = state.seqs[g]
        G = s.groups
        tps = top_pages_for(G, plan.fractions)
        log_mass = np.log(np.maximum(group_sum(dn.mass, g), 1e-300))
        oracle = {"oracle_mass": (log_mass * np.sqrt(d)).astype(np.float32),
                  "oracle_max": group_max(dn.maxdot, g).astype(np.float32)}
        for name, sc in oracle.items():
            masks = core.mark(sc, kvh, tps)
            rows += _rows(workload, "threshold", name, g, 0, [float(t) for t in tps], 0.0, G,
                          evaluate(dn, g, masks, tps, [0.0] * len(tps)))
        if plan.mass_union and g in plan.mass_group_blocks:
            # The exact mass of the current query under the list-level budget: at target p
            # the fewest groups that give this list recall p, the best any adaptive budget
            # can do at this g (lag 0, no summary bytes).
            masks = mark_mass_union(oracle["oracle_mass"], list(MASS_TARGETS), temperature=1.0,
                                    head_dim=d)
            rows += _rows(workload, "massunion", "oracle_mass", g, 0, list(MASS_TARGETS), 1.0, G,
                          evaluate(dn, g, masks, [1] * len(MASS_TARGETS),
                                   [0.0] * len(MASS_TARGETS)))
        for lag in plan.lags:
            q = q_by_pos[position - lag]
            scores = {m: s.scores("jl" if m == "jl8" else m, q) for m in CORE_METHODS
                      if m in plan.methods}
            scores["quest8"] = q8[g].scores(q)
            for e in plan.estimators:
                scores[e] = q8[g].estimate(e, q)
            if "momentlgn" in plan.methods:
                scores["momentlgn"] = moments[g].scores(q)
            if "oracle_mass_lag" in plan.methods:
                # The exact mass under the lagged query: the ceiling of any estimator at this
                # lag (the oracles above read the current query).
                lm = np.log(np.maximum(group_sum(mass_of(lag), g), 1e-300)) * np.sqrt(d)
                scores["oracle_mass_lag"] = lm.astype(np.float32)
            for name, sc in scores.items():
                if name not in plan.methods and name not in plan.estimators:
                    continue
                masks = core.mark(sc, kvh, tps)
                rb = record_bytes(name, d)
                rows += _rows(workload, "threshold", name, g, lag, [float(t) for t in tps], 0.0,
                              G, evaluate(dn, g, masks, tps, [rb] * len(tps)))
            if lag == 1 and plan.feedback and position - 2 in q_by_pos:
                rows += feedback_rows.threshold_rows(
                    workload, dn, q8[g], q, q_by_pos[position - 2], mass_of(1), g, kvh, tps,
                    plan.feedback, record_bytes, _rows)
            if g in plan.mass_group_blocks and lag in plan.mass_lags:
                # questmid: the middle of the bracket [q·k̄, quest], both in the default record.
                mid = 0.5 * (scores["quest"] + q8[g].mean_scores(q))
                mass_scores = {"quest": scores["quest"], "quest8": scores["quest8"],
                               "questmid": mid.astype(np.float32)}
                for extra in ("questclt", "questlgn", "oracle_mass_lag"):
                    if extra in scores:  # questlgn: an estimate of the log mass itself
                        mass_scores[extra] = scores[extra]
                if lag == 0:
                    mass_scores["oracle_mass"] = oracle["oracle_mass"]
                for name, sc in mass_scores.items():
                    if name not in plan.mass_methods:
                        continue
                    rb = record_bytes(name, d)
                    exact_mass = name.startswith("oracle_mass")  # τ = 1, no floor
                    for tau in MASS_TEMPERATURES:
                        if exact_mass and tau != 1.0:
                            continue
                        for floor in MASS_FLOORS:
                            if exact_mass and floor > 0:
                                continue
                            min_pages = round(floor * max(1, G - 3))
                            masks = core.mark_mass(sc, kvh, list(MASS_TARGETS), temperature=tau,
                                                   head_dim=d, min_pages=min_pages)
                            met = evaluate(dn, g, masks, [1] * len(MASS_TARGETS),
                                           [rb] * len(MASS_TARGETS))
                            for r in _rows(workload, "mass", name, g, lag, list(MASS_TARGETS),
                                           tau, G, met):
                                r["floor"] = floor
                                rows.append(r)
                            if not plan.mass_union:
                                continue
                            masks = mark_mass_union(sc, list(MASS_TARGETS), temperature=tau,
                                                    head_dim=d, min_pages=min_pages)
                            met = evaluate(dn, g, masks, [1] * len(MASS_TARGETS),
                                           [rb] * len(MASS_TARGETS))
                            for r in _rows(workload, "massunion", name, g, lag,
                                           list(MASS_TARGETS), tau, G, met):
                                r["floor"] = floor
                                rows.append(r)
            if (lag == 1 and plan.mass_feedback and g in plan.mass_group_blocks
                    and position - 2 in q_by_pos):
                exact = np.log(np.maximum(group_sum(mass_of(1), g), 1e-300)) * np.sqrt(d)
                rows += feedback_rows.mass_rows(
                    workload, dn, scores["questclt"], s.scores("questclt", q_by_pos[position - 2]),
                    exact, g, kvh, d, tps, record_bytes("questclt", d), MASS_TARGETS, MASS_FLOORS,
                    plan.mass_union, _rows)
    if state.fb_memory is not None:
        rows += _fb_memory_rows(state.fb_memory, workload, dn, k, q_by_pos, position, mass_of,
                                top_pages_for(dn.mass.shape[1], plan.fractions), plan)
    if state.list_count is not None:
        for name, budget, g, params, groups, met in state.list_count.sweeps(k, q_by_pos,
                                                                            position, dn):
            rows += _rows(workload, budget, name, g, 1, params, 0.0, groups, met)
    if 1 in plan.lags:
        before = q_by_pos.get(position - 2) if plan.feedback else None
        rows += _epsd_c2f_rows(state, workload, dn, q_by_pos[position - 1], kvh, d, before,
                               mass_of(1) if before is not None else None)
    for lag in sorted({0, 1} & set(plan.lags)):
        q = q_by_pos[position - lag]
        for scorer in plan.c2f_scorers:
            fine = q8[1].estimate(scorer, q)
            suffix = "" if scorer == "quest8" else f"-{scorer}"
            for gc in plan.c2f_coarse:
                rows += _c2f_rows(workload, dn, q8[gc].estimate(scorer, q), fine, gc, lag, plan,
                                  kvh, record_bytes(scorer, d), suffix)
                if lag == 1 and scorer in plan.feedback and position - 2 in q_by_pos:
                    q_before = q_by_pos[position - 2]
                    exact = np.log(np.maximum(mass_of(1), 1e-300)) * np.sqrt(d)
                    # Two steps of feedback when the query three positions back is there:
                    # the previous list had feedback itself (from the one before it).
                    earlier = None
                    if position - 3 in q_by_pos:
                        q_earlier = q_by_pos[position - 3]
                        earlier = (q8[gc].estimate(scorer, q_earlier),
                                   q8[1].estimate(scorer, q_earlier),
                                   np.log(np.maximum(mass_of(2), 1e-300)) * np.sqrt(d))
                    rows += _c2f_feedback_rows(
                        workload, dn, (q8[gc].estimate(scorer, q), fine),
                        (q8[gc].estimate(scorer, q_before), q8[1].estimate(scorer, q_before)),
                        exact, gc, plan, kvh, record_bytes(scorer, d), suffix, earlier)
    return rows


def _fb_memory_rows(sim: FeedbackMemory, workload: dict[str, object], dn: Dense, k: F32,
                   q_by_pos: dict[int, F32], position: int,
                   mass_of: Callable[[int], npt.NDArray[np.float64]], tps: list[int],
                   plan: QualityPlan) -> list[dict[str, object]]:
    """Feedback-memory rows (eps_eval.feedback_memory, harness simulation): fbmem rows on
    the c2f budget, the c2f ceiling with exact lag-1 masses, and the lag-K ceilings."""
    scorer = plan.c2f_scorers[0]

    def estimates(tokens: int, q: F32) -> tuple[F32, F32]:
        return (QuestTables(k, tokens, sim.gc, plan.quest8_scale).estimate(scorer, q),
                QuestTables(k, tokens, 1, plan.quest8_scale).estimate(scorer, q))

    kvh = k.shape[0]
    sweeps: list[Sweep] = sim.sweeps(k, q_by_pos, position, dn, estimates)
    sweeps += exact_c2f(dn, mass_of(1), sim.gc, sim.cand, plan.fractions, kvh,
                        sim.record_bytes)
    sweeps += union_oracles(dn, mass_of(1), tps)
    if sim.rotate is not None:
        sweeps += rotated_oracles(dn, sim.rotate(q_by_pos[position - 1]), k, tps)
    deepest = max(plan.fb_memory)
    lag_mass = {j: mass_of(j) for j in range(1, deepest + 1) if position - j in q_by_pos}
    sweeps += lag_ceilings(dn, lag_mass, plan.fb_memory, kvh, tps)
    out: list[dict[str, object]] = []
    nb = dn.mass.shape[1]
    for name, params, met in sweeps:
        budget = "threshold" if name.startswith("oracle_") else "c2f"
        lag = 0 if name == "oracle_mass-union" else 1
        out += _rows(workload, budget, name, 1, lag, params, 0.0, nb, met)
    return out


def _epsd_c2f_rows(state: LayerState, workload: dict[str, object], dn: Dense, q: F32, kvh: int,
                   d: int, q_before: F32 | None = None,
                   lag1_mass: npt.NDArray[np.float64] | None = None) -> list[dict[str, object]]:
    """Rows of epsd's coarse level (core PageSelector::Select, threshold budget, α = 1)
    with the lag-1 query q: summary bytes are the records the step read (its StepStats)
    at quest8's size, per block and KV head, as the harness's c2f rows count them.
    With q_before (the query two positions back) and lag1_mass ([H, blocks], the exact
    mass of q's position): epsd-fb- rows, core's selection feedback, the previous list
    being the same selection with q_before and the feedback its blocks' log mass."""
    out: list[dict[str, object]] = []
    core_rb = core.record_bytes(d, 8, core.KEY_SUM | core.QUEST8)
    for gc, cand in state.plan.epsd_c2f:
        s = state.coarse_seqs[gc]
        nb = s.groups
        tps = top_pages_for(nb, state.plan.fractions)
        for fed in (False, True) if q_before is not None and lag1_mass is not None else (False,):
            masks, bytes_per_block = [], []
            for tp in tps:
                feedback = None
                if fed:
                    assert q_before is not None and lag1_mass is not None
                    prev, _ = s.select("questclt", q_before, tp, coarse_candidates=cand)
                    log_mass = np.log(np.maximum(lag1_mass, 1e-300))
                    feedback = np.where(prev[0].astype(bool)[None], log_mass, np.nan)
                visit, st = s.select("questclt", q, tp, coarse_candidates=cand,
                                     feedback=feedback)
                masks.append(visit)
                records = st["summary_bytes_read"] / core_rb
                bytes_per_block.append(records * record_bytes("quest8", d) / (kvh * nb))
            met = evaluate(dn, 1, np.stack(masks), tps, bytes_per_block)
            name = f"epsd-{'fb-' if fed else ''}c2f{gc}x{cand:g}-questclt"
            out += _rows(workload, "c2f", name, 1, 1, [float(t) for t in tps], 0.0, nb, met)
    return out


def _c2f_pick(coarse: F32, fine: F32, gc: int, f: float, cand: float, kvh: int,
              visited: npt.NDArray[np.bool_] | None = None, exact: F32 | None = None
              ) -> tuple[npt.NDArray[np.uint8], int]:
    """One coarse-to-fine list [lists, nb] at fraction f and candidate width cand, and the
    fine records it read. With `visited` (the previous step's blocks) and `exact` ([H, nb],
    their exact lag-1 log mass × sqrt(d)): selection feedback, those blocks ranked by
    `exact` whether or not their group is a candidate, the others by the estimate plus each
    head's median of exact − estimate over the visited candidate blocks."""
    Gc = coarse.shape[1]
    nb = fine.shape[1]
    blocks = max(1, round(f * max(1, nb - 3 * gc)))
    n_cand = max(1, min(Gc, round(cand * blocks / gc)))
    cmask = core.mark(coarse, kvh, [n_cand])[0, 0].astype(bool)  # forced groups included
    cblock = np.repeat(cmask, gc)[:nb]
    forced = np.zeros(nb, dtype=bool)
    forced[: min(gc, nb)] = True
    forced[max(0, (Gc - 2) * gc):] = True
    sc = np.where(cblock[None], fine, -np.inf)
    allowed = cblock
    if visited is not None and exact is not None:
        both = visited & cblock
        diff = np.where(both[None], exact - fine, np.nan)
        offset = (np.nan_to_num(np.nanmedian(diff, axis=1, keepdims=True)) if both.any()
                  else np.zeros((fine.shape[0], 1)))
        sc = np.where(visited[None], exact, sc + offset)
        allowed = cblock | visited
    m = core.mark(sc.astype(np.float32), kvh, [blocks], first_n=gc,
                  last_n=nb - max(0, (Gc - 2) * gc))[0]
    m = m & allowed[None].astype(np.uint8)
    m[:, forced] = 1
    return m, int((cblock & ~forced).sum())


def _c2f_feedback_rows(workload: dict[str, object], dn: Dense, now: tuple[F32, F32],
                       before: tuple[F32, F32], exact: F32, gc: int, plan: QualityPlan,
                       kvh: int, rb: float, suffix: str,
                       earlier: tuple[F32, F32, F32] | None = None) -> list[dict[str, object]]:
    """Coarse-to-fine with selection feedback (lag 1): fb- rows take the previous step's
    list as the same c2f selection with the query before; with `earlier` (coarse and fine
    estimates with the query three positions back, and the exact log mass × sqrt(d) of the
    query two back), fb2- rows take it with one step of feedback itself. See _c2f_pick."""
    out: list[dict[str, object]] = []
    Gc, nb = now[0].shape[1], now[1].shape[1]
    for depth in (1, 2) if earlier is not None else (1,):
        for cand in plan.c2f_candidates:
            masks, bytes_per_block, params = [], [], []
            for f in plan.fractions:
                if depth == 1:
                    prev, _ = _c2f_pick(before[0], before[1], gc, f, cand, kvh)
                else:
                    assert earlier is not None
                    first, _ = _c2f_pick(earlier[0], earlier[1], gc, f, cand, kvh)
                    prev, _ = _c2f_pick(before[0], before[1], gc, f, cand, kvh,
                                        visited=first[0].astype(bool), exact=earlier[2])
                m, fine_read = _c2f_pick(now[0], now[1], gc, f, cand, kvh,
                                         visited=prev[0].astype(bool), exact=exact)
                masks.append(m)
                bytes_per_block.append((Gc * rb + fine_read * rb) / nb)
                params.append(float(f))
            met = evaluate(dn, 1, np.stack(masks), [1] * len(masks), bytes_per_block)
            prefix = "fb" if depth == 1 else "fb2"
            out += _rows(workload, "c2f", f"{prefix}-c2f{gc}x{cand:g}{suffix}", 1, 1, params, 0.0,
                         nb, met)
    return out


def _c2f_rows(workload: dict[str, object], dn: Dense, coarse: F32, fine: F32, gc: int, lag: int,
              plan: QualityPlan, kvh: int, rb: float, suffix: str = "") -> list[dict[str, object]]:
    """Rows of coarse-to-fine selection; rb: the scorer's record bytes per (group, KV head),
    the same at both levels."""
    Gc = coarse.shape[1]
    nb = fine.shape[1]
    out: list[dict[str, object]] = []
    for cand in plan.c2f_candidates:
        masks, bytes_per_block, params = [], [], []
        for f in plan.fractions:
            m, fine_read = _c2f_pick(coarse, fine, gc, f, cand, kvh)
            masks.append(m)
            # Summary bytes per (block, KV head): every coarse record plus the fine
            # records of the candidate blocks (forced blocks need no score).
            bytes_per_block.append((Gc * rb + fine_read * rb) / nb)
            params.append(float(f))
        met = evaluate(dn, 1, np.stack(masks), [1] * len(masks), bytes_per_block)
        out += _rows(workload, "c2f", f"c2f{gc}x{cand:g}{suffix}", 1, lag, params, 0.0, nb, met)
    return out
