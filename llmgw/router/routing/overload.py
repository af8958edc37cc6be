"""
Overload: when every replica of a model reports more requests waiting in
its engine than C{[router] overload_queue_depth}, new requests for it wait
in the router, in a bounded queue per model, instead of piling onto the
engines; or, with C{overload_wait = "0s"}, get a 429 with C{Retry-After} at
once.  Waiting requests go on, oldest first, as soon as the readings show a
replica below the depth.

Who goes on first, and who is refused when the room is full, is
L{llmgw.router.routing.fairness}'s: by priority, then fair share of the tokens
served (or by arrival, C{waiting_order = "fifo"}).  A refusal's
C{Retry-After} is computed from the queue: the time the room took lately
to let as many requests go as would go before the one refused.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from llmgw.router.errors import APIError
from llmgw.router.routing.fairness import (
    ANONYMOUS,
    FairQueue,
    FairShare,
    Tenant,
    retry_from_rate,
)

RELEASES_KEPT = 64
"""
Releases remembered per model, for a refusal's C{Retry-After}.
"""


def overloaded_error(model: str, retry_after: int, why: str) -> APIError:
    """
    @return: a 429 for a request turned away because C{model}'s engines
        are all behind.
    """
    return APIError(
        429,
        f"Every replica of model {model!r} is overloaded ({why}); try again later.",
        "rate_limit_error",
        "model_overloaded",
        retry_after=retry_after,
    )


ANONYMOUS_LOWEST = Tenant(rank=-(2**31))
"""
A tenant behind every other, for the C{Retry-After} of a request whose
place was taken (it would wait behind all of them).
"""


class Overload:
    """
    The per-model waiting rooms.

    @param clock: the reactor's clock.
    @param overloaded: whether a model's engines are all past the depth
        (L{llmgw.router.routing.balancer.Balancer.overloaded}, bound to it).
    @param replicas: how many replicas a model has (how many waiting
        requests go on per check).
    @param wait: seconds a request may wait; 0 turns requests away at once.
    @param size: requests that may wait per model.
    @param recheck: seconds between checks of the readings while requests
        wait (a fraction of the load poll interval).
    @param retry_after: seconds for the 429's C{Retry-After} when the room
        let no request go lately (else computed from the queue).
    @param count: called with the model and C{"waited"} or C{"refused"}
        for each request held back.
    @param shares: the tokens each key was served lately (shared with
        the activation queues); L{None} for a room of its own.
    @param fifo: first come, first served (C{waiting_order = "fifo"}).
    """

    def __init__(
        self,
        clock: IReactorTime,
        overloaded: Callable[[str], bool],
        replicas: Callable[[str], int],
        wait: float,
        size: int,
        recheck: float,
        retry_after: float,
        count: Callable[[str, str], None] | None = None,
        shares: FairShare | None = None,
        fifo: bool = False,
    ) -> None:
        self.clock = clock
        self._overloaded = overloaded
        self._replicas = replicas
        self.wait = wait
        self.size = size
        self.recheck = max(recheck, 0.05)
        self.retry_after = max(1, math.ceil(retry_after))
        self.shares = shares if shares is not None else FairShare(clock)
        self._fifo = fifo
        self._queues: dict[str, FairQueue[Deferred[None]]] = {}
        self._released: dict[str, deque[float]] = {}
        self._checks: dict[str, IDelayedCall] = {}
        self._count = count or (lambda model, outcome: None)

    def waiting(self, model: str) -> int:
        """
        @return: requests waiting for C{model}.
        """
        return len(self._queues.get(model, ()))

    def admit(self, model: str, tenant: Tenant = ANONYMOUS) -> Deferred[None] | None:
        """
        Let a request for C{model} go on, or make it wait.

        @param tenant: whose request it is (its key's priority and weight).
        @return: L{None} to go on now (no Deferred on the hot path), or a
            Deferred that fires when it may go on (cancel it when the client
            leaves), or fails with a 429 L{APIError} after C{wait} seconds,
            or when a request of a higher priority took its place.
        @raise APIError: a 429 at once: C{wait} is 0, or the queue is full
            of requests of the same priority or higher.
        """
        queue = self._queues.get(model)
        # Behind those already waiting, even if the readings just cleared.
        if not queue and not self._overloaded(model):
            return None
        if self.wait <= 0:
            self._count(model, "refused")
            raise overloaded_error(
                model, self.retry_after, "its engines' queues are full"
            )
        if queue is None:
            queue = self._queues[model] = FairQueue(self.shares, self._fifo)
        if len(queue) >= self.size:
            self._make_room(model, queue, tenant)
        return self._hold(model, queue, tenant)

    def _make_room(
        self, model: str, queue: FairQueue[Deferred[None]], tenant: Tenant
    ) -> None:
        """
        The room is full: refuse its lowest priority's newest request,
        the newcomer's (raised) or one waiting (failed).
        """
        self._count(model, "refused")
        victim = queue.victim(tenant)
        if victim is None:
            raise overloaded_error(
                model, self.retry_for(model, tenant), "too many requests wait"
            )
        queue.remove(victim)
        victim.errback(
            overloaded_error(
                model,
                self.retry_for(model, ANONYMOUS_LOWEST),
                "requests of a higher priority took its place",
            )
        )

    def _hold(
        self, model: str, queue: FairQueue[Deferred[None]], tenant: Tenant
    ) -> Deferred[None]:
        timer: IDelayedCall | None = None

        def cancel(d: Deferred[None]) -> None:
            if timer is not None and timer.active():
                timer.cancel()
            queue.remove(d)
            self._tidy(model)

        def time_out() -> None:
            self._count(model, "refused")
            queue.remove(ready)
            self._tidy(model)
            ready.errback(
                overloaded_error(
                    model,
                    self.retry_for(model, tenant),
                    f"waited {self.wait:g}s for a free engine",
                )
            )

        ready: Deferred[None] = Deferred(cancel)
        timer = self.clock.callLater(self.wait, time_out)
        ready.addBoth(self._stop_timer, timer)
        queue.push(tenant, ready)
        if model not in self._checks:
            self._checks[model] = self.clock.callLater(self.recheck, self._check, model)
        return ready

    def retry_for(self, model: str, tenant: Tenant) -> int:
        """
        @return: seconds for the C{Retry-After} of a request of C{tenant}
            refused now: how long the room took lately to let go as many
            requests as wait before it (L{retry_from_rate}), else the
            configured C{retry_after}.
        """
        queue = self._queues.get(model)
        ahead = queue.ahead(tenant) if queue is not None else 0
        return retry_from_rate(lambda: self._recent(model), ahead, self.retry_after)

    def _recent(self, model: str) -> tuple[int, float]:
        released = self._released.get(model)
        if not released:
            return 0, 0.0
        return len(released), self.clock.seconds() - released[0]

    @staticmethod
    def _stop_timer(result: object, timer: IDelayedCall) -> object:
        if timer.active():
            timer.cancel()
        return result

    def _check(self, model: str) -> None:
        del self._checks[model]
        queue = self._queues.get(model)
        if not queue:
            return
        if not self._overloaded(model):
            for _ in range(max(self._replicas(model), 1)):
                if not queue:
                    break
                self._count(model, "waited")
                self._released.setdefault(model, deque(maxlen=RELEASES_KEPT)).append(
                    self.clock.seconds()
                )
                queue.pop()[1].callback(None)
        if queue:
            self._checks[model] = self.clock.callLater(self.recheck, self._check, model)
        else:
            self._tidy(model)

    def _tidy(self, model: str) -> None:
        if not self._queues.get(model):
            self._queues.pop(model, None)
            check = self._checks.pop(model, None)
            if check is not None and check.active():
                check.cancel()
