"""
One request's wait for a replica of its model to start: its place in the
model's activation queue, the timer of C{activation_timeout}, and a
stream's keep-alive comments meanwhile.  The exchange
(L{llmgw.router.exchange}) awaits it and says what its end means.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall

from llmgw.router.errors import activation_queue_full
from llmgw.router.interfaces import Activator
from llmgw.router.settings import RouterConfig


class ActivationWait:
    """
    A wait begun by L{start} and ended, however it ends, by L{end}.

    @ivar timed_out: whether C{activation_timeout} passed (the wait was
        then cancelled).
    """

    def __init__(
        self,
        clock: IReactorTime,
        settings: RouterConfig,
        activating: dict[str, int],
        activator: Activator,
        model: str,
    ) -> None:
        """
        @param activating: requests waiting, per model (shared, mutable).
        """
        self._clock = clock
        self._settings = settings
        self._activating = activating
        self._activator = activator
        self._model = model
        self.timed_out = False
        self._timer: IDelayedCall | None = None
        self._keepalive: LoopingCall | None = None

    def start(self, keepalive: Callable[[], None] | None) -> Deferred[None]:
        """
        @param keepalive: called every C{activation_keepalive} seconds while
            waiting (a stream's comment line), or L{None}.
        @return: fires when a replica is ready; cancelled at the timeout.
        @raise APIError: 503, too many requests already wait for the model.
        """
        settings, activating, model = self._settings, self._activating, self._model
        waiting = activating.get(model, 0)
        if waiting >= settings.activation_queue:
            raise activation_queue_full(model)
        activating[model] = waiting + 1
        ready = self._activator.activate(model)

        def time_out() -> None:
            self.timed_out = True
            ready.cancel()

        if settings.activation_timeout > 0:
            self._timer = self._clock.callLater(settings.activation_timeout, time_out)
        if keepalive is not None and settings.activation_keepalive > 0:
            self._keepalive = LoopingCall(keepalive)
            self._keepalive.clock = self._clock
            self._keepalive.start(settings.activation_keepalive, now=False)
        return ready

    def end(self) -> None:
        """
        Stop the timer and the keep-alive, and leave the queue.
        """
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        if self._keepalive is not None and self._keepalive.running:
            self._keepalive.stop()
        activating, model = self._activating, self._model
        left = activating.get(model, 1) - 1
        if left:
            activating[model] = left
        else:
            activating.pop(model, None)
