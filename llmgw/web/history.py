"""
What the dashboard remembers that no record keeps: traffic figures
sampled every few seconds into ring buffers (the sparklines), each
replica's state changes, keys' token use over time, and recent engine
failures with their output tails.

Sampled from the metrics registry (the router's counters, as a scrape
reads them) and from the control plane's records, on the reactor, in
memory only: a restart starts them empty.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from html import escape
from typing import Any, Protocol

from twisted.application.service import Service
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from llmgw.control.plane import ControlPlane
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.telemetry.metrics import RouterMetrics
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.states import ShardState

SAMPLES = 120
"""
Points per sparkline: 10 minutes at the default 5 s interval.
"""

STATES_KEPT = 20
"""
State changes kept per replica.
"""

FAILURES_KEPT = 20
"""
Engine failures kept for the overview.
"""


@dataclass(frozen=True)
class Point:
    """
    One sample of the traffic figures.

    @ivar at: POSIX seconds.
    @ivar rate: requests per second since the previous sample.
    @ivar error_rate: the share of those requests answered 5xx (0 to 1).
    @ivar ttft: mean time to first token of the streams since the previous
        sample, seconds; L{None} when there were none.
    @ivar batch_tokens: tokens per second served to batch lines since the
        previous sample (prompt and completion).
    """

    at: float
    rate: float
    error_rate: float
    ttft: float | None
    batch_tokens: float = 0.0


@dataclass(frozen=True)
class Failure:
    """
    An engine that failed, as its agent reported it.

    @ivar at: POSIX seconds.
    @ivar output_tail: the engine's last output lines (at most 50).
    """

    at: float
    node: str
    shard: str
    error: str
    output_tail: tuple[str, ...]


class LinkListener(Protocol):
    """
    What the agent hub tells (L{llmgw.control.agents.LinkListener}).
    """

    def node_registered(self, node_id: str, register: pb.Register) -> None: ...

    def shard_status(self, node_id: str, status: pb.ShardStatus) -> None: ...


class FailureTap:
    """
    Stands between the agent hub and the control plane: keeps each failed
    shard's output tail (the plane keeps three lines of it in the shard's
    error), then passes every message on unchanged.

    @param inner: the control plane.
    @param wall_clock: POSIX seconds now.
    @param changed: called after each shard status has reached the plane
        (the server notes replica states then, not only every few seconds).
    """

    def __init__(
        self,
        inner: LinkListener,
        wall_clock: Callable[[], float],
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        self._inner = inner
        self._wall_clock = wall_clock
        self.changed = changed
        self.failures: deque[Failure] = deque(maxlen=FAILURES_KEPT)
        self.tails: dict[str, tuple[str, ...]] = {}

    def node_registered(self, node_id: str, register: pb.Register) -> None:
        self._inner.node_registered(node_id, register)

    def shard_status(self, node_id: str, status: pb.ShardStatus) -> None:
        if status.state == pb.SHARD_STATE_FAILED:
            tail = tuple(status.output_tail)
            self.failures.appendleft(
                Failure(
                    self._wall_clock(), node_id, status.shard_id, status.error, tail
                )
            )
            self.tails[status.shard_id] = tail
            if len(self.tails) > 10 * FAILURES_KEPT:
                self.tails.pop(next(iter(self.tails)))
        self._inner.shard_status(node_id, status)
        self.changed()


def _any(labels: Any) -> bool:
    return True


def _sum(
    metric: Any, name: str, match: Callable[[Any], bool], merge: Callable[[Any], Any]
) -> float:
    """
    @param metric: a prometheus_client metric (all its label values).
    @param merge: adds what the routers of a tier reported to a family
        (L{llmgw.router.telemetry.reports.ReportedMetrics.merge}).
    @return: the sum of its samples called C{name} whose labels C{match}.
    """
    total = 0.0
    for family in metric.collect():
        for sample in merge(family).samples:
            if sample.name == name and match(sample.labels):
                total += sample.value
    return total


class History(Service):
    """
    Samples every C{interval} seconds, while running.

    @param metrics: the router's counters (C{llmgw_requests_total} by
        status, C{llmgw_time_to_first_token_seconds},
        C{llmgw_batch_tokens_total}), read alone rather than through the
        whole registry.
    @param plane: the control plane, or L{None}.
    @param keys: the API keys, or L{None}.
    @param wall_clock: POSIX seconds now.
    @param interval: seconds between samples.
    """

    log = Logger()

    def __init__(
        self,
        reactor: IReactorTime,
        metrics: RouterMetrics,
        plane: ControlPlane | None,
        keys: KeyRing | None,
        *,
        wall_clock: Callable[[], float],
        interval: float = 5.0,
    ) -> None:
        self._reactor = reactor
        self._metrics = metrics
        self._plane = plane
        self._keys = keys
        self._wall_clock = wall_clock
        self.interval = interval
        self.points: deque[Point] = deque(maxlen=SAMPLES)
        self.states: dict[str, deque[tuple[float, str]]] = {}
        self.key_tokens: dict[str, deque[int]] = {}
        self._last: tuple[float, ...] | None = None
        self._call: IDelayedCall | None = None

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self.sample()

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def sample(self) -> None:
        """
        Take one sample now and schedule the next (while running).
        """
        try:
            self._sample()
        except Exception:
            # A sampler that dies leaves flat lines and no word why.
            self.log.failure("dashboard sample failed")
        if self.running:
            self._call = self._reactor.callLater(self.interval, self.sample)

    def _sample(self) -> None:
        now = self._wall_clock()
        counted = self._metrics.requests
        # With the tier's reports, as a scrape reads them.
        merge = self._metrics.reported.merge
        requests = _sum(counted, "llmgw_requests_total", _any, merge)
        errors = _sum(
            counted,
            "llmgw_requests_total",
            lambda labels: str(labels.get("status", "")).startswith("5"),
            merge,
        )
        ttft = self._metrics.time_to_first_token
        ttft_sum = _sum(ttft, "llmgw_time_to_first_token_seconds_sum", _any, merge)
        ttft_count = _sum(ttft, "llmgw_time_to_first_token_seconds_count", _any, merge)
        batched = self._metrics.batch_tokens
        batch = _sum(batched, "llmgw_batch_tokens_total", _any, merge)
        figures = (now, requests, errors, ttft_sum, ttft_count, batch)
        if self._last is not None:
            at, requests0, errors0, sum0, count0, batch0 = self._last
            span = max(now - at, 1e-6)
            done = max(requests - requests0, 0.0)
            streams = ttft_count - count0
            self.points.append(
                Point(
                    now,
                    done / span,
                    (errors - errors0) / done if done else 0.0,
                    (ttft_sum - sum0) / streams if streams > 0 else None,
                    max(batch - batch0, 0.0) / span,
                )
            )
        self._last = figures
        self.record_states(now)
        if self._keys is not None:
            self.sample_keys(self._keys)

    def record_states(self, now: float) -> None:
        """
        Note each replica whose state differs from the last one noted.
        """
        if self._plane is None:
            return
        replicas = self._plane.replicas
        for replica_id, replica in replicas.items():
            seen = self.states.get(replica_id)
            state = str(replica.state)
            if seen is None:
                seen = self.states[replica_id] = deque(maxlen=STATES_KEPT)
            if not seen or seen[-1][1] != state:
                seen.append((now, state))
        for gone in [r for r in self.states if r not in replicas]:
            del self.states[gone]

    def sample_keys(self, keys: KeyRing) -> None:
        """
        Note each key's tokens used so far.
        """
        names = set()
        for key in keys.keys():
            names.add(key.name)
            self.key_tokens.setdefault(key.name, deque(maxlen=SAMPLES)).append(
                key.tokens_used
            )
        for gone in [k for k in self.key_tokens if k not in names]:
            del self.key_tokens[gone]


def shard_gone(state: str) -> bool:
    """
    @return: whether a shard in C{state} ended (failed, stopped or lost).
    """
    try:
        return ShardState(state).gone
    except ValueError:
        return False


def _coords(points: list[float], width: float, height: float) -> str:
    """
    @return: C{points} (oldest first, at least two) spread over C{width}
        and scaled to their maximum within C{height}, 2 units from each
        edge, as a polyline's C{points}.
    """
    top = max(points) or 1.0
    step = width / (len(points) - 1)
    return " ".join(
        f"{i * step:.1f},{height - 2 - (v / top) * (height - 4):.1f}"
        for i, v in enumerate(points)
    )


def sparkline(
    values: Iterable[float | None], width: int = 240, height: int = 40
) -> str:
    """
    An inline SVG polyline of C{values}, oldest first, scaled to their
    maximum (a flat line at the bottom when all are zero or none); no
    axes (L{chart} draws them).

    @return: SVG markup (safe: numbers only).
    """
    points = [v if v is not None else 0.0 for v in values]
    if len(points) < 2:
        # One sample, or none: a line from zero to it.
        points = [0.0, *points] if points else [0.0, 0.0]
    return (
        f'<svg class="spark" viewBox="0 0 {width} {height}" width="{width}"'
        f' height="{height}" role="img"><polyline fill="none"'
        f' stroke="currentColor" stroke-width="1.5"'
        f' points="{_coords(points, width, height)}"/></svg>'
    )


def nice_top(value: float) -> float:
    """
    @return: the least of 1, 2, 2.5, 5 times a power of ten that is at
        least C{value} (1 for nothing above zero): a chart's top line.
    """
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        if value <= step * power * (1 + 1e-9):
            return step * power
    return 10.0 * power


def _age(seconds: float) -> str:
    if seconds < 1:
        return "now"
    if seconds < 120:
        return f"-{seconds:.0f}s"
    return f"-{seconds / 60:.0f}m"


def chart(
    points: Iterable[tuple[float, float | None]],
    label: Callable[[float], str],
    *,
    span: float = 600.0,
    width: int = 260,
    height: int = 92,
) -> str:
    """
    An inline SVG line chart with axes: time along the bottom, from
    C{span} seconds ago at the left to now at the right, ticked and
    labelled (C{-10m} ... C{now}); the values up the left, from 0 to a
    round top (L{nice_top}) with the top and middle labelled by C{label}
    and drawn as grid lines.  A value of L{None} (nothing measured then)
    breaks the line.

    @param points: C{(seconds ago, value)}, oldest first.
    @param label: a value as its axis label (its unit included).
    @return: SVG markup (safe: numbers and C{label}'s text, escaped).
    """
    left, right, top_margin, bottom = 44.0, 8.0, 6.0, 16.0
    plot_w = width - left - right
    plot_h = height - top_margin - bottom
    kept = [(age, v) for age, v in points if 0 <= age <= span]
    top = nice_top(max((v for _, v in kept if v is not None), default=0.0))

    def x(age: float) -> float:
        return left + plot_w * (1 - age / span)

    def y(value: float) -> float:
        return top_margin + plot_h * (1 - value / top)

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}"'
        f' height="{height}" role="img" font-size="9">'
    ]
    for level in (top, top / 2):
        parts.append(
            f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y(level):.1f}"'
            f' y2="{y(level):.1f}"/><text class="axis" x="{left - 3}"'
            f' y="{y(level) + 3:.1f}" text-anchor="end">{escape(label(level))}</text>'
        )
    base = top_margin + plot_h
    parts.append(
        f'<text class="axis" x="{left - 3}" y="{base + 3:.1f}"'
        f' text-anchor="end">{escape(label(0.0))}</text>'
        f'<line class="axis" x1="{left}" x2="{width - right}" y1="{base}"'
        f' y2="{base}"/><line class="axis" x1="{left}" x2="{left}"'
        f' y1="{top_margin}" y2="{base}"/>'
    )
    tick = span / 5
    for i in range(6):
        age = span - i * tick
        anchor = "start" if i == 0 else "end" if i == 5 else "middle"
        parts.append(
            f'<line class="axis" x1="{x(age):.1f}" x2="{x(age):.1f}" y1="{base}"'
            f' y2="{base + 3}"/><text class="axis" x="{x(age):.1f}"'
            f' y="{height - 3}" text-anchor="{anchor}">{_age(age)}</text>'
        )
    run: list[str] = []
    ended: list[tuple[float, float | None]] = [*kept, (0.0, None)]
    for age, value in ended:
        if value is None:
            if len(run) == 1:
                cx, cy = run[0].split(",")
                parts.append(f'<circle class="line" cx="{cx}" cy="{cy}" r="1.5"/>')
            elif run:
                parts.append(f'<polyline class="line" points="{" ".join(run)}"/>')
            run = []
        else:
            run.append(f"{x(age):.1f},{y(value):.1f}")
    parts.append("</svg>")
    return "".join(parts)
