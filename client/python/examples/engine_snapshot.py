"""What one decode run of the reference engine leaves in the shared buffers for the next run
to read, saved after the prefill and put back before each run, so that every run (and its
calibration) starts from the same state.

A gated decode appends each step's keys to the summary pool and, with a coarse level, to
the coarse pool, and writes each layer's query into ``queries``: the lag-1 query that the
next run's first selection would read. Feedback entries are not saved but cleared (NaN: no
group visited), since a run's entries describe its own queries. The K/V cache needs no
copy: every run writes a position before it reads it. ``visit_blocks`` / ``visit_count``
are epsd's, rewritten each step before the engine reads them.

Works on anything with torch's ``clone`` / ``copy_`` / ``fill_``; the copies are queued on
the current stream, so the caller synchronises before epsd reads them from its process
(docs/api-memory.md: a sync step's inputs must have landed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The buffers a decode run writes and a later run reads (None where the layout has none).
CHANGED_BY_DECODE = ("summary_pool", "coarse_pool", "queries")


@dataclass
class BufferSnapshot:
    saved: dict[str, Any]

    @staticmethod
    def take(buffers: Any) -> BufferSnapshot:
        return BufferSnapshot({name: t.clone() for name in CHANGED_BY_DECODE
                               if (t := getattr(buffers, name, None)) is not None})

    def restore(self, buffers: Any) -> None:
        for name, saved in self.saved.items():
            getattr(buffers, name).copy_(saved)
        if getattr(buffers, "feedback", None) is not None:
            buffers.feedback.fill_(float("nan"))
