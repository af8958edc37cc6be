"""
Overload: when every replica of a model reports more requests waiting in
its engine than C{[router] overload_queue_depth}, new requests for it wait
in the router, in a bounded queue per model, instead of piling onto the
engines; or, with C{overload_wait = "0s"}, get a 429 with C{Retry-After} at
once.  Waiting requests go on, oldest first, as soon as the readings show a
replica below the depth.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from llmgw.router.errors import APIError


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


class Overload:
    """
    The per-model waiting rooms.

    @param clock: the reactor's clock.
    @param overloaded: whether a model's engines are all past the depth
        (L{llmgw.router.balancer.Balancer.overloaded}, bound to it).
    @param replicas: how many replicas a model has (how many waiting
        requests go on per check).
    @param wait: seconds a request may wait; 0 turns requests away at once.
    @param size: requests that may wait per model.
    @param recheck: seconds between checks of the readings while requests
        wait (a fraction of the load poll interval).
    @param retry_after: seconds for the 429's C{Retry-After}.
    @param count: called with the model and C{"waited"} or C{"refused"}
        for each request held back.
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
    ) -> None:
        self.clock = clock
        self._overloaded = overloaded
        self._replicas = replicas
        self.wait = wait
        self.size = size
        self.recheck = max(recheck, 0.05)
        self.retry_after = max(1, math.ceil(retry_after))
        self._queues: dict[str, deque[Deferred[None]]] = {}
        self._checks: dict[str, IDelayedCall] = {}
        self._count = count or (lambda model, outcome: None)

    def waiting(self, model: str) -> int:
        """
        @return: requests waiting for C{model}.
        """
        return len(self._queues.get(model, ()))

    def admit(self, model: str) -> Deferred[None] | None:
        """
        Let a request for C{model} go on, or make it wait.

        @return: L{None} to go on now (no Deferred on the hot path), or a
            Deferred that fires when it may go on (cancel it when the client
            leaves), or fails with a 429 L{APIError} after C{wait} seconds.
        @raise APIError: a 429 at once: C{wait} is 0 or the queue is full.
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
            queue = self._queues[model] = deque()
        if len(queue) >= self.size:
            self._count(model, "refused")
            raise overloaded_error(model, self.retry_after, "too many requests wait")
        timer: IDelayedCall | None = None

        def cancel(d: Deferred[None]) -> None:
            if timer is not None and timer.active():
                timer.cancel()
            if d in queue:
                queue.remove(d)
            self._tidy(model)

        def time_out() -> None:
            self._count(model, "refused")
            queue.remove(ready)
            self._tidy(model)
            ready.errback(
                overloaded_error(
                    model, self.retry_after, f"waited {self.wait:g}s for a free engine"
                )
            )

        ready: Deferred[None] = Deferred(cancel)
        timer = self.clock.callLater(self.wait, time_out)
        ready.addBoth(self._stop_timer, timer)
        queue.append(ready)
        if model not in self._checks:
            self._checks[model] = self.clock.callLater(self.recheck, self._check, model)
        return ready

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
                queue.popleft().callback(None)
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
