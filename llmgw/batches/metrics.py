"""
The batches' metrics (docs/metrics.md): their lines by state and the
batches by status, from the figures L{llmgw.batches.tally.BatchTally}
read last (a scrape reads no store), and how old those are.  The tokens a
second of batch work are the router's C{llmgw_batch_tokens_total}
(L{llmgw.router.telemetry.metrics}), counted where each request is.

Label values are fixed words only: the store's line states and batch
statuses, never a batch id or a key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from llmgw.batches.tally import BatchTally


class BatchCollector:
    """
    C{llmgw_batch_lines{state}}, C{llmgw_batches{status}} and
    C{llmgw_batch_figures_age_seconds}, each from the first scrape.

    @param tally: the last read of the store.
    @param wall_clock: POSIX seconds now.
    """

    def __init__(self, tally: BatchTally, wall_clock: Callable[[], float]) -> None:
        self._tally = tally
        self._wall_clock = wall_clock

    def collect(self) -> Iterator[Metric]:
        figures = self._tally.figures
        lines = GaugeMetricFamily(
            "llmgw_batch_lines",
            "Lines of the batches not over, by state (pending: queued, not"
            " claimed yet; running: claimed by the runner, sent or next to be"
            " sent; done; failed; cancelled; expired), as the"
            " store held them at the last read (llmgw_batch_figures_age_seconds).",
            labels=["state"],
        )
        for state, count in figures.lines.items():
            lines.add_metric([state], count)
        yield lines
        batches = GaugeMetricFamily(
            "llmgw_batches",
            "Batches not over, every key's, by status, at the last read.",
            labels=["status"],
        )
        for status, count in figures.statuses.items():
            batches.add_metric([status], count)
        yield batches
        read_at = figures.read_at
        yield GaugeMetricFamily(
            "llmgw_batch_figures_age_seconds",
            "Seconds since the batch figures were read from the store (the"
            " server reads them every 5 s; NaN before the first read).",
            value=float("nan") if read_at is None else self._wall_clock() - read_at,
        )
