"""What the quality runs measure (eps_eval.quality): the plans of `run_quality --plan=` and
`run_gemma --plan=`, each a QualityPlan of group sizes, lags, budgets, estimators,
coarse-to-fine configurations and feedback variants."""

from __future__ import annotations

from dataclasses import dataclass

from eps_eval import estimators
from eps_eval.list_count import ListCountConfig

# Shares of the unforced groups swept as the threshold budget's top_pages.
FRACTIONS = (0.01, 0.02, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6, 0.8)


@dataclass(frozen=True)
class QualityPlan:
    group_blocks: tuple[int, ...] = (1, 2, 4, 8, 16)
    lags: tuple[int, ...] = (0, 1, 2, 3, 4)
    fractions: tuple[float, ...] = FRACTIONS
    mass_methods: tuple[str, ...] = ("quest", "quest8", "questmid", "oracle_mass")
    mass_group_blocks: tuple[int, ...] = (1, 2, 4, 8)
    mass_lags: tuple[int, ...] = (0, 1)
    c2f_coarse: tuple[int, ...] = (8, 16)
    c2f_candidates: tuple[float, ...] = (1.5, 2.0, 3.0)  # candidate groups per final block budget
    methods: tuple[str, ...] = ("jl8", "1pc", "fro", "quest", "quest8")  # threshold-budget scorers
    estimators: tuple[str, ...] = ()  # eps_eval.estimators names, from the quest8 record
    c2f_scorers: tuple[str, ...] = ("quest8",)  # scorer of both c2f levels
    mass_union: bool = False  # also the list-level mass budget (massunion)
    # Selection feedback (fb-<estimator>-o<k>, lag 1 only): the groups the previous step
    # selected (the same estimator and budget with the query before) are ranked by the exact
    # mass the previous step's attention computed for them (lag 1); the others by the
    # estimator plus k/2 · sqrt(d)·log(tokens of a group). Costs no summary bytes beyond the
    # estimator's: the attention kernel would report each visited group's mass.
    feedback: tuple[str, ...] = ()
    # quest8's scale per (group, KV head): "fp32" the group's max |k| / 127; "pow2" that
    # rounded up to a power of two, which a writer can apply as keys arrive (QuestTables)
    quest8_scale: str = "fp32"
    # epsd's own coarse level (core PageSelector::Select through libeps_eval, questclt on
    # quest8 records, g = 1 under coarse groups of gc blocks, coarse_candidates c): rows
    # epsd-c2f{gc}x{c}, lag 1, to check the harness's c2f against what epsd ships.
    epsd_c2f: tuple[tuple[int, float], ...] = ()
    # Selection feedback under the mass budget and the threshold budget (eps_eval.feedback_rows,
    # rows fbm-questclt, lag 1, at mass_group_blocks; needs the query two positions back).
    mass_feedback: bool = False
    # Feedback memory (eps_eval.feedback_memory, a harness simulation): memory depths K,
    # each run step by step from `fb_memory_warmup` positions before the first measured
    # one, on c2f{c2f_coarse[0]}x{c2f_candidates[0]} with c2f_scorers[0].
    fb_memory: tuple[int, ...] = ()
    fb_memory_warmup: int = 8
    # Selections through core's PageSelector::Select under the list-count budget (and the
    # threshold budget) with selection feedback in steady state (eps_eval.list_count), run
    # step by step from `list_count_warmup` positions before the first measured one.
    list_count: tuple[ListCountConfig, ...] = ()
    list_count_warmup: int = 8


def query_history(plan: QualityPlan) -> int:
    """How many positions before the first measured one need their query: the largest lag,
    or a step-by-step simulation's warm-up and the query of its first step's lag."""
    return max(max(plan.lags), plan.fb_memory_warmup + 1 if plan.fb_memory else 0,
               plan.list_count_warmup + 1 if plan.list_count else 0)


# Issue 19's estimators against quest and quest8 at equal bytes: lag 1, g <= 8, the
# threshold budget and c2f8x2 only (what their comparison needs, at a CPU's cost).
ESTIMATOR_PLAN = QualityPlan(
    group_blocks=(1, 2, 4, 8), lags=(1,), mass_methods=(), mass_lags=(), c2f_coarse=(8,),
    c2f_candidates=(2.0, 3.0),
    methods=("quest", "questclt", "quest8", "momentlgn", "oracle_mass_lag"),
    estimators=estimators.ESTIMATORS,
    c2f_scorers=("quest8", "questclt0.5", "questclt1", "questclt2", "questblend0.5", "questlgn"))


# The mass budget scored by epsd's questclt against quest's bound: lag 1, the threshold
# budget beside it for the best fixed budget, no c2f (what that comparison needs).
MASS_PLAN = QualityPlan(
    group_blocks=(1, 2, 8), lags=(1,), mass_methods=("quest", "questclt", "oracle_mass"),
    mass_group_blocks=(1, 2, 8), mass_lags=(1,), c2f_coarse=(), c2f_candidates=(),
    methods=("quest", "questclt"), c2f_scorers=())
# The mass plan with the list-level mass budget beside the per-head one, and the exact
# mass under the lag-1 query (oracle_mass_lag) under both budgets and the threshold
# budget: what the best estimator at this lag could reach.
MASS_UNION_PLAN = QualityPlan(
    group_blocks=(1, 2, 8), lags=(1,),
    mass_methods=("quest", "questclt", "questlgn", "oracle_mass", "oracle_mass_lag"),
    mass_group_blocks=(1, 2, 8), mass_lags=(1,), c2f_coarse=(), c2f_candidates=(),
    methods=("quest", "questclt", "oracle_mass_lag"), c2f_scorers=(), mass_union=True,
    estimators=("questlgn",))
# Coarse-to-fine swept: coarse group sizes and candidate widths, both levels scored
# with quest8's bound or questclt1, against questclt1 at g = 1 and 2 (lag 1).
C2F_PLAN = QualityPlan(
    group_blocks=(1, 2), lags=(1,), mass_methods=(), mass_lags=(), c2f_coarse=(2, 4, 8, 16),
    c2f_candidates=(1.5, 2.0, 3.0, 4.0, 6.0), methods=("quest8",), estimators=("questclt1",),
    c2f_scorers=("quest8", "questclt1"))
# questclt centred on the group's mean key (meanclt, d + 4 more bytes) against questclt1,
# at g = 1 and 2 and as both levels of the best coarse-to-fine configurations.
MEAN_PLAN = QualityPlan(
    group_blocks=(1, 2), lags=(1,), mass_methods=(), mass_lags=(), c2f_coarse=(4, 8),
    c2f_candidates=(2.0, 3.0, 4.0), methods=("quest8",),
    estimators=("questclt1", "meanclt0", "meanclt0.5", "meanclt1", "meanclt1.5"),
    c2f_scorers=("questclt1", "meanclt0.5", "meanclt1"))
# Selection feedback (QualityPlan.feedback) against its estimator alone and the exact
# lag-1 mass, at g = 1 and 2 (lag 1; needs the query two positions back).
FEEDBACK_PLAN = QualityPlan(
    group_blocks=(1, 2), lags=(1, 2, 3), mass_methods=(), mass_lags=(), c2f_coarse=(4, 8),
    c2f_candidates=(2.0, 3.0), methods=("oracle_mass_lag",), estimators=("questclt1",),
    c2f_scorers=("questclt1",), feedback=("questclt1",))
# epsd's coarse level (core) beside the harness's coarse-to-fine at the same gc and width.
EPSD_C2F_PLAN = QualityPlan(
    group_blocks=(1, 2), lags=(1,), mass_methods=(), mass_lags=(), c2f_coarse=(4, 8),
    c2f_candidates=(2.0, 3.0), methods=("oracle_mass_lag",), estimators=("questclt1",),
    c2f_scorers=("questclt1",), epsd_c2f=((4, 2.0), (4, 3.0), (8, 2.0), (8, 3.0)))
# epsd's coarse level with and without core's selection feedback (epsd-fb- rows), beside
# the harness's simulated feedback (fb- rows) at the same gc and width (lag 1; needs the
# query two positions back).
EPSD_FEEDBACK_PLAN = QualityPlan(
    group_blocks=(1,), lags=(1, 2), mass_methods=(), mass_lags=(), c2f_coarse=(4, 8),
    c2f_candidates=(2.0, 3.0), methods=("oracle_mass_lag",), estimators=("questclt1",),
    c2f_scorers=("questclt1",), feedback=("questclt1",),
    epsd_c2f=((4, 2.0), (8, 3.0)))
# Feedback memory (issue 19, fifth session): the steady state of selection feedback and
# older exact masses kept K steps, on c2f4x2-questclt1, beside one-step feedback and the
# zero-byte ceilings of lag-K information (eps_eval.feedback_memory).
FEEDBACK_MEMORY_PLAN = QualityPlan(
    group_blocks=(1,), lags=(1,), mass_methods=(), mass_lags=(), c2f_coarse=(4,),
    c2f_candidates=(2.0,), methods=("oracle_mass_lag",), c2f_scorers=("questclt1",),
    feedback=("questclt1",), fb_memory=(1, 2, 4, 8))
# The adaptive budget with selection feedback (fbm-questclt rows) beside questclt without
# it, per head and over the list, for eps_eval.layer_calibration.
MASS_FEEDBACK_PLAN = QualityPlan(
    group_blocks=(2, 8), lags=(1,), mass_methods=("questclt",), mass_group_blocks=(2, 8),
    mass_lags=(1,), c2f_coarse=(), c2f_candidates=(), methods=("quest", "questclt"),
    c2f_scorers=(), mass_union=True, mass_feedback=True)
# The list-count budget through core (issue 19, sixth session): epsd's coarse level
# (gc = 4, c = 2 and gc = 8, c = 3, the candidates reading top_pages = n, n/2 or n/4)
# and flat g = 1, 2, with and without core's selection feedback in steady state,
# and the threshold budget with steady-state feedback; beside them the simulation's K = 1
# rows (fbmem0/1, -union) and the one-step epsd-c2f / epsd-fb-c2f rows on the same pairs.
LIST_COUNT_PLAN = QualityPlan(
    group_blocks=(1,), lags=(1,), mass_methods=(), mass_lags=(), c2f_coarse=(4,),
    c2f_candidates=(2.0,), methods=("oracle_mass_lag",), c2f_scorers=("questclt1",),
    feedback=("questclt1",), fb_memory=(1,), epsd_c2f=((4, 2.0), (8, 3.0)),
    list_count=(*(ListCountConfig(gc, 1, c, "list", r) for gc, c in ((4, 2.0), (8, 3.0))
                  for r in (1.0, 0.5, 0.25)),
                ListCountConfig(0, 1, 1.0, "list"), ListCountConfig(0, 2, 1.0, "list"),
                ListCountConfig(4, 1, 2.0, "threshold"), ListCountConfig(8, 1, 3.0, "threshold")))
# Reusing one selection for k steps with epsd's default scorer: questclt (and quest8, the
# record it reads, as the bound) under the threshold budget at lags 1-4 (report_quality's
# reuse table), g = 1, 2 (epsd's default) and 8.
REUSE_PLAN = QualityPlan(
    group_blocks=(1, 2, 8), lags=(1, 2, 3, 4), mass_methods=(), mass_lags=(), c2f_coarse=(),
    c2f_candidates=(), methods=("questclt", "quest8"), c2f_scorers=())
PLANS = {"full": QualityPlan(), "estimators": ESTIMATOR_PLAN, "mass": MASS_PLAN,
         "massunion": MASS_UNION_PLAN, "c2f": C2F_PLAN, "meancentre": MEAN_PLAN,
         "feedback": FEEDBACK_PLAN, "epsdc2f": EPSD_C2F_PLAN,
         "epsdfeedback": EPSD_FEEDBACK_PLAN, "fbmemory": FEEDBACK_MEMORY_PLAN,
         "massfeedback": MASS_FEEDBACK_PLAN, "listcount": LIST_COUNT_PLAN, "reuse": REUSE_PLAN}
