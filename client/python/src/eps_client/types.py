"""Plain Python values of the client API; protobuf messages stay inside the package.

``SelectOptions`` (the selection policy) with ``MassSetting`` (one layer's mass budget),
``Row`` (one sequence of a step), ``StepStats`` (a step's counters), ``AttachInfo`` (what
Attach granted) and ``EpsError`` (a failed call, with its status code). Each converts to or from
its eps.v1 message here and nowhere else. ``StepResult`` (one step's outcome, fallback or not)
and ``ClientCounters`` (an EpsClient's steps by outcome) have no message of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import grpc

from eps_client import _values
from eps_client.proto import page_selector_pb2 as pb

StatusCode = grpc.StatusCode  # the canonical codes, as gRPC spells them

Method = Literal["off", "jl", "1pc", "fro", "quest", "questclt"]
HeadMode = Literal["all", "retrieval"]
Budget = Literal["threshold", "fixed", "top_p", "mass"]
Granularity = Literal["union", "per_kv_head"]
MassScope = Literal["head", "list"]
Backend = Literal["auto", "cpu", "cuda"]

_METHOD = {"off": pb.METHOD_OFF, "jl": pb.METHOD_JL, "1pc": pb.METHOD_1PC,
           "fro": pb.METHOD_FRO, "quest": pb.METHOD_QUEST, "questclt": pb.METHOD_QUEST_CLT}
_HEADS = {"all": pb.HEAD_MODE_ALL, "retrieval": pb.HEAD_MODE_RETRIEVAL}
_BUDGET = {"threshold": pb.BUDGET_THRESHOLD, "fixed": pb.BUDGET_FIXED,
           "top_p": pb.BUDGET_TOP_P, "mass": pb.BUDGET_MASS}
_GRANULARITY = {"union": pb.GRANULARITY_UNION, "per_kv_head": pb.GRANULARITY_PER_KV_HEAD}
_MASS_SCOPE = {"head": pb.MASS_SCOPE_HEAD, "list": pb.MASS_SCOPE_LIST}
_BACKEND = {"auto": pb.BACKEND_UNSPECIFIED, "cpu": pb.BACKEND_CPU, "cuda": pb.BACKEND_CUDA}


class EpsError(Exception):
    """A failed call. ``code`` is the canonical status code (``grpc.StatusCode``), ``message``
    the server's or the client's explanation (it names the offending field and value)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[type[EpsError], tuple[grpc.StatusCode, str]]:
        # Rebuilt from (code, message), not from the one formatted arg Exception keeps: a
        # failed call crosses processes (multiprocessing, a ProcessPoolExecutor) pickled.
        return (EpsError, (self.code, self.message))


def _pick(table: Mapping[str, int], name: str, value: str | None) -> int:
    if value is None:
        return 0  # UNSPECIFIED: keep the server's or the session's setting
    if not isinstance(value, str):
        raise TypeError(f"{name}={value!r} is not a str (one of {sorted(table)})")
    if value not in table:
        raise ValueError(f"{name}={value!r} is not one of {sorted(table)}")
    return table[value]


# epsd's intervals of the float32 fields (SelectPolicy::Validate, docs/api.md), repeated here
# only to refuse a value that rounding to float32 moves across an end (_values.real): epsd
# checks the intervals themselves.
_SHARE = _values.Interval(0.0, 1.0, lo_open=True)  # p: top_p, a mass target
_TEMPERATURE = _values.Interval(0.0, 1000.0, lo_open=True)
_MASS_SETTING_FLOATS = {"target": _SHARE, "temperature": _TEMPERATURE}


@dataclass(frozen=True)
class MassSetting:
    """One layer's mass budget (``SelectOptions.mass_layers``): the SelectOptions fields of the
    same names, for that layer alone. Every field is sent; none falls back to the session's."""

    target: float  # p in (0, 1]
    temperature: float = 1.0  # τ in (0, 1000]
    min_pages: int = 0  # floor per head (per list with scope "list")
    max_pages: int = 0  # ceiling per head (list), 0 = none

    def __post_init__(self) -> None:
        # Types and the wire's ranges only: epsd checks p and τ against their intervals (a
        # value that float32 rounding moves across an end is refused here).
        for name, interval in _MASS_SETTING_FLOATS.items():
            object.__setattr__(self, name, _values.real(f"MassSetting.{name}",
                                                        getattr(self, name), interval))
        for name in ("min_pages", "max_pages"):
            object.__setattr__(self, name, _values.integer(f"MassSetting.{name}",
                                                           getattr(self, name), *_values.UINT32))

    def to_proto(self) -> pb.MassSetting:
        return pb.MassSetting(target=self.target, temperature=self.temperature,
                              min_pages=self.min_pages, max_pages=self.max_pages)

    @staticmethod
    def from_proto(message: pb.MassSetting) -> MassSetting:
        return MassSetting(target=message.target, temperature=message.temperature,
                           min_pages=message.min_pages, max_pages=message.max_pages)


# SelectOptions' float32 fields and epsd's intervals for them, as _MASS_SETTING_FLOATS.
_FLOAT_FIELDS = {"alpha": _values.Interval(1.0, 1e6),
                 "top_p": _SHARE,
                 "mass_target": _SHARE,
                 "mass_temperature": _TEMPERATURE,
                 "coarse_candidates": _values.Interval(1.0, 1024.0)}
_UINT32_FIELDS = ("first_n", "last_n", "top_pages", "min_pages", "max_pages")


@dataclass(frozen=True)
class SelectOptions:
    """The selection policy (docs/policy-selection.md). ``None`` keeps the server's flag (at
    attach) or the session's setting (per step)."""

    method: Method | None = None
    alpha: float | None = None
    first_n: int | None = None
    last_n: int | None = None
    top_pages: int | None = None
    strict: bool | None = None
    heads: HeadMode | None = None
    retrieval_heads: bytes = b""  # [layers * q_heads], nonzero marks a retrieval head
    budget: Budget | None = None
    top_p: float | None = None
    granularity: Granularity | None = None
    mass_target: float | None = None  # budget "mass": p in (0, 1]
    mass_temperature: float | None = None  # budget "mass": τ in (0, 1000]
    min_pages: int | None = None  # budget "mass": floor per head (per list with scope "list")
    max_pages: int | None = None  # budget "mass": ceiling per head (list), 0 = none
    # budget "mass": "head" (every head reaches p of its own mass) or "list" (the list reaches
    # p of its heads' mean mass; fewer groups)
    mass_scope: MassScope | None = None
    # With a coarse level (ModelLayout.coarse_blocks): each scored head's
    # ceil(c * top_pages / r) best coarse groups are candidates; c in [1, 1024], default 2
    coarse_candidates: float | None = None
    # budget "mass": one setting per layer (exactly num_layers), replacing mass_target,
    # mass_temperature, min_pages and max_pages layer by layer. Empty keeps the session's list
    # (per step) or every layer on the four fields (at attach); a list replaces the whole list,
    # for that step only. Both backends run it (docs/policy-selection.md, "A setting per layer").
    mass_layers: Sequence[MassSetting] = ()

    def __post_init__(self) -> None:
        """Refuses a field of the wrong type or beyond its wire type (TypeError, ValueError,
        naming the field) here, so that ``to_proto`` cannot fail; None stays unset. The
        ranges that depend on the session (top_pages against its groups, say) are epsd's."""
        for name, table in (("method", _METHOD), ("heads", _HEADS), ("budget", _BUDGET),
                            ("granularity", _GRANULARITY), ("mass_scope", _MASS_SCOPE)):
            _pick(table, f"SelectOptions.{name}", getattr(self, name))
        for name, interval in _FLOAT_FIELDS.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _values.real(f"SelectOptions.{name}",
                                                            getattr(self, name), interval))
        for name in _UINT32_FIELDS:
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _values.integer(
                    f"SelectOptions.{name}", getattr(self, name), *_values.UINT32))
        if self.strict is not None:
            object.__setattr__(self, "strict", _values.boolean("SelectOptions.strict",
                                                               self.strict))
        if not isinstance(self.retrieval_heads, (bytes, bytearray, memoryview)):
            raise TypeError(f"SelectOptions.retrieval_heads={self.retrieval_heads!r} is not "
                            f"bytes")
        object.__setattr__(self, "retrieval_heads", bytes(self.retrieval_heads))
        if isinstance(self.mass_layers, (str, bytes)) or not isinstance(self.mass_layers,
                                                                         Iterable):
            raise TypeError(f"SelectOptions.mass_layers={self.mass_layers!r} is not a sequence "
                            f"of MassSetting")
        layers = tuple(self.mass_layers)  # frozen: hashable
        for i, m in enumerate(layers):
            if not isinstance(m, MassSetting):
                raise TypeError(f"SelectOptions.mass_layers[{i}]={m!r} is not a MassSetting")
        object.__setattr__(self, "mass_layers", layers)

    def to_proto(self) -> pb.SelectOptions:
        out = pb.SelectOptions(method=_pick(_METHOD, "method", self.method),  # type: ignore[arg-type]
                               heads=_pick(_HEADS, "heads", self.heads),  # type: ignore[arg-type]
                               budget=_pick(_BUDGET, "budget", self.budget),  # type: ignore[arg-type]
                               granularity=_pick(_GRANULARITY, "granularity",  # type: ignore[arg-type]
                                                 self.granularity),
                               mass_scope=_pick(_MASS_SCOPE, "mass_scope",  # type: ignore[arg-type]
                                                self.mass_scope),
                               retrieval_heads=self.retrieval_heads)
        for name in (*_FLOAT_FIELDS, *_UINT32_FIELDS, "strict"):
            value = getattr(self, name)
            if value is not None:
                setattr(out, name, value)
        out.mass_layers.extend(m.to_proto() for m in self.mass_layers)
        return out

    @staticmethod
    def from_proto(message: pb.SelectOptions) -> SelectOptions:
        def name_of(table: dict[str, int], value: int) -> str | None:
            return next((k for k, v in table.items() if v == value), None)

        def opt(field_name: str) -> object:
            return getattr(message, field_name) if message.HasField(field_name) else None

        return SelectOptions(
            method=name_of(_METHOD, message.method),  # type: ignore[arg-type]
            alpha=opt("alpha"), first_n=opt("first_n"), last_n=opt("last_n"),  # type: ignore[arg-type]
            top_pages=opt("top_pages"), strict=opt("strict"),  # type: ignore[arg-type]
            heads=name_of(_HEADS, message.heads),  # type: ignore[arg-type]
            retrieval_heads=bytes(message.retrieval_heads),
            budget=name_of(_BUDGET, message.budget),  # type: ignore[arg-type]
            top_p=opt("top_p"),  # type: ignore[arg-type]
            granularity=name_of(_GRANULARITY, message.granularity),  # type: ignore[arg-type]
            mass_target=opt("mass_target"),  # type: ignore[arg-type]
            mass_temperature=opt("mass_temperature"),  # type: ignore[arg-type]
            min_pages=opt("min_pages"), max_pages=opt("max_pages"),  # type: ignore[arg-type]
            mass_scope=name_of(_MASS_SCOPE, message.mass_scope),  # type: ignore[arg-type]
            coarse_candidates=opt("coarse_candidates"),  # type: ignore[arg-type]
            mass_layers=tuple(MassSetting.from_proto(m) for m in message.mass_layers))


def backend_proto(backend: Backend) -> int:
    return _pick(_BACKEND, "backend", backend)


class Row(NamedTuple):
    """One sequence of a step: batch position i reads queries[:, i] and writes lists [:, i]."""

    table_row: int  # row of the group and block tables
    context_tokens: int  # tokens in the KV cache, the newest included
    seq_id: int = 0  # the engine's own id (not used by epsd)


_ROW_RANGES = {"table_row": _values.INT32, "context_tokens": _values.INT64,
               "seq_id": _values.UINT64}  # BatchRow's int32, int64 and uint64


def rows_proto(rows: Iterable[Row | tuple[int, int] | tuple[int, int, int]]) -> list[pb.BatchRow]:
    """The rows as BatchRow messages. Refuses (TypeError, ValueError, naming the row and the
    field: ``rows[1].table_row=None is not an integer``) what protobuf would send as 0 or
    refuse itself: None, floats, bools, values beyond the field's wire type. Whether a row
    fits the session (table_row < max_seqs, say) is epsd's to check."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise TypeError(f"rows={rows!r} is not a sequence of Row")
    out = []
    for i, r in enumerate(rows):
        if isinstance(r, (str, bytes)) or not isinstance(r, Iterable):
            raise TypeError(f"rows[{i}]={r!r} is not a Row or (table_row, context_tokens"
                            f"[, seq_id])")
        fields = tuple(r)
        if not 2 <= len(fields) <= 3:
            raise TypeError(f"rows[{i}]={r!r} is not a Row or (table_row, context_tokens"
                            f"[, seq_id])")
        row = Row(*fields)
        values = {name: _values.integer(f"rows[{i}].{name}", getattr(row, name), *bounds)
                  for name, bounds in _ROW_RANGES.items()}
        out.append(pb.BatchRow(**values))
    return out


@dataclass(frozen=True)
class StepStats:
    """A step's counters, summed over rows, layers and lists (the reply's StepStats)."""

    step: int = 0
    groups_total: int = 0
    groups_visited: int = 0
    pages_total: int = 0
    pages_visited: int = 0
    bytes_kv_dense: int = 0
    bytes_kv_read_est: int = 0
    bytes_summary_read: int = 0
    prepass_us: float = 0.0
    error: str = ""  # an async step that failed on the device (its lists were set dense)

    @staticmethod
    def from_proto(m: pb.StepStats) -> StepStats:
        return StepStats(step=m.step, groups_total=m.groups_total,
                         groups_visited=m.groups_visited, pages_total=m.pages_total,
                         pages_visited=m.pages_visited, bytes_kv_dense=m.bytes_kv_dense,
                         bytes_kv_read_est=m.bytes_kv_read_est,
                         bytes_summary_read=m.bytes_summary_read, prepass_us=m.prepass_us,
                         error=m.error)


@dataclass(frozen=True)
class AttachInfo:
    """What Attach granted."""

    session_id: str
    lease_ms: int
    backend: Backend
    record_words: int
    server_version: str
    options: SelectOptions = field(default_factory=SelectOptions)

    @staticmethod
    def from_proto(m: pb.AttachResponse) -> AttachInfo:
        backend = next((k for k, v in _BACKEND.items() if v == m.backend), "auto")
        return AttachInfo(session_id=m.session_id, lease_ms=m.lease_ms,
                          backend=backend,  # type: ignore[arg-type]
                          record_words=m.record_words, server_version=m.server_version,
                          options=SelectOptions.from_proto(m.effective_options))


@dataclass
class StepResult:
    """One step's outcome. ``fallback``: attend densely this step (fail-open)."""

    step: int = 0
    fallback: bool = False
    code: grpc.StatusCode = grpc.StatusCode.OK  # why, when fallback
    message: str = ""
    done: bool = False  # the outputs are written (sync); False for an accepted async step
    stats: StepStats | None = None  # this step's (sync replies)
    earlier: list[StepStats] = field(default_factory=list)  # async steps finished since
    round_trip_us: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.fallback and self.code == grpc.StatusCode.OK


@dataclass
class ClientCounters:
    """An EpsClient's steps by outcome, fallbacks by reason (EpsClient.counters())."""

    steps: int = 0
    selected: int = 0
    fallback_deadline: int = 0
    fallback_unavailable: int = 0
    fallback_not_attached: int = 0
    fallback_error: int = 0
    reattaches: int = 0
    errors: int = 0  # failed steps raised to a fail-closed engine (not fallbacks)

    @property
    def fallbacks(self) -> int:
        return (self.fallback_deadline + self.fallback_unavailable + self.fallback_not_attached
                + self.fallback_error)
