"""
Replica choice.  Under C{balance = "load"} (the default) a replica's load is
the router's own count of its requests in flight plus the requests its
engine reports waiting (L{llmgw.router.routing.load}; a stale reading counts for
nothing), plus one when its KV cache is at least L{KV_FULL} used; the
least loaded per unit of weight wins, ties rotating per model, between two
replicas drawn at random when a model has more than L{TWO_CHOICES_ABOVE}
(Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing",
IEEE TPDS 12(10), 2001).  A request with an affinity key goes to the
key's owner while that stays within the bound (L{llmgw.router.routing.affinity}).
Under C{"load"} each replica's weight is its configured C{weight} times
the speed factor learnt from its answers (L{llmgw.router.routing.speed}): in the
score, in the bound and in the rendezvous weights.

The engine's running count is left out: the router's in-flight count
already holds its own requests, and holds them without the poll's lag (a
reading a second old would send the next of two sequential requests away
from the replica that just finished one).

Passive health: a replica that refuses connections sits out a cooldown;
one whose answers fail is ejected (L{llmgw.router.routing.ejection}).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.router.interfaces import Endpoint, RequestRecord
from llmgw.router.routing.adapters import AdapterLoads
from llmgw.router.routing.affinity import owner, within_bound
from llmgw.router.routing.ejection import Health, cooldown, verdict
from llmgw.router.routing.gpu_share import GpuShare, Mark
from llmgw.router.routing.load import EngineLoad
from llmgw.router.routing.speed import MIN_DECODE, Speeds
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import RouterMetrics

KV_FULL = 0.9
"""
KV cache use (a fraction) from which a replica counts one request more:
new sequences there wait for blocks or preempt others (vLLM's scheduler).
"""
TWO_CHOICES_ABOVE = 4
"""
Models with more candidate replicas than this choose between two drawn at
random instead of scanning all.
"""


class LoadReadings(Protocol):
    """
    Engine load per replica (L{llmgw.router.routing.load.LoadBoard}).
    """

    def reading(self, replica_id: str) -> EngineLoad | None: ...

    def stale(self, replica_id: str, now: float) -> bool: ...


@dataclass(eq=False)
class Replica:
    """
    The router's live state for one endpoint.

    @ivar outstanding: requests sent and not yet finished, counted by the
        router itself.
    @ivar batch_outstanding: of those, a batch's lines
        (L{llmgw.router.routing.fairness.is_batch}).
    @ivar ejected_until: reactor time, seconds, before which the replica is
        passed over; 0 when healthy.
    @ivar exchanges: how to end each exchange in flight to it at once (see
        L{Balancer.cut}), called with the reason.
    @ivar health: its record of failed answers.
    @ivar gpu: its GPU time shared among its requests (docs/cost.md).
    """

    endpoint: Endpoint
    outstanding: int = 0
    batch_outstanding: int = 0
    ejected_until: float = 0.0
    exchanges: set[Callable[[str], None]] = field(default_factory=set)
    health: Health = field(default_factory=Health)
    gpu: GpuShare = field(default_factory=GpuShare)

    def enter(self, now: float, batch: bool = False) -> Mark:
        """
        A request goes to it at C{now} (seconds): counted in flight (a
        batch's line apart too, when C{batch}).

        @return: its mark, for L{leave}.
        """
        self.outstanding += 1
        self.batch_outstanding += batch
        endpoint = self.endpoint
        return self.gpu.enter(now, endpoint.gpus, endpoint.gpu_hour)

    def leave(self, now: float, mark: Mark, batch: bool = False) -> Mark:
        """
        The request that entered with C{mark} ended at C{now} (a batch's
        line when C{batch}, as it entered).

        @return: its share of the GPUs' time and their price.
        """
        self.outstanding -= 1
        self.batch_outstanding -= batch
        endpoint = self.endpoint
        return self.gpu.leave(now, endpoint.gpus, endpoint.gpu_hour, mark)

    @property
    def id(self) -> str:
        return self.endpoint.id

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def url_bytes(self) -> bytes:
        """
        The base URL, ASCII, for the HTTP client.
        """
        return self.endpoint.url.encode("ascii")


class Balancer:
    """
    Holds the endpoint list and picks a replica per request.

    @param reactor: the clock for ejection cooldowns.
    @param eject_cooldown: seconds a replica that refused a connection is
        passed over.
    @param settings: the policy, affinity and ejection settings.
    @param metrics: where affinity outcomes and ejections are counted, or
        L{None}.
    @param load: the engines' load readings, when the server polls them.
    @param adapters: the LoRA adapters loaded on each replica, which
        narrow an adapter's replicas to those that have it; the router's
        exchanges load adapters through the same one.
    """

    log = Logger()

    def __init__(
        self,
        reactor: IReactorTime,
        eject_cooldown: float,
        rng: random.Random | None = None,
        settings: RouterConfig | None = None,
        *,
        metrics: RouterMetrics | None = None,
        load: LoadReadings | None = None,
        adapters: AdapterLoads | None = None,
    ) -> None:
        self._clock = reactor
        self._cooldown = eject_cooldown
        self._random = rng if rng is not None else random.Random()
        settings = settings if settings is not None else RouterConfig()
        self._balance = settings.balance
        self.affinity = settings.prefix_affinity and settings.balance == "load"
        self._epsilon = settings.affinity_epsilon
        self._eject_after = settings.eject_after
        self._eject_base = settings.eject_base_cooldown
        self.load = load
        self.metrics = metrics
        self.adapters = adapters
        self.speeds = Speeds(reactor)
        # Per model: the turn for ties (and for round robin).
        self._turn: dict[str, int] = {}
        self._replicas: dict[str, Replica] = {}
        self._retired: dict[str, Replica] = {}
        self._by_model: dict[str, list[Replica]] = {}
        # The busy seconds of the replicas taken out of the list, by id.
        self._busy_gone: dict[str, float] = {}

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """
        Replace the endpoint list.  A replica whose id stays (or comes back
        while requests to it are still in flight) is the same object, with
        its outstanding count and ejection, so that in-flight requests,
        which decrement the object they incremented, stay counted.
        """
        replicas: dict[str, Replica] = {}
        by_model: dict[str, list[Replica]] = {}
        for endpoint in endpoints:
            replica = self._replicas.get(endpoint.id) or self._retired.get(endpoint.id)
            if replica is None:
                # Its busy seconds go on from those of its last object:
                # the GPU meter reads them as one count per replica id.
                busy = GpuShare(self._busy_gone.pop(endpoint.id, 0.0))
                replica = Replica(endpoint, gpu=busy)
            elif replica.endpoint != endpoint:
                replica.endpoint = endpoint
            replicas[endpoint.id] = replica
            for model in endpoint.models:
                by_model.setdefault(model, []).append(replica)
        # Replicas taken out with requests still in flight stay countable,
        # so a drain can wait for them.
        retired = {
            r.id: r
            for r in (*self._retired.values(), *self._replicas.values())
            if r.outstanding > 0 and r.id not in replicas
        }
        for gone in (*self._retired.values(), *self._replicas.values()):
            if gone.id not in replicas and gone.id not in retired:
                self._busy_gone[gone.id] = gone.gpu.busy
        self._retired = retired
        self._replicas = replicas
        self._by_model = by_model
        self.speeds.forget(set(replicas))
        if self.adapters is not None:
            self.adapters.sync(list(replicas.values()))

    def observe(self, record: RequestRecord) -> None:
        """
        Learn from a finished request: a streamed answer's decode rate
        feeds its replica's speed factor (L{llmgw.router.routing.speed}).  A few
        microseconds a request.  A request for an adapter no longer keeps
        it loaded there (L{llmgw.router.routing.adapters}).
        """
        if self.adapters is not None:
            self.adapters.finished(record.replica, record.model)
        if (
            record.status != 200
            or not record.stream
            or record.replica is None
            or record.time_to_first_token is None
            or record.completion_tokens < 2
            or self._balance != "load"
        ):
            return
        seconds = record.latency - record.time_to_first_token
        peers = self._by_model.get(record.model)
        if seconds < MIN_DECODE or not peers or len(peers) < 2:
            return
        self.speeds.observe(
            record.model,
            record.replica,
            [r.endpoint.id for r in peers],
            record.completion_tokens - 1,
            seconds,
        )

    def models(self) -> list[str]:
        """
        @return: every model name some endpoint serves, sorted.
        """
        return sorted(self._by_model)

    def count(self, model: str) -> int:
        """
        @return: how many replicas serve C{model}.
        """
        return len(self._by_model.get(model, ()))

    def serves(self, model: str) -> bool:
        """
        @return: whether any endpoint, healthy or not, serves C{model}.
        """
        return model in self._by_model

    def replicas_of(self, model: str) -> list[Replica]:
        """
        @return: the replicas serving C{model}, ejected ones too.
        """
        return list(self._by_model.get(model, ()))

    def replicas(self) -> Sequence[Replica]:
        """
        @return: all replicas, in configuration order.
        """
        return list(self._replicas.values())

    def available(self, model: str) -> bool:
        """
        @return: whether some replica of C{model} is not ejected.
        """
        now = self._clock.seconds()
        return any(r.ejected_until <= now for r in self._by_model.get(model, ()))

    def pick(
        self,
        model: str,
        exclude: frozenset[str] | set[str],
        key: bytes | None = None,
    ) -> Replica | None:
        """
        Choose a replica by the policy (see the module docstring), skipping
        ejected replicas unless all are ejected (then the ones in cooldown
        are tried all the same: refusing every request would be worse than
        trying).  A replica whose ejection for its answers is over gets
        this request as its half-open probe.

        @param model: a model name.
        @param exclude: ids of replicas already tried for this request.
        @param key: the request's affinity key (L{llmgw.router.routing.affinity}),
            or L{None}.
        @return: a replica, or L{None} when none is left to try.
        """
        candidates = self._by_model.get(model)
        if not candidates:
            return None
        now = self._clock.seconds()
        ready: list[Replica] = []
        fallback: list[Replica] = []
        for replica in candidates:
            if replica.endpoint.id in exclude:
                continue
            health = replica.health
            if replica.ejected_until > now or health.probing:
                fallback.append(replica)
                continue
            if health.ejections:
                health.probing = True
                return replica
            ready.append(replica)
        if not ready:
            if not fallback:
                return None
            # The one whose cooldown ends first is the likeliest to be back.
            return min(fallback, key=lambda r: r.ejected_until)
        if self.adapters is not None and ready and ready[0].endpoint.adapters:
            ready = list(
                self.adapters.narrow(model, ready, lambda r: self.load_of(r, now))
            )
        if len(ready) == 1:
            return ready[0]
        balance = self._balance
        if balance == "round_robin":
            turn = self._turn.get(model, 0)
            self._turn[model] = turn + 1
            return ready[turn % len(ready)]
        if balance == "least_in_flight":
            return self._least(
                model,
                ready,
                [r.outstanding for r in ready],
                [r.endpoint.weight for r in ready],
                True,
            )
        return self._by_load(model, ready, key, now)

    def _by_load(
        self, model: str, ready: list[Replica], key: bytes | None, now: float
    ) -> Replica:
        """
        The C{load} policy among two or more ready replicas: the affinity
        key's owner unless past the load bound, else two random choices
        (above L{TWO_CHOICES_ABOVE} replicas) or the least loaded.

        @param now: the clock's seconds, for the load's age.
        """
        factors = self.speeds.factors(model)
        if factors is None:
            weights = [r.endpoint.weight for r in ready]
        else:
            weights = [
                r.endpoint.weight * factors.get(r.endpoint.id, 1.0) for r in ready
            ]
        if key is not None and self.affinity:
            loads = [self.load_of(r, now) for r in ready]
            i = owner(
                key,
                [(r.endpoint.id, w) for r, w in zip(ready, weights, strict=True)],
            )
            chosen = ready[i]
            held = within_bound(
                loads[i], weights[i], sum(loads), sum(weights), self._epsilon
            )
            if self.metrics is not None:
                self.metrics.affinity.labels(
                    model, "owner" if held else "spilled"
                ).inc()
            return chosen if held else self._least(model, ready, loads, weights)
        if len(ready) > TWO_CHOICES_ABOVE:
            a, b = self._random.sample(range(len(ready)), 2)
            la, lb = self.load_of(ready[a], now), self.load_of(ready[b], now)
            return self._least(
                model, [ready[a], ready[b]], [la, lb], [weights[a], weights[b]]
            )
        return self._least(model, ready, [self.load_of(r, now) for r in ready], weights)

    def _least(
        self,
        model: str,
        replicas: Sequence[Replica],
        loads: Sequence[float],
        weights: Sequence[float],
        random_ties: bool = False,
    ) -> Replica:
        """
        @param weights: each replica's weight (configured, times its speed
            factor under the C{load} policy).
        @return: the replica of least C{(load + 1) / weight}, ties taking
            turns per model (or at random: the least_in_flight policy,
            the router's choice before engine load was read).
        """
        best: list[Replica] = []
        best_score = 0.0
        for replica, load, weight in zip(replicas, loads, weights, strict=True):
            score = (load + 1) / weight
            if not best or score < best_score:
                best = [replica]
                best_score = score
            elif score == best_score:
                best.append(replica)
        if len(best) == 1:
            return best[0]
        if random_ties:
            return self._random.choice(best)
        turn = self._turn.get(model, 0)
        self._turn[model] = turn + 1
        return best[turn % len(best)]

    def load_of(self, replica: Replica, now: float) -> float:
        """
        @param now: reactor time, seconds.
        @return: the replica's load, requests: in flight from this router,
            plus its engine's waiting requests and one for a nearly full KV
            cache when the reading is fresh (and the policy is C{load}).
        """
        load: float = replica.outstanding
        board = self.load
        if board is None or self._balance != "load":
            return load
        reading = board.reading(replica.endpoint.id)
        if reading is None or board.stale(replica.endpoint.id, now):
            return load
        load += reading.waiting
        usage = reading.kv_cache_usage
        if usage is not None and usage >= KV_FULL:
            load += 1
        return load

    def overloaded(self, model: str, depth: int) -> bool:
        """
        @param depth: waiting requests per engine; 0 or less: never.
        @return: whether every replica of C{model} in service has a fresh
            reading with more than C{depth} requests waiting.
        """
        board = self.load
        if board is None or depth <= 0:
            return False
        now = self._clock.seconds()
        seen = False
        for replica in self._by_model.get(model, ()):
            if replica.ejected_until > now:
                continue
            rid = replica.endpoint.id
            reading = board.reading(rid)
            if reading is None or reading.waiting <= depth or board.stale(rid, now):
                return False
            seen = True
        return seen

    def report(self, replica: Replica, failed: bool | None) -> None:
        """
        Record the outcome of an attempt on C{replica}: it may be ejected
        (L{llmgw.router.routing.ejection.verdict}) or come back.

        @param failed: L{True} for a 5xx answer or a deadline, L{False} for
            an answer, L{None} when the outcome says nothing of the replica.
        """
        health = replica.health
        if failed is None and not health.probing:
            return
        if not failed and not health.ejections and not health.failures:
            return
        now = self._clock.seconds()
        others_left = bool(failed) and all(
            any(
                o is not replica and o.ejected_until <= now and not o.health.ejections
                for o in self._by_model.get(model, ())
            )
            for model in replica.endpoint.models
        )
        n = verdict(health, failed, self._eject_after, others_left)
        if n > 0:
            seconds = cooldown(self._eject_base, n)
            replica.ejected_until = now + seconds
            if self.metrics is not None:
                self.metrics.ejections.labels(replica.id).inc()
            self.log.warn(
                "replica {replica} ejected for {seconds:g}s: failed answers"
                " (ejection {count} in a row)",
                replica=replica.id,
                seconds=seconds,
                count=n,
            )
        elif n < 0:
            replica.ejected_until = 0.0
            self.log.info("replica {replica} is back in service", replica=replica.id)
        elif failed and not others_left and health.failures == self._eject_after > 0:
            self.log.warn(
                "replica {replica} keeps failing but is the last of a model"
                " in service: not ejected",
                replica=replica.id,
            )

    def outstanding(self, replica_id: str) -> int:
        """
        @return: requests in flight to the replica C{replica_id}, 0 when
            it is not (or no longer) in the list.
        """
        count = 0
        for table in (self._replicas, self._retired):
            replica = table.get(replica_id)
            if replica is not None:
                count += replica.outstanding
        return count

    def busy(self, replica_id: str) -> float:
        """
        @return: seconds during which the replica C{replica_id} had a
            request of this router in flight, since the router first sent
            it one, up to now (L{GpuShare.busy_at}); kept when it leaves the
            list (a replica asleep, drained), and gone on from when it comes
            back.
        """
        replica = self._replicas.get(replica_id) or self._retired.get(replica_id)
        if replica is None:
            return self._busy_gone.get(replica_id, 0.0)
        return replica.gpu.busy_at(self._clock.seconds())

    def interactive_outstanding(self, replica_id: str) -> int:
        """
        @return: clients' requests in flight to the replica C{replica_id}:
            L{outstanding} less a batch's lines.
        """
        count = 0
        for table in (self._replicas, self._retired):
            replica = table.get(replica_id)
            if replica is not None:
                count += replica.outstanding - replica.batch_outstanding
        return count

    def cut(self, replica_id: str, why: str) -> int:
        """
        The replica C{replica_id} went away (its node was lost, its engine
        exited, or its drain ran out of time): end the exchanges in flight
        to it now, rather than at their idle deadline (a lost node's
        connections see no FIN; they would hang until then).

        @param why: the reason, in a few words fit for a client.
        @return: how many exchanges were cut.
        """
        cutters: list[Callable[[str], None]] = []
        for table in (self._replicas, self._retired):
            replica = table.get(replica_id)
            if replica is not None:
                cutters.extend(replica.exchanges)
                replica.exchanges.clear()
        for cut in cutters:
            cut(why)
        return len(cutters)

    def eject(self, replica: Replica) -> None:
        """
        Pass over C{replica} for the cooldown.
        """
        replica.ejected_until = self._clock.seconds() + self._cooldown
