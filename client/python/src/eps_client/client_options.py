"""How an EpsClient talks to epsd (``ClientOptions``), each field checked whenever it is
set, and the W3C traceparent values a client may send (client.py uses both)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from eps_client import _values

Traceparent = str | Callable[[], str | None] | None

# W3C trace context, version 00: version-trace_id-parent_id-flags, lower-case hex, neither
# id all zeros. A later version may append fields ("-..."); version ff is invalid.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-[!-~]*)?")


def valid_traceparent(value: object) -> bool:
    """Whether ``value`` is a W3C traceparent header value gRPC can carry as metadata."""
    if not isinstance(value, str):
        return False
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return False
    version, trace_id, parent_id, more = match.groups()
    return (version != "ff" and (version != "00" or more is None)
            and trace_id != "0" * 32 and parent_id != "0" * 16)


@dataclass
class ClientOptions:
    """How the client talks to epsd. The defaults come from measurements on a loaded
    2-core machine (docs/integration/python-client.md): a healthy epsd misses none.

    Every field is checked whenever it is set, at construction and after (a client reads
    them on every call, so ``options.deadline_s = None`` set later would otherwise reach
    the calls unchecked): TypeError or ValueError naming the field, the old value kept; a
    name that is not a field is refused (AttributeError). ``target`` is read once, when a
    client is made."""

    # $EPS_TARGET when set (the deploy manifests set it to epsd's --listen), else epsd's
    # default listener
    target: str = field(default_factory=lambda: os.environ.get("EPS_TARGET") or
                        "unix:///tmp/epsd.sock")
    deadline_s: float = 0.100  # per select_pages
    attach_deadline_s: float = 0.5  # attach, detach, heartbeat, re-attach
    reattach_backoff_s: float = 0.05  # between re-attach attempts
    fail_open: bool = True  # False: a failed step raises EpsError
    use_stream: bool = True  # one open call: p50 0.3 ms vs 0.7 ms unary on 2 loaded cores
    # W3C trace context sent as "traceparent" metadata: a fixed string, or a
    # callable asked once per call (e.g. the current OpenTelemetry span's).
    traceparent: Traceparent = None
    # Called with the step number (an int) on every fallback of a step that has one (a step
    # refused as not a uint64 has none), before select_pages returns: an engine whose stream
    # waits on selection_done releases it here (ReleaseDense).
    on_fallback: Callable[[int], None] | None = None

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, _client_option(name, value))


# ClientOptions' durations, and whether 0 is refused.
_DURATIONS = {"deadline_s": True, "attach_deadline_s": True, "reattach_backoff_s": False}


def _client_option(name: str, value: object) -> object:
    """``value`` checked for the ClientOptions field ``name`` (TypeError, ValueError naming
    it), as the client will use it."""
    if name == "target":
        if not isinstance(value, str) or not value:
            raise TypeError(f"ClientOptions.target={value!r} is not a non-empty str")
        return value
    if name in _DURATIONS:
        return _values.duration(f"ClientOptions.{name}", value, positive=_DURATIONS[name])
    if name in ("fail_open", "use_stream"):
        return _values.boolean(f"ClientOptions.{name}", value)
    if name == "traceparent":
        if isinstance(value, str):
            if not valid_traceparent(value):
                raise ValueError(f"ClientOptions.traceparent={value!r} is not a W3C "
                                 f"traceparent (00-<32 hex>-<16 hex>-<2 hex>)")
        elif value is not None and not callable(value):
            raise TypeError(f"ClientOptions.traceparent={value!r} is not a str, a callable or "
                            f"None")
        return value
    if name == "on_fallback":
        if value is not None and not callable(value):
            raise TypeError(f"ClientOptions.on_fallback={value!r} is not callable")
        return value
    raise AttributeError(f"ClientOptions has no field {name!r}")
