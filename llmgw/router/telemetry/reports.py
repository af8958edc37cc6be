"""
One set of traffic numbers whatever the process layout: the routers of a
tier (C{llmgw-server --router-workers N}'s children, or C{llmgw-router}
daemons) report their traffic to the server they follow, which serves it
on its C{/metrics} and its dashboard beside its own.  Both ends, sans-IO.

Why reports and not prometheus_client's multiprocess mode: that mode
shares files in one folder, so it covers only the server's own workers on
its machine, not routers elsewhere; it is chosen by an environment
variable before the import, for every metric of the process (the fleet's
gauges too); and the dashboard's figures (L{llmgw.web.traffic}) are no
Prometheus metrics.  One mechanism covers both layouts.

What a router sends (L{Reporter.payload}; C{POST /api/v1/report} every
L{REPORT_INTERVAL} seconds)::

    {"reporter": "RANDOM HEX, one per router process",
     "metrics": [{"family": "llmgw_requests", "type": "counter",
                  "samples": [["llmgw_requests_total",
                               {"model": "m", "status": "200"}, 12.0]]}],
     "traffic": [{"seq": 3, "series": [{"model": "m", "replica": "r1",
                  "requests": 5, "errors": 1, "ttft": {"1234": 2}}]}]}

C{metrics} holds the router's cumulative values, since its process
started, of the counters, histograms and gauges of its
L{llmgw.router.telemetry.metrics.RouterMetrics} that changed since the
server last acknowledged them (a histogram's every sample of a label set
when one changed).  The server (L{Reports}) adds what each reporter's
value grew by to its sums (L{ReportedMetrics}): a report sent again after
a lost answer adds nothing, and a router that restarts is a new reporter
counting from 0, so the server's counters never go back (Prometheus sees
no reset; a router killed loses at most the counts of its last
L{REPORT_INTERVAL}).  A gauge (requests in flight) counts each router's
last value while it reported within L{LIVE} seconds.

C{traffic} holds, per batch of L{REPORT_INTERVAL} not yet acknowledged,
the finished requests per model and replica as the dashboard counts them
(5xx as errors; times to first token of streams answered, in tenths of a
millisecond); the server counts each batch once (by C{seq}), when it
arrives.
"""

from __future__ import annotations

import copy
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from llmgw.router.interfaces import RequestRecord

REPORT_INTERVAL = 1.0
"""
Seconds between a router's reports to its server.
"""

LIVE = 5.0
"""
Seconds a router's gauges count after its last report.
"""

MAX_REPORTERS = 1024
"""
Routers the server remembers (the most recently heard): each restart of a
worker is a new one.  A router forgotten (more than this many heard since
it last reported) that reports again is counted again from its start.
"""

MAX_SERIES = 100_000
"""
Samples the server sums from reports, at most; a sample past it is not
counted.
"""

MAX_BATCHES = 60
"""
Traffic batches a router keeps while its server does not answer (a
minute at L{REPORT_INTERVAL}); older ones are dropped.
"""

MAX_SERIES_PER_BATCH = 10_000
"""
Models and replicas in one traffic batch, at most.
"""

OTHER = "other"
"""
The model of requests for names the router does not know (as the
dashboard counts them).
"""

TTFT_UNIT = 1e-4
"""
Seconds per unit of the times to first token a report carries.
"""

_SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gauge": ("",),
}

Key = tuple[str, tuple[tuple[str, str], ...]]
"""
A sample: its name, and its labels sorted.
"""


def _key(sample: Sample) -> Key:
    return sample.name, tuple(sorted(sample.labels.items()))


def _groups(collectors: Iterable[Collector]) -> Iterator[tuple[Metric, list[Sample]]]:
    """
    @return: each metric family of C{collectors} with its samples, in
        groups: one per sample, or a histogram's label set (its buckets,
        count and sum); no C{_created} sample.
    """
    for collector in collectors:
        for metric in collector.collect():
            groups: dict[tuple[tuple[str, str], ...], list[Sample]] = {}
            for sample in metric.samples:
                if sample.name.endswith("_created"):
                    continue
                if metric.type == "histogram":
                    labels = tuple(
                        sorted((k, v) for k, v in sample.labels.items() if k != "le")
                    )
                else:
                    labels = _key(sample)[1] + (("", sample.name),)
                groups.setdefault(labels, []).append(sample)
            for samples in groups.values():
                yield metric, samples


class _Tally:
    """
    One model's and replica's finished requests in a traffic batch.
    """

    __slots__ = ("requests", "errors", "ttft")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.ttft: dict[int, int] = {}


class Reporter:
    """
    A router's side (sans-IO): what its next report says, and what the
    server has acknowledged.  Also the router's L{UsageSink} for the
    dashboard's figures (L{record}).

    @param collectors: the router's metrics
        (L{llmgw.router.telemetry.metrics.RouterMetrics.collectors}).
    @param resolve: a name's catalog model, or L{None} (counted under
        L{OTHER}).
    @param reporter: this process's name in its reports; random by default.
    """

    def __init__(
        self,
        collectors: Iterable[Collector],
        resolve: Callable[[str], str | None],
        reporter: str | None = None,
    ) -> None:
        self.reporter = reporter or secrets.token_hex(8)
        self._collectors = tuple(collectors)
        self._resolve = resolve
        self._acked: dict[Key, float] = {}
        self._tally: dict[tuple[str, str | None], _Tally] = {}
        self._batches: list[dict[str, Any]] = []
        self._seq = 0

    def record(self, record: RequestRecord) -> None:
        """
        Count a finished request in the current traffic batch.
        """
        key = (self._resolve(record.model) or OTHER, record.replica)
        tally = self._tally.get(key)
        if tally is None:
            if len(self._tally) >= MAX_SERIES_PER_BATCH:
                return
            tally = self._tally[key] = _Tally()
        tally.requests += 1
        if record.status >= 500:
            tally.errors += 1
        ttft = record.time_to_first_token
        # Streams answered, as the dashboard counts them: an error's first
        # byte is no token.
        if ttft is not None and record.stream and record.status < 400:
            unit = round(ttft / TTFT_UNIT)
            tally.ttft[unit] = tally.ttft.get(unit, 0) + 1

    def payload(self) -> dict[str, Any] | None:
        """
        Close the current traffic batch.

        @return: the next report (the module's docstring), or L{None} when
            there is nothing to say.  Call L{delivered} with it once the
            server took it; until then every later payload says it again.
        """
        if self._tally:
            self._seq += 1
            series = [
                {
                    "model": model,
                    "replica": replica,
                    "requests": tally.requests,
                    "errors": tally.errors,
                    "ttft": {str(unit): n for unit, n in tally.ttft.items()},
                }
                for (model, replica), tally in self._tally.items()
            ]
            self._tally = {}
            self._batches.append({"seq": self._seq, "series": series})
            del self._batches[:-MAX_BATCHES]
        metrics = self._changed()
        if not metrics and not self._batches:
            return None
        return {
            "reporter": self.reporter,
            "metrics": metrics,
            "traffic": list(self._batches),
        }

    def _changed(self) -> list[dict[str, Any]]:
        families: dict[str, dict[str, Any]] = {}
        acked = self._acked
        for metric, samples in _groups(self._collectors):
            gauge = metric.type == "gauge"
            changed = any(
                acked.get(_key(s), 0.0) != s.value or (gauge and s.value)
                for s in samples
            )
            if not changed:
                continue
            family = families.setdefault(
                metric.name,
                {"family": metric.name, "type": metric.type, "samples": []},
            )
            family["samples"].extend([s.name, s.labels, s.value] for s in samples)
        return list(families.values())

    def delivered(self, payload: dict[str, Any]) -> None:
        """
        The server took C{payload} (from L{payload}): its values are
        acknowledged and its batches forgotten.
        """
        for family in payload["metrics"]:
            for name, labels, value in family["samples"]:
                self._acked[name, tuple(sorted(labels.items()))] = value
        sent = {batch["seq"] for batch in payload["traffic"]}
        self._batches = [b for b in self._batches if b["seq"] not in sent]


class ReportedMetrics:
    """
    The server's side of the metrics (sans-IO): what the routers' values
    grew by, summed, and their gauges, added to the server's own samples
    at each scrape (L{merge}).

    @param families: the name and type (C{counter}, C{histogram},
        C{gauge}) of each family a report may add to.
    @param clock: seconds, for the gauges' L{LIVE} (C{time.monotonic}).
    """

    def __init__(
        self,
        families: dict[str, str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.families = dict(families)
        self._clock = clock
        self._sums: dict[str, dict[Key, float]] = {}
        self._count = 0
        self._gauges: dict[str, tuple[float, dict[str, dict[Key, float]]]] = {}

    def add(self, family: str, key: Key, amount: float) -> None:
        """
        Add C{amount} to the sample C{key} of C{family} (once more than
        L{MAX_SERIES} samples are summed, only to those already summed).
        """
        sums = self._sums.setdefault(family, {})
        if key not in sums:
            if self._count >= MAX_SERIES:
                return
            self._count += 1
            sums[key] = 0.0
        sums[key] += amount

    def set_gauges(self, reporter: str, gauges: dict[str, dict[Key, float]]) -> None:
        """
        A reporter's gauge samples now (per family), replacing the ones it
        said before.
        """
        if gauges:
            self._gauges[reporter] = (self._clock(), gauges)

    def forget_reporter(self, reporter: str) -> None:
        """
        Drop the gauges of a reporter the server no longer remembers
        (L{MAX_REPORTERS}); its sums stay counted.
        """
        self._gauges.pop(reporter, None)

    def drop(self, family: str, label: str, kept: set[str]) -> None:
        """
        Forget the sums of C{family}'s samples whose C{label} is none of
        C{kept} (the ejections of replicas gone).
        """
        sums = self._sums.get(family)
        if not sums:
            return
        for key in [k for k in sums if dict(k[1]).get(label) not in kept]:
            del sums[key]
            self._count -= 1

    def merge(self, metric: Metric) -> Metric:
        """
        @return: C{metric} (one family of a scrape) with what the routers
            reported added: to the sample of the same name and labels, or
            as a new one after the family's own; C{metric} itself when
            nothing was reported for it.
        """
        now = self._clock()
        extra: dict[Key, float] = dict(self._sums.get(metric.name, {}))
        for reporter, (at, gauges) in list(self._gauges.items()):
            if now - at > LIVE:
                del self._gauges[reporter]
                continue
            for key, value in gauges.get(metric.name, {}).items():
                extra[key] = extra.get(key, 0.0) + value
        if not extra:
            return metric
        merged = copy.copy(metric)
        samples = list(metric.samples)
        index = {_key(s): i for i, s in enumerate(samples)}
        for key, value in extra.items():
            i = index.get(key)
            if i is None:
                samples.append(Sample(key[0], dict(key[1]), value))
            else:
                samples[i] = samples[i]._replace(value=samples[i].value + value)
        merged.samples = samples
        return merged


class TrafficSink(Protocol):
    """
    The dashboard's figures, as reports add to them
    (L{llmgw.web.traffic.Traffic.add}).
    """

    def add(
        self,
        model: str,
        replica: str | None,
        requests: int,
        errors: int,
        ttft: dict[float, int],
    ) -> None:
        """
        Count C{requests} finished requests of C{model} on C{replica}
        (L{None}: none answered), C{errors} of them 5xx, with these times
        to first token (seconds -> count) now.
        """


@dataclass
class _Seen:
    """
    What the server remembers of one reporter.

    @ivar values: its last cumulative value of each sample.
    @ivar seq: the last traffic batch counted.
    """

    values: dict[Key, float] = field(default_factory=dict)
    seq: int = 0


class Reports:
    """
    The server's side of C{POST /api/v1/report} (sans-IO): a report
    checked, its growth added to L{ReportedMetrics} and its new traffic
    batches to the dashboard's figures.

    @param metrics: the server's sums.
    @param traffic: the dashboard's figures, or L{None}.
    """

    def __init__(self, metrics: ReportedMetrics, traffic: TrafficSink | None) -> None:
        self.metrics = metrics
        self.traffic = traffic
        self._seen: OrderedDict[str, _Seen] = OrderedDict()

    def take(self, body: Any) -> int:
        """
        @param body: a report, as JSON decoded.
        @return: the samples and series it carried.
        @raise ValueError: it is not a report (the message says what is
            wrong); nothing of it was counted.
        """
        reporter, families, batches = _checked(body, self.metrics.families)
        seen = self._seen.pop(reporter, None) or _Seen()
        self._seen[reporter] = seen
        while len(self._seen) > MAX_REPORTERS:
            gone, _ = self._seen.popitem(last=False)
            self.metrics.forget_reporter(gone)
        taken = 0
        gauges: dict[str, dict[Key, float]] = {}
        for family, kind, samples in families:
            for key, value in samples:
                taken += 1
                if kind == "gauge":
                    gauges.setdefault(family, {})[key] = value
                    continue
                before = seen.values.get(key, 0.0)
                seen.values[key] = value
                # Less than before: the same reporter cannot restart, so
                # only a bug; count it as new rather than going back.
                grown = value - before if value >= before else value
                if grown:
                    self.metrics.add(family, key, grown)
        self.metrics.set_gauges(reporter, gauges)
        for seq, series in batches:
            if seq <= seen.seq:
                continue
            seen.seq = seq
            for model, replica, requests, errors, ttft in series:
                taken += 1
                if self.traffic is not None:
                    self.traffic.add(model, replica, requests, errors, ttft)
        return taken


def _text(value: Any, what: str, longest: int = 200) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= longest:
        raise ValueError(f"{what} must be a string of 1 to {longest} characters")
    return value


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be a whole number, 0 or more")
    return value


def _number(value: Any, what: str) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number, 0 or more")
    return float(value)


def _labels(value: Any, what: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or len(value) > 10:
        raise ValueError(f"{what} must be an object of at most 10 labels")
    for name, label in value.items():
        _text(name, f"{what}: a label's name", 100)
        _text(label, f"{what}: label {name[:100]}")
    return tuple(sorted(value.items()))


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list")
    return value


def _checked(
    body: Any, known: dict[str, str]
) -> tuple[
    str,
    list[tuple[str, str, list[tuple[Key, float]]]],
    list[tuple[int, list[tuple[str, str | None, int, int, dict[float, int]]]]],
]:
    """
    @return: a report's reporter, its families (name, type, samples) and
        its traffic batches (seq, series), checked.
    @raise ValueError: it is not a report; families of a name or type
        C{known} does not have, and samples not of their family, are not.
    """
    if not isinstance(body, dict):
        raise ValueError("a report must be a JSON object")
    reporter = _text(body.get("reporter"), "reporter", 64)
    families = []
    for family in _list(body.get("metrics", []), "metrics"):
        if not isinstance(family, dict):
            raise ValueError("metrics: each family must be an object")
        name = _text(family.get("family"), "metrics: family")
        kind = family.get("type")
        if not isinstance(kind, str) or known.get(name) != kind:
            raise ValueError(f"metrics: no {kind!r} family {name!r} here")
        names = {name + suffix for suffix in _SAMPLE_SUFFIXES[kind]}
        samples = []
        for sample in _list(family.get("samples"), f"metrics: {name}: samples"):
            if not isinstance(sample, list) or len(sample) != 3:
                raise ValueError(f"metrics: {name}: a sample is [name, labels, value]")
            if sample[0] not in names:
                raise ValueError(f"metrics: {name}: no sample {str(sample[0])[:200]!r}")
            labels = _labels(sample[1], f"metrics: {name}: labels")
            value = _number(sample[2], f"metrics: {name}: a value")
            samples.append(((sample[0], labels), value))
        families.append((name, kind, samples))
    batches = []
    for batch in _list(body.get("traffic", []), "traffic"):
        if not isinstance(batch, dict):
            raise ValueError("traffic: each batch must be an object")
        seq = _count(batch.get("seq"), "traffic: seq")
        series = []
        for one in _list(batch.get("series"), "traffic: series"):
            if not isinstance(one, dict):
                raise ValueError("traffic: each series must be an object")
            model = _text(one.get("model"), "traffic: model")
            replica = one.get("replica")
            if replica is not None:
                replica = _text(replica, "traffic: replica")
            requests = _count(one.get("requests"), "traffic: requests")
            errors = _count(one.get("errors"), "traffic: errors")
            ttft = one.get("ttft", {})
            if not isinstance(ttft, dict):
                raise ValueError("traffic: ttft must be an object")
            times = {}
            for unit, n in ttft.items():
                if not isinstance(unit, str) or not unit.isdigit():
                    raise ValueError("traffic: ttft's keys must be digits")
                times[int(unit) * TTFT_UNIT] = _count(n, "traffic: a ttft count")
            if errors > requests or sum(times.values()) > requests:
                raise ValueError("traffic: more errors or times than requests")
            series.append((model, replica, requests, errors, times))
        batches.append((seq, series))
    return reporter, families, batches
