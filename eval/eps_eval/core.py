"""ctypes binding of libeps_eval (eval/capi.cc): one layer of one sequence."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt

KEY_SUM, PRINCIPAL, QUEST, QUEST8 = 1, 2, 4, 8  # eval/capi.cc FeaturesFromMask
ALL_FEATURES = KEY_SUM | PRINCIPAL | QUEST
STAT_FIELDS = (
    "groups_total",
    "groups_visited",
    "blocks_total",
    "blocks_visited",
    "kv_bytes_dense",
    "kv_bytes_read_est",
    "summary_bytes_read",
)

class Budget(ctypes.Structure):
    """SelectPolicy's budget fields (eval/capi.cc EvalBudget), by core's names: budget
    "threshold", "fixed", "top_p" or "mass"; mass_scope "head" or "list"."""

    _fields_ = [
        ("budget", ctypes.c_char_p),
        ("top_p", ctypes.c_float),
        ("mass_target", ctypes.c_float),
        ("mass_temperature", ctypes.c_float),
        ("min_pages", ctypes.c_int),
        ("max_pages", ctypes.c_int),
        ("mass_scope", ctypes.c_char_p),
    ]


def budget(
    kind: str = "threshold",
    *,
    top_p: float = 0.95,
    mass_target: float = 0.95,
    mass_temperature: float = 1.0,
    min_pages: int = 0,
    max_pages: int = 0,
    mass_scope: str = "head",
) -> Budget:
    """A budget for Sequence.select (defaults: SelectPolicy's)."""
    return Budget(kind.encode(), top_p, mass_target, mass_temperature, min_pages, max_pages,
                  mass_scope.encode())


def list_count(n: int, *, scope: str = "list") -> Budget:
    """The list-count budget: the mass budget at τ = 1 with floor = ceiling = n unforced
    groups, so a list (scope "list": MarkByMassList) keeps the n best groups by the sum over
    its heads of each head's softmax share, whatever the target."""
    return budget("mass", mass_target=1.0, mass_temperature=1.0, min_pages=n, max_pages=n,
                  mass_scope=scope)


_F32P = ctypes.POINTER(ctypes.c_float)
_U8P = ctypes.POINTER(ctypes.c_uint8)
_I32P = ctypes.POINTER(ctypes.c_int32)
_I64P = ctypes.POINTER(ctypes.c_int64)


def _find_library() -> Path:
    env = os.environ.get("EPS_EVAL_LIB")
    if env:
        return Path(env)
    root = Path(__file__).resolve().parents[2]
    for cand in (root / "build" / "eval" / "libeps_eval.so",):
        if cand.exists():
            return cand
    raise FileNotFoundError(
        "libeps_eval.so not found: build it (cmake --build build --target eps_eval) "
        "or set EPS_EVAL_LIB"
    )


_LIB: ctypes.CDLL | None = None


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        so = ctypes.CDLL(str(_find_library()))
        so.eps_eval_new.restype = ctypes.c_void_p
        so.eps_eval_new.argtypes = [ctypes.c_int] * 5 + [
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        so.eps_eval_free.argtypes = [ctypes.c_void_p]
        so.eps_eval_append.argtypes = [
            ctypes.c_void_p,
            _F32P,
            ctypes.c_int64,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        so.eps_eval_tokens.restype = ctypes.c_int64
        so.eps_eval_tokens.argtypes = [ctypes.c_void_p]
        so.eps_eval_groups.restype = ctypes.c_int64
        so.eps_eval_groups.argtypes = [ctypes.c_void_p]
        so.eps_eval_record_bytes.argtypes = [ctypes.c_int] * 3
        so.eps_eval_quest8_scales.argtypes = [
            _F32P,
            ctypes.c_int64,
            _F32P,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        so.eps_eval_scores.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            _F32P,
            _F32P,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        so.eps_eval_mark.argtypes = [
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.c_int,
            _F32P,
            ctypes.c_int,
            ctypes.c_int,
            _I32P,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.c_int,
            _U8P,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        so.eps_eval_mark_mass.argtypes = [
            ctypes.c_int64,
            ctypes.c_int,
            ctypes.c_int,
            _F32P,
            ctypes.c_int,
            ctypes.c_int,
            _F32P,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            _U8P,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        so.eps_eval_select.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            _F32P,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.POINTER(Budget),
            _F32P,
            _U8P,
            _I64P,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        _LIB = so
    return _LIB


class CoreError(RuntimeError):
    """An error status returned by the core."""


def _f32(a: npt.ArrayLike) -> npt.NDArray[np.float32]:
    return np.ascontiguousarray(a, dtype=np.float32)


def _ptr(a: np.ndarray, kind: type) -> ctypes._Pointer:  # type: ignore[type-arg]
    return a.ctypes.data_as(kind)


def record_bytes(head_dim: int, sketch_dim: int, features: int) -> int:
    return int(lib().eps_eval_record_bytes(head_dim, sketch_dim, features))


def quest8_scales(amax: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """core's Quest8ScaleFor of each element of amax (float32, every one finite and > 0):
    the smallest power of two s >= 2^-149 with 127·s >= amax, the scale core's writer
    stores in a quest8 record. One call into the core for the whole array."""
    a = _f32(amax)  # at least 1-d: amax's shape is restored below
    out = np.empty_like(a)
    err = ctypes.create_string_buffer(512)
    if lib().eps_eval_quest8_scales(_ptr(a, _F32P), a.size, _ptr(out, _F32P), err, len(err)) != 0:
        raise CoreError(err.value.decode())
    return out.reshape(np.shape(amax))


def mark(
    scores: npt.NDArray[np.float32],
    kv_heads: int,
    top_pages: list[int],
    *,
    alpha: float = 1.0,
    per_kv_head: bool = False,
    first_n: int = 1,
    last_n: int = 2,
) -> npt.NDArray[np.uint8]:
    """Threshold selection from scores [q_heads, n]: marks [len(top_pages), lists, n]."""
    s = _f32(scores)
    q_heads, n = s.shape
    lists = kv_heads if per_kv_head else 1
    out = np.zeros((len(top_pages), lists, n), dtype=np.uint8)
    tp = np.ascontiguousarray(top_pages, dtype=np.int32)
    err = ctypes.create_string_buffer(512)
    rc = lib().eps_eval_mark(
        n, q_heads, kv_heads, _ptr(s, _F32P), first_n, last_n, _ptr(tp, _I32P), len(tp),
        alpha, int(per_kv_head), _ptr(out, _U8P), err, len(err),
    )
    if rc != 0:
        raise CoreError(err.value.decode())
    return out


def mark_mass(
    scores: npt.NDArray[np.float32],
    kv_heads: int,
    targets: list[float],
    *,
    temperature: float,
    head_dim: int,
    min_pages: int = 0,
    max_pages: int = 0,
    per_kv_head: bool = False,
    first_n: int = 1,
    last_n: int = 2,
    scope: str = "head",
) -> npt.NDArray[np.uint8]:
    """Mass budget from scores [q_heads, n]: marks [len(targets), lists, n]. scope "head":
    core MarkByMass per head, OR-ed per list; "list": core MarkByMassList per list."""
    if scope not in ("head", "list"):
        raise ValueError(f"scope={scope!r} is not 'head' or 'list'")
    s = _f32(scores)
    q_heads, n = s.shape
    lists = kv_heads if per_kv_head else 1
    out = np.zeros((len(targets), lists, n), dtype=np.uint8)
    tg = _f32(targets)
    err = ctypes.create_string_buffer(512)
    rc = lib().eps_eval_mark_mass(
        n, q_heads, kv_heads, _ptr(s, _F32P), first_n, last_n, _ptr(tg, _F32P), len(tg),
        temperature, head_dim, min_pages, max_pages, int(per_kv_head), int(scope == "list"),
        _ptr(out, _U8P), err,
        len(err),
    )
    if rc != 0:
        raise CoreError(err.value.decode())
    return out


class Sequence:
    """One layer of one sequence in the core: keys, summaries, selection."""

    def __init__(
        self,
        *,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        group_blocks: int,
        sketch_dim: int,
        features: int,
        max_tokens: int,
        phi_seed: int = 42,
        coarse_blocks: int = 0,
    ) -> None:
        """coarse_blocks: the coarse level's blocks per coarse group (0: none); its records
        are written from the same keys, as an engine writes them."""
        err = ctypes.create_string_buffer(512)
        self._h = lib().eps_eval_new(
            q_heads, kv_heads, head_dim, group_blocks, sketch_dim, phi_seed, features,
            max_tokens, coarse_blocks, err, len(err),
        )
        if not self._h:
            raise CoreError(err.value.decode())
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.group_blocks, self.sketch_dim, self.features = group_blocks, sketch_dim, features
        self.coarse_blocks = coarse_blocks

    def close(self) -> None:
        if self._h:
            lib().eps_eval_free(self._h)
            self._h = None

    def __del__(self) -> None:
        self.close()

    @property
    def tokens(self) -> int:
        return int(lib().eps_eval_tokens(self._h))

    @property
    def groups(self) -> int:
        return int(lib().eps_eval_groups(self._h))

    def append(self, keys: npt.ArrayLike) -> None:
        """keys: [kv_heads, n, d]."""
        k = _f32(keys)
        if k.ndim != 3 or k.shape[0] != self.kv_heads or k.shape[2] != self.head_dim:
            raise ValueError(f"keys shape {k.shape} is not [kv_heads, n, {self.head_dim}]")
        err = ctypes.create_string_buffer(512)
        if lib().eps_eval_append(self._h, _ptr(k, _F32P), k.shape[1], err, len(err)) != 0:
            raise CoreError(err.value.decode())

    def scores(self, method: str, queries: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """Scores [q_heads, groups] of `method` for queries [q_heads, d]."""
        q = _f32(queries)
        if q.shape != (self.q_heads, self.head_dim):
            raise ValueError(f"queries shape {q.shape} != {(self.q_heads, self.head_dim)}")
        out = np.empty((self.q_heads, self.groups), dtype=np.float32)
        err = ctypes.create_string_buffer(512)
        rc = lib().eps_eval_scores(
            self._h, method.encode(), _ptr(q, _F32P), _ptr(out, _F32P), err, len(err)
        )
        if rc != 0:
            raise CoreError(err.value.decode())
        return out

    def select(
        self,
        method: str,
        queries: npt.ArrayLike,
        top_pages: int,
        *,
        alpha: float = 1.0,
        strict: bool = False,
        per_kv_head: bool = False,
        first_n: int = 1,
        last_n: int = 2,
        coarse_candidates: float = 2.0,
        feedback: npt.ArrayLike | None = None,
        budget: Budget | None = None,
    ) -> tuple[npt.NDArray[np.uint8], dict[str, int]]:
        """PageSelector::Select: marks [lists, groups] and the step's StepStats
        (coarse_candidates: SelectPolicy.coarse_candidates, used with a coarse level, whose
        per-head candidate count reads top_pages whatever the budget; feedback: [q_heads,
        groups] log-sum-exp of the groups the previous step visited, NaN elsewhere:
        StepInputs::feedback; budget: None for the threshold budget, else `budget(...)`)."""
        q = _f32(queries)
        if q.shape != (self.q_heads, self.head_dim):
            raise ValueError(f"queries shape {q.shape} != {(self.q_heads, self.head_dim)}")
        lists = self.kv_heads if per_kv_head else 1
        fb = None
        if feedback is not None:
            f = _f32(feedback)
            if f.shape != (self.q_heads, self.groups):
                raise ValueError(f"feedback shape {f.shape} != {(self.q_heads, self.groups)}")
            fb = _ptr(f, _F32P)
        visit = np.zeros((lists, self.groups), dtype=np.uint8)
        stats = np.zeros(7, dtype=np.int64)
        err = ctypes.create_string_buffer(512)
        rc = lib().eps_eval_select(
            self._h, method.encode(), _ptr(q, _F32P), top_pages, alpha, int(strict),
            int(per_kv_head), first_n, last_n, coarse_candidates,
            None if budget is None else ctypes.byref(budget), fb, _ptr(visit, _U8P),
            _ptr(stats, _I64P), err, len(err),
        )
        if rc != 0:
            raise CoreError(err.value.decode())
        return visit, dict(zip(STAT_FIELDS, (int(x) for x in stats)))
