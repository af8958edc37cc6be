"""
Replica choice: least outstanding requests, weighted, random tie-break, with
passive health (a replica that refuses connections sits out a cooldown).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from twisted.internet.interfaces import IReactorTime

from llmgw.router.interfaces import Endpoint


@dataclass(eq=False)
class Replica:
    """
    The router's live state for one endpoint.

    @ivar outstanding: requests sent and not yet finished, counted by the
        router itself.
    @ivar ejected_until: reactor time, seconds, before which the replica is
        passed over; 0 when healthy.
    @ivar exchanges: how to end each exchange in flight to it at once (see
        L{Balancer.cut}), called with the reason.
    """

    endpoint: Endpoint
    outstanding: int = 0
    ejected_until: float = 0.0
    exchanges: set[Callable[[str], None]] = field(default_factory=set)

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
    """

    def __init__(
        self,
        reactor: IReactorTime,
        eject_cooldown: float,
        rng: random.Random | None = None,
    ) -> None:
        self._clock = reactor
        self._cooldown = eject_cooldown
        self._random = rng if rng is not None else random.Random()
        self._replicas: dict[str, Replica] = {}
        self._retired: dict[str, Replica] = {}
        self._by_model: dict[str, list[Replica]] = {}

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
                replica = Replica(endpoint)
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
        self._retired = retired
        self._replicas = replicas
        self._by_model = by_model

    def models(self) -> list[str]:
        """
        @return: every model name some endpoint serves, sorted.
        """
        return sorted(self._by_model)

    def serves(self, model: str) -> bool:
        """
        @return: whether any endpoint, healthy or not, serves C{model}.
        """
        return model in self._by_model

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

    def pick(self, model: str, exclude: frozenset[str] | set[str]) -> Replica | None:
        """
        Choose the replica with the fewest outstanding requests per unit of
        weight, at random among equals, skipping ejected replicas unless all
        are ejected (then the ones in cooldown are tried all the same:
        refusing every request would be worse than trying).

        @param model: a model name.
        @param exclude: ids of replicas already tried for this request.
        @return: a replica, or L{None} when none is left to try.
        """
        candidates = self._by_model.get(model)
        if not candidates:
            return None
        now = self._clock.seconds()
        best: list[Replica] = []
        best_score = 0.0
        fallback: list[Replica] = []
        for replica in candidates:
            if replica.endpoint.id in exclude:
                continue
            if replica.ejected_until > now:
                fallback.append(replica)
                continue
            score = (replica.outstanding + 1) / replica.endpoint.weight
            if not best or score < best_score:
                best = [replica]
                best_score = score
            elif score == best_score:
                best.append(replica)
        if not best:
            if not fallback:
                return None
            # The one whose cooldown ends first is the likeliest to be back.
            return min(fallback, key=lambda r: r.ejected_until)
        if len(best) == 1:
            return best[0]
        return self._random.choice(best)

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
