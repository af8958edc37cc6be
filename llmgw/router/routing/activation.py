"""
One request's wait for a replica of its model to start: its place in the
model's activation queue, the timer of C{activation_timeout}, a stream's
keep-alive comments meanwhile (saying where the request stands,
L{Activator.where}), and the C{Retry-After} of a wait that ends unserved.
The exchange (L{llmgw.router.api.exchange}) awaits it and says what its end
means.

C{Retry-After} is computed, never a fixed number (L{retry_seconds}): the
control plane's estimate when it has one (L{Standing.eta_seconds}: a wake,
a start, the models ahead in the swap queue), else what this router saw:
how long its recent activations took (L{ActivationQueues.typical}) less
how long the oldest request in the model's queue has waited (the
activation under way began about then; every request in the queue is let
go when its replica is ready, so a retry then finds room).

A full queue refuses its lowest priority's newest request
(L{llmgw.router.routing.fairness}): the newcomer, or one waiting of a lower
priority, whose wait then ends with the 503 (L{ActivationWait.evicted}).  The
control plane keeps the same bound across the fleet (the server's router
and every router of a tier) and refuses the fleet's lowest priority's
newest past it, whichever router holds it: the activation then fails with
L{llmgw.router.interfaces.ActivationRefused}, answered with the same 503.
Every request waiting is let go when the replica is ready; the overload
room then orders them, if the replica is behind.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from statistics import median

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmgw.router.errors import activation_queue_full
from llmgw.router.interfaces import Activator, Standing
from llmgw.router.routing.fairness import ANONYMOUS, PRIORITIES, Tenant, is_batch
from llmgw.router.settings import RouterConfig

KEPT = 8
"""
Activations remembered per model, for L{ActivationQueues.typical}.
"""

MAX_WORDS = 200
"""
Characters of a L{Standing}'s words said in a keep-alive comment, at most.
"""


def retry_seconds(eta: float | None, typical: float | None, waited: float) -> int:
    """
    @param eta: the control plane's estimate, seconds until a replica is
        ready (L{Standing.eta_seconds}), or L{None}.
    @param typical: seconds recent activations took, or L{None} when none
        was seen.
    @param waited: seconds the oldest request in the model's queue has
        waited (0 for none).
    @return: whole seconds for C{Retry-After}, at least 1: C{eta} when
        known; else what is left of a typical activation begun C{waited}
        seconds ago (a whole one when it runs late); else C{waited} (it
        has taken at least that long so far).  Rounded up from the tenth
        (a timer's few milliseconds late add no second).
    """
    if eta is not None and math.isfinite(eta):
        seconds = eta
    elif typical is not None:
        seconds = typical - waited if typical > waited else typical
    else:
        seconds = waited
    return max(1, math.ceil(round(seconds, 1)))


def keepalive_line(model: str, standing: Standing) -> bytes:
    """
    @return: an SSE comment line (clients skip it: WHATWG HTML, server-sent
        events) saying where a request held for C{model} stands, e.g.
        C{b": waiting for model b: 2nd in the swap queue\\n\\n"}; the words
        on one line, at most L{MAX_WORDS} characters.
    """
    words = " ".join(standing.words.split())[:MAX_WORDS]
    if not words:
        return b": waiting for a replica to start\n\n"
    name = " ".join(model.split())[:MAX_WORDS]
    return f": waiting for model {name}: {words}\n\n".encode()


class ActivationQueues:
    """
    One router's requests waiting for activations, per model: when each
    began to wait, and how long the last L{KEPT} waits that ended with a
    ready replica took.
    """

    def __init__(self) -> None:
        self._since: dict[str, list[float]] = {}
        self._took: dict[str, deque[float]] = {}
        self._held: dict[str, list[tuple[Tenant, Callable[[], None]]]] = {}

    def hold(self, model: str, tenant: Tenant, evict: Callable[[], None]) -> None:
        """
        A request of C{tenant} waits for C{model}; C{evict} ends its wait
        when a request of a higher priority needs its place.
        """
        self._held.setdefault(model, []).append((tenant, evict))

    def release(self, model: str, evict: Callable[[], None]) -> None:
        """
        The request whose C{evict} it is no longer waits.
        """
        held = self._held.get(model, [])
        held[:] = [(t, e) for t, e in held if e != evict]
        if not held:
            self._held.pop(model, None)

    def make_room(self, model: str, tenant: Tenant) -> bool:
        """
        The queue of C{model} is full and a request of C{tenant} comes:
        end the wait of the newest of the lowest priority waiting, if it
        is lower than C{tenant}'s.

        @return: whether a place was made.
        """
        held = self._held.get(model)
        if not held:
            return False
        lowest = min(range(len(held)), key=lambda i: (held[i][0].rank, -i))
        if held[lowest][0].rank >= tenant.rank:
            return False
        _, evict = held.pop(lowest)
        evict()
        return True

    def length(self, model: str) -> int:
        """
        @return: requests waiting for C{model} now.
        """
        return len(self._since.get(model, ()))

    def waiting(self) -> dict[str, int]:
        """
        @return: requests waiting, per model that has any.
        """
        return {model: len(since) for model, since in self._since.items()}

    def oldest(self, model: str) -> float | None:
        """
        @return: the clock time the longest waiting request for C{model}
            began to wait, or L{None} for none.
        """
        since = self._since.get(model)
        return min(since) if since else None

    def join(self, model: str, now: float) -> None:
        """
        A request began to wait for C{model} at clock time C{now}.
        """
        self._since.setdefault(model, []).append(now)

    def leave(self, model: str, since: float, took: float | None) -> None:
        """
        A request that joined at C{since} stopped waiting.

        @param took: seconds until its replica was ready, or L{None} when it
            went unserved (timed out, cancelled).
        """
        queue = self._since.get(model, [])
        if since in queue:
            queue.remove(since)
        if not queue:
            self._since.pop(model, None)
        if took is not None:
            self._took.setdefault(model, deque(maxlen=KEPT)).append(took)

    def typical(self, model: str) -> float | None:
        """
        @return: the median seconds of C{model}'s recent activations, else
            of any model's (a first activation is likely as long as
            others), or L{None} when none was seen.
        """
        took = self._took.get(model)
        if took:
            return median(took)
        seen = [t for recent in self._took.values() for t in recent]
        return median(seen) if seen else None


class ActivationWait:
    """
    A wait begun by L{start} and ended, however it ends, by L{end}.

    @ivar timed_out: whether C{activation_timeout} passed (the wait was
        then cancelled).
    @ivar evicted: whether a request of a higher priority took its place
        in a full queue (the wait was then cancelled).
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        settings: RouterConfig,
        queues: ActivationQueues,
        activator: Activator,
        model: str,
        tenant: Tenant = ANONYMOUS,
    ) -> None:
        """
        @param queues: the router's activation queues (shared).
        @param tenant: whose request waits (its key's priority).
        """
        self._clock = clock
        self._settings = settings
        self._queues = queues
        self._activator = activator
        self._model = model
        self.timed_out = False
        self.evicted = False
        self._tenant = tenant
        self._ready: Deferred[None] | None = None
        self._since: float | None = None
        self._took: float | None = None
        self._timer: IDelayedCall | None = None
        self._keepalive: LoopingCall | None = None

    def standing(self) -> Standing:
        """
        @return: where the request stands (L{Activator.where}), its words
            L{Activator.why_not}'s when it has none; an empty L{Standing}
            if the activator failed to say.
        """
        try:
            standing = self._activator.where(self._model)
            if standing.words:
                return standing
            return Standing(self._activator.why_not(self._model), standing.eta_seconds)
        except Exception:
            self.log.failure("where model {model} stands", model=self._model)
            return Standing()

    def retry_after(self) -> int:
        """
        @return: seconds for the C{Retry-After} of this wait ending
            unserved now (L{retry_seconds}).
        """
        queues, model = self._queues, self._model
        oldest = queues.oldest(model)
        waited = self._clock.seconds() - oldest if oldest is not None else 0.0
        eta = self.standing().eta_seconds
        return retry_seconds(eta, queues.typical(model), max(0.0, waited))

    def start(self, keepalive: Callable[[bytes], None] | None) -> Deferred[None]:
        """
        @param keepalive: called every C{activation_keepalive} seconds while
            waiting with a comment line to write (L{keepalive_line}), or
            L{None}.
        @return: fires when a replica is ready; cancelled at the timeout.
        @raise APIError: 503 with C{Retry-After}, too many requests of the
            same priority or higher already wait for the model.
        """
        settings, queues, model = self._settings, self._queues, self._model
        if queues.length(model) >= settings.activation_queue and not (
            queues.make_room(model, self._tenant)
        ):
            raise activation_queue_full(model, self.retry_after())
        self._since = self._clock.seconds()
        queues.join(model, self._since)
        # The swap queue serves models by the priority they hold, unless
        # the router waits first come, first served; a batch line's rank
        # goes with it whatever the order (it must never make room).
        fifo = settings.waiting_order == "fifo" and not is_batch(self._tenant)
        rank = PRIORITIES["standard"] if fifo else self._tenant.rank
        ready = self._ready = self._activator.activate(model, rank)
        ready.addCallback(self._became_ready)
        queues.hold(model, self._tenant, self._evict)

        def time_out() -> None:
            self.timed_out = True
            ready.cancel()

        if settings.activation_timeout > 0:
            self._timer = self._clock.callLater(settings.activation_timeout, time_out)
        if keepalive is not None and settings.activation_keepalive > 0:
            self._keepalive = LoopingCall(
                lambda: keepalive(keepalive_line(model, self.standing()))
            )
            self._keepalive.clock = self._clock
            self._keepalive.start(settings.activation_keepalive, now=False)
        return ready

    def _evict(self) -> None:
        self.evicted = True
        if self._ready is not None:
            self._ready.cancel()

    def _became_ready(self, result: None) -> None:
        if self._since is not None:
            self._took = self._clock.seconds() - self._since
        return result

    def end(self) -> None:
        """
        Stop the timer and the keep-alive, and leave the queue.
        """
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        if self._keepalive is not None and self._keepalive.running:
            self._keepalive.stop()
        self._queues.release(self._model, self._evict)
        if self._since is not None:
            self._queues.leave(self._model, self._since, self._took)
            self._since = None
