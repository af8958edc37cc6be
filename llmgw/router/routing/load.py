"""
Engine load: each ready replica's own Prometheus C{/metrics}, read every
poll interval, kept as the last L{EngineLoad} per replica with its age.

The names read, per engine (a reading takes the first family found of each
role; samples of one family, one per served model, are summed, the cache
use is their largest):

  - vLLM: C{vllm:num_requests_running}, C{vllm:num_requests_waiting},
    C{vllm:kv_cache_usage_perc} (V1, a fraction 0..1) or the older
    C{vllm:gpu_cache_usage_perc} (V0); source: vLLM's
    C{docs/design/v1/metrics.md} and C{vllm/v1/metrics/loggers.py}; and its
    prefix cache's counters, in tokens: C{vllm:prefix_cache_queries_total}
    (prompt tokens looked up) and C{vllm:prefix_cache_hits_total} (those
    found), labelled C{engine} and C{model_name} as the gauges are (a real
    vLLM 0.32's page: C{tests/data/vllm-0.32.0-metrics.txt}).  The
    simulator (C{llmgw sim}, L{llmgw.sim.metrics}) serves the V1 names.
  - SGLang (C{--enable-metrics}): C{sglang:num_running_reqs},
    C{sglang:num_queue_reqs}, C{sglang:token_usage} (a fraction of the KV
    pool); source: SGLang's C{docs/references/production_metrics.md} and
    C{python/sglang/srt/metrics/collector.py}.
  - llama.cpp's C{llama-server --metrics}: C{llamacpp:requests_processing},
    C{llamacpp:requests_deferred}, C{llamacpp:kv_cache_usage_ratio} (which
    recent builds dropped: the cache use is then L{None}); source:
    llama.cpp's C{tools/server/README.md}, "GET /metrics".

The prefix cache hit rate (L{HitRate}) is the rate of those two counters:
the hits counted over the last L{HIT_RATE_POLLS} readings over the queries
counted over them, not the ratio of their totals since the engine started
(which would barely move after a day).  It is shown, not balanced on: the
prefix affinity (L{llmgw.router.routing.affinity}) already sends a prompt to the
replica whose cache holds it, and a replica-wide rate says nothing of
where this request's prefix is cached.

An engine that answers 404 (llama-cpp-python's server has no C{/metrics})
is marked as having none, logged once, and asked again only every
L{NO_METRICS_RETRY} polls.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmgw.reactors import IConnectingReactor
from llmgw.router.interfaces import Endpoint
from llmgw.router.upstream.scrape import ScrapeError, Scraper

# Each role's metric names, the first found wins.
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs",
           "llamacpp:requests_processing")  # fmt: skip
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs",
           "llamacpp:requests_deferred")  # fmt: skip
KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
            "sglang:token_usage", "llamacpp:kv_cache_usage_ratio")  # fmt: skip
# vLLM V1's prefix cache counters, tokens (their samples' names).
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total",)
PREFIX_HITS = ("vllm:prefix_cache_hits_total",)
_WANTED = frozenset(RUNNING + WAITING + KV_CACHE + PREFIX_QUERIES + PREFIX_HITS)
# The sample lines worth handing to the parser: an engine's page is mostly
# histograms (vLLM's is tens of KiB, the simulator's 6 KiB) and
# prometheus_client's parser is pure Python, label parsing its slowest
# part.  One regular expression picks the sample lines of the names above
# and drops their labels (quoted values may hold braces): the samples of a
# family are summed anyway.  parse_load of the simulator's page: 0.09 ms,
# against 0.33 ms parsing the whole page (this machine, timeit).
_SAMPLE_LINES = re.compile(
    r"\n("
    + "|".join(re.escape(n) for n in sorted(_WANTED))
    + r')(?:\{(?:[^"}\n]|"(?:[^"\\\n]|\\.)*")*\})?( [^\n]*)'
)

# A reading older than this many poll intervals is stale.
STALE_POLLS = 3
# An engine without /metrics is asked again every this many polls (it may
# have been restarted with them).
NO_METRICS_RETRY = 60
# The prefix cache hit rate is over the counts of this many last readings
# (a minute at the default poll interval).
HIT_RATE_POLLS = 60
# The most bytes of a /metrics page read.
MAX_PAGE = 4 * 1024 * 1024


@dataclass(frozen=True)
class EngineLoad:
    """
    One reading of an engine's load.

    @ivar running: requests being computed now.
    @ivar waiting: requests queued in the engine.
    @ivar kv_cache_usage: the fraction (0..1) of the KV cache in use, or
        L{None} when the engine does not say.
    @ivar read_at: reactor time, seconds, of the reading.
    @ivar prefix_cache_queries: the engine's count of prompt tokens looked
        up in its prefix cache since it started, or L{None} when it does
        not say (engines other than vLLM).
    @ivar prefix_cache_hits: of those, the tokens found there, or L{None}.
    @ivar prefix_cache_hit_rate: the fraction (0..1) of the tokens looked
        up over the last L{HIT_RATE_POLLS} readings that were found
        (L{HitRate}); L{None} when none were looked up then, or before
        the second reading.  Set by L{LoadBoard}, not by L{parse_load}.
    """

    running: float
    waiting: float
    kv_cache_usage: float | None
    read_at: float
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_hit_rate: float | None = None


class NoLoadMetrics(ValueError):
    """
    A C{/metrics} page names none of the load metrics this module knows.
    """


def parse_load(text: str, read_at: float) -> EngineLoad:
    """
    Read the load from an engine's C{/metrics} page.

    @param text: the page, Prometheus text format.
    @param read_at: the reading's time, seconds.
    @raise NoLoadMetrics: it names none of L{RUNNING} or L{WAITING}.
    @raise ValueError: the kept lines are not valid Prometheus text.
    """
    kept = "\n".join(name + rest for name, rest in _SAMPLE_LINES.findall("\n" + text))
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(kept + "\n"):
        if family.name in _WANTED:
            found.setdefault(family.name, []).extend(s.value for s in family.samples)

    def first(names: tuple[str, ...]) -> list[float] | None:
        for name in names:
            if name in found:
                return found[name]
        return None

    running, waiting, cache = first(RUNNING), first(WAITING), first(KV_CACHE)
    if running is None and waiting is None:
        raise NoLoadMetrics("no known load metric")
    queries, hits = first(PREFIX_QUERIES), first(PREFIX_HITS)
    return EngineLoad(
        running=sum(running or ()),
        waiting=sum(waiting or ()),
        kv_cache_usage=max(cache) if cache else None,
        read_at=read_at,
        prefix_cache_queries=sum(queries) if queries is not None else None,
        prefix_cache_hits=sum(hits) if hits is not None else None,
    )


class HitRate:
    """
    A hit rate from two counters read at each poll, as Prometheus'
    C{increase()} takes them: the hits counted over the last C{polls}
    readings over the queries counted over them.  A counter lower than at
    the reading before was reset (the engine restarted behind the same
    endpoint): its increase is then its new value, counted from 0, so a
    restart gives neither a negative step nor one the size of the old
    totals.  The rate is kept within 0..1 (hits are a part of queries).

    @param polls: how many readings' steps are kept.
    """

    def __init__(self, polls: int = HIT_RATE_POLLS) -> None:
        self._steps: deque[tuple[float, float]] = deque(maxlen=polls)
        self._last: tuple[float, float] | None = None

    def add(self, queries: float | None, hits: float | None) -> float | None:
        """
        Take one reading of both counters' totals.

        @param queries: tokens looked up since the engine started, or
            L{None} when the page had no such counter (the steps kept are
            dropped: the engine no longer says).
        @param hits: tokens found, or L{None}.
        @return: the rate after it (L{rate}).
        """
        if (
            queries is None
            or hits is None
            or not math.isfinite(queries)
            or not math.isfinite(hits)
        ):
            self._steps.clear()
            self._last = None
            return None
        last, self._last = self._last, (queries, hits)
        if last is not None:
            if queries < last[0] or hits < last[1]:
                self._steps.append((queries, hits))
            else:
                self._steps.append((queries - last[0], hits - last[1]))
        return self.rate()

    def rate(self) -> float | None:
        """
        @return: hits over queries counted in the steps kept, 0..1;
            L{None} when no query was counted in them.
        """
        queries = sum(q for q, _ in self._steps)
        if queries <= 0:
            return None
        return min(1.0, max(0.0, sum(h for _, h in self._steps) / queries))


@dataclass
class _Target:
    """
    The poll state of one endpoint: a record of L{LoadBoard}'s, kept in
    its table and changed only by it.
    """

    endpoint: Endpoint
    reading: EngineLoad | None = None
    hit_rate: HitRate = field(default_factory=HitRate)
    has_metrics: bool | None = None
    in_flight: Deferred[None] | None = None
    skip: int = 0
    failing: bool = False


class LoadBoard(Service):
    """
    Polls each endpoint's C{/metrics} and keeps its last load reading.

    Bounded: one poll in flight per endpoint (a slow engine is skipped
    until its poll ends), each cancelled after C{timeout} seconds, over a
    kept-alive connection per engine (L{llmgw.router.upstream.scrape}).

    @param clock: the reactor's clock.
    @param scraper: the HTTP client, for C{/metrics} (see L{make_scraper}).
    @param interval: seconds between polls; 0 turns polling off.
    @param timeout: seconds a poll may take; defaults to the interval.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        scraper: Scraper,
        interval: float,
        timeout: float | None = None,
    ) -> None:
        self.clock = clock
        self.scraper = scraper
        self.interval = interval
        self.timeout = timeout if timeout is not None else max(interval, 0.5)
        self._targets: dict[str, _Target] = {}
        self._loop: LoopingCall | None = None
        self.polls = 0

    # What the rest of llmgw reads.

    def reading(self, replica_id: str) -> EngineLoad | None:
        """
        @return: the last reading of C{replica_id}, however old, or
            L{None} when none came yet (or it is not an endpoint).
        """
        target = self._targets.get(replica_id)
        return target.reading if target is not None else None

    def stale(self, replica_id: str, now: float) -> bool:
        """
        @param now: reactor time, seconds.
        @return: whether C{replica_id} has no reading newer than
            L{STALE_POLLS} poll intervals.
        """
        reading = self.reading(replica_id)
        return reading is None or now - reading.read_at > STALE_POLLS * self.interval

    def has_metrics(self, replica_id: str) -> bool | None:
        """
        @return: whether the engine serves C{/metrics} with load figures;
            L{None} before its first answer.
        """
        target = self._targets.get(replica_id)
        return target.has_metrics if target is not None else None

    def endpoints(self) -> list[Endpoint]:
        """
        @return: the endpoints polled, in the balancer's order.
        """
        return [t.endpoint for t in self._targets.values()]

    # Following the balancer.

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """
        Poll these endpoints from now on (the list the balancer gets); one
        that stays keeps its reading, one that leaves has its poll
        cancelled.
        """
        targets: dict[str, _Target] = {}
        for endpoint in endpoints:
            target = self._targets.get(endpoint.id)
            if target is None or target.endpoint.url != endpoint.url:
                target = _Target(endpoint)
            target.endpoint = endpoint
            targets[endpoint.id] = target
        old, self._targets = self._targets, targets
        for replica_id, target in old.items():
            if targets.get(replica_id) is not target:
                if target.in_flight:
                    target.in_flight.cancel()
                self.scraper.forget(replica_id)

    # The loop.

    def startService(self) -> None:
        """
        Start polling, unless the interval is 0.
        """
        super().startService()  # type: ignore[no-untyped-call]
        if self.interval <= 0 or self._loop is not None:
            return
        self._loop = LoopingCall(self.poll_all)
        self._loop.clock = self.clock
        self._loop.start(self.interval, now=True).addErrback(
            lambda f: self.log.failure("load poller stopped", f)
        )

    def stopService(self) -> None:
        """
        Stop polling and cancel the polls in flight.
        """
        super().stopService()  # type: ignore[no-untyped-call]
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        for target in self._targets.values():
            if target.in_flight is not None:
                target.in_flight.cancel()
        self.scraper.close_all()

    def poll_all(self) -> None:
        """
        One round: poll each endpoint with no poll in flight (those
        without metrics only every L{NO_METRICS_RETRY} rounds).
        """
        for target in list(self._targets.values()):
            if target.in_flight is not None:
                continue
            if target.skip > 0:
                target.skip -= 1
                continue
            self._poll(target)

    def _poll(self, target: _Target) -> None:
        self.polls += 1
        poll = Deferred.fromCoroutine(self._read(target))
        poll.addTimeout(self.timeout, self.clock)
        poll.addErrback(self._failed, target)

        def done(_: object) -> None:
            target.in_flight = None

        poll.addBoth(done)
        if not poll.called:
            target.in_flight = poll

    async def _read(self, target: _Target) -> None:
        endpoint = target.endpoint
        # Another change may give endpoints a secret; until then there is
        # none to send.
        secret = getattr(endpoint, "api_key", None)
        status, body = await self.scraper.get(endpoint.id, endpoint.url, secret)
        if status == 404:
            if target.has_metrics is not False:
                self.log.info(
                    "replica {replica} serves no /metrics: no engine load for it",
                    replica=endpoint.id,
                )
            target.has_metrics = False
            target.skip = NO_METRICS_RETRY - 1
            return
        if status != 200:
            raise ScrapeError(f"status {status}")
        try:
            load = parse_load(body.decode("utf-8", "replace"), self.clock.seconds())
        except NoLoadMetrics:
            if target.has_metrics is not False:
                self.log.info(
                    "replica {replica}'s /metrics has no load figures",
                    replica=target.endpoint.id,
                )
            target.has_metrics = False
            target.skip = NO_METRICS_RETRY - 1
            return
        except ValueError as e:
            raise ScrapeError(f"unreadable metrics: {e}") from None
        rate = target.hit_rate.add(load.prefix_cache_queries, load.prefix_cache_hits)
        target.reading = replace(load, prefix_cache_hit_rate=rate)
        target.has_metrics = True
        if target.failing:
            target.failing = False
            self.log.info(
                "replica {replica}: engine load readable again",
                replica=target.endpoint.id,
            )

    def _failed(self, failure: Any, target: _Target) -> None:
        if failure.check(CancelledError) and (
            not self.running or self._targets.get(target.endpoint.id) is not target
        ):
            # Stopped, or the endpoint left: nothing went wrong.
            return
        # One line when polls start failing, not one per poll: the reading
        # goes stale, which says the rest.
        if not target.failing:
            target.failing = True
            self.log.warn(
                "replica {replica}: cannot read engine load: {why}",
                replica=target.endpoint.id,
                why=failure.getErrorMessage() or failure.type.__name__,
            )


def make_scraper(
    reactor: IConnectingReactor, connect_timeout: float, interval: float
) -> Scraper:
    """
    @param interval: the poll interval, seconds: connections are kept
        between polls when it is under 4 s (engines on uvicorn close idle
        ones after 5 s).
    @return: the client for engines' C{/metrics}.
    """
    return Scraper(
        reactor, connect_timeout, "/metrics", MAX_PAGE, keep_alive=interval < 4
    )


class LoadCollector:
    """
    The engine load of each polled replica, for a Prometheus registry, read
    at scrape time.  Labels: C{replica} (a replica id of the fleet) and
    C{model} (its first served name, a configured name).
    """

    def __init__(self, board: LoadBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        board = self.board
        now = board.clock.seconds()
        labels = ["replica", "model"]
        running = GaugeMetricFamily(
            "llmgw_engine_requests_running",
            "Requests the engine computes now, from its /metrics.",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "llmgw_engine_requests_waiting",
            "Requests queued in the engine, from its /metrics.",
            labels=labels,
        )
        cache = GaugeMetricFamily(
            "llmgw_engine_kv_cache_usage_ratio",
            "Fraction (0..1) of the engine's KV cache in use.",
            labels=labels,
        )
        age = GaugeMetricFamily(
            "llmgw_engine_load_age_seconds",
            "Seconds since the engine's load was last read.",
            labels=labels,
        )
        stale = GaugeMetricFamily(
            "llmgw_engine_load_stale",
            f"1 when the engine's load reading is older than {STALE_POLLS}"
            " poll intervals (or missing).",
            labels=labels,
        )
        hit_rate = GaugeMetricFamily(
            "llmgw_engine_prefix_cache_hit_ratio",
            "Fraction (0..1) of the prompt tokens the engine looked up in its"
            f" prefix cache over its last {HIT_RATE_POLLS} load readings that it"
            " found there (vLLM's prefix_cache_hits over prefix_cache_queries);"
            " absent when it looked up none.",
            labels=labels,
        )
        available = GaugeMetricFamily(
            "llmgw_engine_metrics_available",
            "1 when the engine serves load metrics, 0 when it has none.",
            labels=labels,
        )
        for endpoint in board.endpoints():
            values = [endpoint.id, endpoint.models[0] if endpoint.models else ""]
            has = board.has_metrics(endpoint.id)
            if has is not None:
                available.add_metric(values, 1.0 if has else 0.0)
            if has is False:
                continue
            stale.add_metric(values, 1.0 if board.stale(endpoint.id, now) else 0.0)
            reading = board.reading(endpoint.id)
            if reading is None:
                continue
            running.add_metric(values, reading.running)
            waiting.add_metric(values, reading.waiting)
            age.add_metric(values, max(0.0, now - reading.read_at))
            if reading.kv_cache_usage is not None:
                cache.add_metric(values, reading.kv_cache_usage)
            if reading.prefix_cache_hit_rate is not None:
                hit_rate.add_metric(values, reading.prefix_cache_hit_rate)
        yield from (running, waiting, cache, hit_rate, age, stale, available)
