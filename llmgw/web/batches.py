"""
The dashboard's batches page as data (docs/dashboard.md, "Batches"): each
active batch of every key (its key, endpoint, status, lines by state and
progress) from the figures L{llmgw.batches.tally.BatchTally} last read,
and the fleet's tokens a second from batch work, from the samples of
L{llmgw.web.history} (the router's C{llmgw_batch_tokens_total}, the
tier's reports included).  Nothing here reads the store itself: a page
costs no query, however many are open.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmgw.batches.tally import BatchTally, progress
from llmgw.web.history import History, chart

WINDOW = 60.0
"""
Seconds the headline's tokens a second are the mean over.
"""


def _per_s(value: float) -> str:
    return f"{value:.3g}/s" if value else "0/s"


def _ago(then: float | None, now: float) -> str:
    if then is None:
        return "not read yet"
    return f"read {max(0.0, now - then):.0f}s ago"


class BatchesView:
    """
    Reads for the batches page.

    @param tally: the store's figures, read every few seconds.
    @param history: the dashboard's samples (batch tokens a second).
    @param wall_clock: POSIX seconds now.
    """

    def __init__(
        self, tally: BatchTally, history: History, wall_clock: Callable[[], float]
    ) -> None:
        self._tally = tally
        self._history = history
        self._wall_clock = wall_clock

    def page(self) -> dict[str, Any]:
        """
        @return: C{batches}, one row per active batch (the oldest first):
            id, key, endpoint, api, status, lines by state, total lines,
            lines ended and their C{percent}; C{more}, the active batches
            left out; C{lines}, every active batch's lines by state;
            C{tokens}, the batch tokens a second over the last L{WINDOW}
            seconds, and C{svg}, their chart over the last 10 minutes;
            C{read}, how old the figures are.
        """
        now = self._wall_clock()
        figures = self._tally.figures
        rows = []
        for batch, lines in figures.batches:
            ended, total = progress(lines)
            rows.append(
                {
                    "id": batch.id,
                    "key": batch.key_name or "-",
                    "endpoint": batch.endpoint,
                    "api": batch.api,
                    "status": batch.status,
                    "lines": lines,
                    "total": total,
                    "ended": ended,
                    "percent": 100 * ended // total if total else 0,
                }
            )
        points = list(self._history.points)
        recent = [p.batch_tokens for p in points if now - p.at <= WINDOW]
        tokens = sum(recent) / len(recent) if recent else 0.0
        return {
            "batches": rows,
            "more": figures.more,
            "lines": figures.lines,
            "tokens": _per_s(tokens),
            "svg": chart([(now - p.at, p.batch_tokens) for p in points], _per_s),
            "step": f"{self._history.interval:g} s",
            "read": _ago(figures.read_at, now),
        }
