"""The list-count budget through core, with selection feedback in its steady state (issue 19).

The feedback-memory simulation (eps_eval.feedback_memory, `fbmem1-union`) found that a
list-level rule helps: each head's softmax shares of the blocks it may visit, summed over
the list's heads, and the n best blocks by that sum. epsd expresses it with the mass
budget: `budget = mass`, `mass_scope = list` (core MarkByMassList), τ = 1 and
min_pages = max_pages = n, so the floor takes the n best groups by the summed share and the
ceiling stops there, whatever the target. Here core's PageSelector::Select (libeps_eval)
makes every list, with or without epsd's coarse level and selection feedback:

  epsd-lc-{shape}-questclt     the list-count budget, no feedback;
  epsd-lcfb-{shape}-questclt   the same with core's selection feedback in steady state;
  epsd-thrfb-{shape}-questclt  the threshold budget (top_pages = n per head) with feedback
                               in steady state: fbmem1's rule through core.

shape: `c2f{gc}x{c}` (g = 1 blocks under coarse groups of gc blocks, coarse_candidates c),
with `t{r}` when the candidates read top_pages = ceil(r·n) instead of n (core names
ceil(c·top_pages/gc) coarse groups per head whatever the budget), or `g{g}` (flat groups of
g blocks, no coarse level). Summaries: key_sum and quest8, which questclt reads; summary
bytes are the records the step's StepStats count, at quest8's size (as the epsd-c2f rows).

Steady state: as FeedbackMemory, the selection runs step by step from `warmup` positions
before the first measured one (each later call runs the steps since the last): at step s
(c = s + 1 keys) core selects with the lag-1 query q_{s−1}, fed for every group the
previous list holds the exact log Σ exp(q·k/√d) that step's attention computed (query
q_{s−1} over its c − 1 keys; NaN elsewhere), each swept n with its own history. The
no-feedback rows select at the measured steps only (they have no history).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from eps_eval import core
from eps_eval.feedback_memory import block_log_mass
from eps_eval.metrics import Dense, evaluate

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
FEATURES = core.KEY_SUM | core.QUEST8
METHOD = "questclt"
FORCED = 3  # core's first_n = 1 and last_n = 2 groups
# (name, budget, g, params, groups, met) of one sweep: what quality._rows formats.
Sweep = tuple[str, str, int, list[float], int, dict[str, F64]]


@dataclass(frozen=True)
class ListCountConfig:
    """One selection through core: coarse level gc (0: none) with candidates c, group size g,
    budget "list" (the list-count budget) or "threshold", and top_ratio r: top_pages =
    ceil(r·n) (the threshold budget takes r = 1)."""

    gc: int
    g: int
    cand: float
    budget: str
    top_ratio: float = 1.0

    @property
    def shape(self) -> str:
        if self.gc == 0:
            return f"g{self.g}"
        ratio = "" if self.top_ratio == 1.0 else f"t{self.top_ratio:g}"
        return f"c2f{self.gc}x{self.cand:g}{ratio}"

    def name(self, fed: bool) -> str:
        kind = "lc" if self.budget == "list" else "thr"
        return f"epsd-{kind}{'fb' if fed else ''}-{self.shape}-{METHOD}"

    def variants(self) -> tuple[bool, ...]:
        """Feedback off and on; the threshold budget without feedback is the epsd-c2f rows."""
        return (True,) if self.budget == "threshold" else (False, True)

    def select(self, seq: core.Sequence, q: F32, n: int, feedback: F32 | None
               ) -> tuple[npt.NDArray[np.uint8], dict[str, int]]:
        top = n if self.budget == "threshold" else max(1, math.ceil(self.top_ratio * n))
        budget = None if self.budget == "threshold" else core.list_count(n)
        return seq.select(METHOD, q, top, coarse_candidates=self.cand, feedback=feedback,
                          budget=budget)


def counts(groups: int, fractions: tuple[float, ...]) -> list[int]:
    """n for each fraction of the unforced groups (one n per fraction, repeats kept, so each
    fraction keeps its own history)."""
    unforced = max(1, groups - FORCED)
    return [max(1, round(f * unforced)) for f in fractions]


def block_lse(q: F32, k: F32) -> F64:
    """log Σ_{i in block} exp(q·k_i/√d) [H, nb] of q [H, d] over keys k [kv, c, d]: what the
    attention kernel reports as feedback (StepInputs::feedback's units)."""
    return block_log_mass(q, k) / np.sqrt(q.shape[1])


def group_lse(lse: F64, g: int) -> F64:
    """Blocks' log-sum-exp [H, nb] combined into groups of g blocks [H, ceil(nb / g)]."""
    if g == 1:
        return lse
    h, nb = lse.shape
    G = -(-nb // g)
    x = np.pad(lse, ((0, 0), (0, G * g - nb)), constant_values=-np.inf).reshape(h, G, g)
    top = x.max(axis=2, keepdims=True)
    return np.log(np.exp(x - top).sum(axis=2)) + top[..., 0]


def fed_entries(visited: npt.NDArray[np.bool_], lse: F64, groups: int) -> F32:
    """StepInputs::feedback [H, groups]: lse [H, G'] for the groups the previous list holds
    (G' ≤ groups: the context has grown since), NaN elsewhere."""
    out = np.full((lse.shape[0], groups), np.nan, dtype=np.float32)
    m = visited.size
    out[:, :m] = np.where(visited[None], lse[:, :m], np.nan)
    return out


@dataclass
class ListCountSim:
    """The list-count (and steady-state threshold) selections of one layer through core.

    Call `sweeps` with increasing positions; see the module docstring."""

    configs: tuple[ListCountConfig, ...]
    fractions: tuple[float, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    max_tokens: int
    warmup: int
    quest8_bytes: float  # quest8's record per (group, KV head)
    seqs: dict[tuple[int, int], core.Sequence] = field(default_factory=dict)
    tokens: int = 0
    next_step: int | None = None
    # Per (config, fraction index): the list the last step made with feedback.
    previous: dict[tuple[ListCountConfig, int], npt.NDArray[np.bool_]] = field(
        default_factory=dict)
    lse: F64 | None = None  # [H, nb] the last step's attention, per block

    def __post_init__(self) -> None:
        for c in self.configs:
            if (c.gc, c.g) not in self.seqs:
                self.seqs[(c.gc, c.g)] = core.Sequence(
                    q_heads=self.q_heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                    group_blocks=c.g, sketch_dim=8, features=FEATURES,
                    max_tokens=self.max_tokens, coarse_blocks=c.gc)
        self.core_record = core.record_bytes(self.head_dim, 8, FEATURES)

    def _extend(self, k: F32, tokens: int) -> None:
        if tokens > self.tokens:
            chunk = np.ascontiguousarray(k[:, self.tokens:tokens])
            for s in self.seqs.values():
                s.append(chunk)
            self.tokens = tokens

    def sweeps(self, k: F32, q_by_pos: dict[int, F32], position: int, dn: Dense) -> list[Sweep]:
        start = position - self.warmup if self.next_step is None else self.next_step
        if start > position:
            raise ValueError(f"position {position} is before the next step {start}")
        for s in range(start, position):
            self._step(k, q_by_pos, s, measured=False)
        marks = self._step(k, q_by_pos, position, measured=True)
        self.next_step = position + 1
        out: list[Sweep] = []
        params = [float(f) for f in self.fractions]
        for c in self.configs:
            for fed in c.variants():
                masks, per_record = marks[(c, fed)]
                met = evaluate(dn, c.g, np.stack(masks), [1] * len(masks), per_record)
                out.append((c.name(fed), "listcount" if c.budget == "list" else "c2f", c.g,
                            params, masks[0].shape[1], met))
        return out

    def _step(self, k: F32, q_by_pos: dict[int, F32], s: int, measured: bool
              ) -> dict[tuple[ListCountConfig, bool], tuple[list[npt.NDArray[np.uint8]],
                                                            list[float]]]:
        """Step s: every config's lists with the lag-1 query (fed ones from the previous
        step's lists), then the attention of s (its own query) as the next step's feedback."""
        c = s + 1
        self._extend(k, c)
        q = np.ascontiguousarray(q_by_pos[s - 1], dtype=np.float32)
        out: dict[tuple[ListCountConfig, bool], tuple[list[npt.NDArray[np.uint8]],
                                                      list[float]]] = {}
        for cfg in self.configs:
            seq = self.seqs[(cfg.gc, cfg.g)]
            G = seq.groups
            lse = None if self.lse is None else group_lse(self.lse, cfg.g)
            for fed in cfg.variants() if measured else (True,):
                masks, per_record = [], []
                for fi, n in enumerate(counts(G, self.fractions)):
                    feedback = None
                    if fed and lse is not None and (cfg, fi) in self.previous:
                        feedback = fed_entries(self.previous[(cfg, fi)], lse, G)
                    visit, st = cfg.select(seq, q, n, feedback)
                    if fed:
                        self.previous[(cfg, fi)] = visit[0].astype(bool)
                    masks.append(visit)
                    records = st["summary_bytes_read"] / self.core_record
                    per_record.append(records * self.quest8_bytes / (self.kv_heads * G))
                out[(cfg, fed)] = (masks, per_record)
        self.lse = block_lse(np.asarray(q_by_pos[s], dtype=np.float32), k[:, :c])
        return out
