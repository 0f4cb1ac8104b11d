"""Checked conversions of caller values to the integers and floats the package sends or uses.

Protobuf silently takes ``None`` as unset and ``True`` as 1, and numpy silently truncates
1.9 to 1; these refuse such values instead, with a message that names the field and the
value (``rows[1].table_row=None is not an integer``). Integers go through
``operator.index`` (so numpy integers are welcome and floats are not), bools are refused
where a count or an index is meant. Wrong types raise TypeError, values out of range
ValueError.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import numpy as np

INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)
UINT32 = (0, (1 << 32) - 1)
UINT64 = (0, (1 << 64) - 1)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def integer(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int in [lo, hi] (either bound may be None: unbounded)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} is a bool, not an integer")
    try:
        out = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name}={value!r} is not an integer") from None
    if (lo is not None and out < lo) or (hi is not None and out > hi):
        raise ValueError(f"{name}={out} is not in [{'-inf' if lo is None else lo}, "
                         f"{'inf' if hi is None else hi}]")
    return out


class Interval(NamedTuple):
    """Where epsd takes a float field: [lo, hi], either end open."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: object) -> bool:
        v = float(value)  # type: ignore[arg-type]
        return ((self.lo < v) if self.lo_open else (self.lo <= v)) and (
            (v < self.hi) if self.hi_open else (v <= self.hi))

    def __str__(self) -> str:
        return (f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                f"{')' if self.hi_open else ']'}")


def real(name: str, value: object, interval: Interval | None = None) -> float:
    """``value`` as a finite float that a float32 field holds (ints are welcome, bools not).

    The field carries ``value`` rounded to float32, and epsd checks that value against the
    field's ``interval``: where the rounding moves it across an end (``top_p=1e-46`` is sent
    as 0, which epsd would refuse as ``top_p=0``, a value never given; ``alpha=0.99999999``
    as 1, which epsd would take), this refuses it, naming both. A value outside the interval
    both ways is left for epsd to refuse (it names the float32 value, the one it received).
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating)):
        raise TypeError(f"{name}={value!r} is not a number")
    out = float(value)
    if not math.isfinite(out) or abs(out) > FLOAT32_MAX:
        raise ValueError(f"{name}={out} is not a finite float32")
    if interval is not None:
        sent = float(np.float32(out))
        if (out in interval) != (sent in interval):
            given, rounded = ("in", "not in") if out in interval else ("not in", "in")
            raise ValueError(f"{name}={out!r} is {given} {interval}, but the float32 field "
                             f"sends it as {sent!r}, which is {rounded} {interval}: give a "
                             f"value that float32 holds on the same side")
    return out


# The longest deadline or back-off the client takes, in seconds. Beyond it gRPC's own
# deadline arithmetic and the stream's waits fail (about 8e9 s and time_t's range), and a
# wait of more than an hour bounds nothing an engine can use: such a value is refused
# rather than turned into "no deadline" (a dead epsd must never hang the engine).
MAX_DURATION_S = 3600.0


def duration(name: str, value: object, *, positive: bool = True) -> float:
    """``value`` as seconds in (0, MAX_DURATION_S] (``positive``) or [0, MAX_DURATION_S]."""
    out = real(name, value)
    if out < 0 or (positive and out == 0) or out > MAX_DURATION_S:
        raise ValueError(f"{name}={out} must be in {'(0' if positive else '[0'}, "
                         f"{MAX_DURATION_S:g}] seconds")
    return out


def boolean(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} is not a bool")
    return bool(value)


def integer_array(name: str, values: object) -> np.ndarray:
    """``values`` as an int64 array, refusing floats and bools (1.9 is not slot 1) and
    integers beyond int64 (2**64 - 1 is not slot -1). An empty sequence is fine."""
    array = np.asarray(values)
    if array.size == 0:
        return array.astype(np.int64)
    if array.dtype.kind == "u" and array.size and int(array.max()) > INT64[1]:
        raise ValueError(f"{name}: {int(array.max())} is beyond int64")
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got dtype {array.dtype}")
    return array.astype(np.int64)
