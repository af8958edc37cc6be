"""
An exchange's waits before its first attempt (L{llmgw.router.api.exchange}):
for a replica of its model to start (the activation queue,
L{llmgw.router.routing.activation}), then for a turn in the overload room
(L{llmgw.router.routing.overload}).  Both are ordered by the request's tenant, its
key's priority and fair share (L{llmgw.router.routing.fairness}); a request let
go from the overload room has its estimate of tokens counted to its
tenant at once, so that a tenant of many waiting requests does not take
every turn before its first answer ends (L{Waits.served} corrects the
estimate).

L{Waits} owns what the waits keep (the activation in flight, the tokens
counted in advance); its exchange builds it with what it calls and never
reaches into it, so this module needs nothing of the exchange's.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import CancelledError, Deferred
from twisted.web.iweb import IRequest

from llmgw.router.api.services import Services
from llmgw.router.edge.site import client_gone
from llmgw.router.errors import (
    activation_queue_full,
    activation_timeout,
    model_unplaceable,
)
from llmgw.router.interfaces import (
    ActivationRefused,
    Activator,
    NeverPlaceable,
    Tenant,
)
from llmgw.router.routing.activation import ActivationWait
from llmgw.router.telemetry.tracing import NoTrace, error_type
from llmgw.router.upstream.deadlines import Deadlines


class Waits:
    """
    One request's waits before its first attempt, and the tokens counted
    to its tenant when the overload room let it go.

    @param services: what every exchange of the router shares (the clock,
        the settings, the activation queues, the overload room).
    @param request: the client's request, to tell a client that left.
    @param deadlines: the request's deadlines, to tell one that passed
        (the exchange calls L{cancel} when one does).
    @param model: the model the request is for.
    @param tenant: whose request it is (its key's priority and weight).
    @param trace: the request's spans.
    """

    __slots__ = (
        "_services",
        "_request",
        "_deadlines",
        "_model",
        "_tenant",
        "_trace",
        "_activating",
        "_charged",
    )

    def __init__(
        self,
        services: Services,
        request: IRequest,
        deadlines: Deadlines,
        model: str,
        tenant: Tenant,
        trace: NoTrace,
    ) -> None:
        self._services = services
        self._request = request
        self._deadlines = deadlines
        self._model = model
        self._tenant = tenant
        self._trace = trace
        # The activation awaited now, for cancel().
        self._activating: Deferred[None] | None = None
        # Tokens counted to the tenant when the overload room let the
        # request go, until served() puts the real count in their place.
        self._charged = 0

    def cancel(self) -> None:
        """
        Give up the activation awaited now, if any (a deadline passed):
        L{activate} then raises the deadline's error.
        """
        if self._activating is not None:
            self._activating.cancel()

    async def turn(self, reserve: int) -> None:
        """
        Wait in the overload room, when the model's replicas are all behind.

        @param reserve: the request's estimate of tokens (prompt and
            C{max_tokens}), counted to its tenant when it goes on.
        @raise APIError: a 429 with C{Retry-After}: the room is full, the wait
            passed C{overload_wait}, or a request of a higher priority took
            this one's place.
        """
        overload = self._services.overload
        if overload is None:
            return
        waiting = overload.admit(self._model, self._tenant)
        if waiting is None:
            return
        await self._trace.step("overload", waiting, self._error_type)
        self._charged = reserve
        overload.shares.served(self._tenant, reserve)

    def _error_type(self, error: BaseException | None) -> str | None:
        # The overload wait's span's: a client that left, a deadline, or
        # the refusal's code.
        gone, expired = client_gone(self._request), bool(self._deadlines.expired)
        return error_type(error, gone, expired)

    def served(self, tokens: int) -> None:
        """
        The request ended having been served C{tokens} (prompt and
        completion): counted to its tenant's share where requests wait
        (L{llmgw.router.routing.fairness}), less what was counted when it went on.
        """
        overload = self._services.overload
        if overload is not None and (tokens or self._charged):
            overload.shares.served(self._tenant, tokens - self._charged)
            self._charged = 0

    async def activate(
        self, activator: Activator, keepalive: Callable[[bytes], None] | None
    ) -> None:
        """
        Wait for the control plane to make a replica of the model ready, for
        at most C{activation_timeout}; a waiting stream gets an SSE comment
        line every C{activation_keepalive} saying where it stands.

        @param activator: the control plane's side of activations.
        @param keepalive: writes a comment line to the waiting stream, or
            L{None} for a request that does not stream.
        @raise APIError: 503 with C{Retry-After} from the queue when the wait
            is over, too many requests of the same priority or higher already
            wait for this model, or one of a higher priority took this one's
            place, here or, by the control plane's count across the fleet
            (L{ActivationRefused}), on any router; the deadline's error when
            one passed.
        """
        services = self._services
        settings = services.settings
        model = self._model
        wait = ActivationWait(
            services.clock,
            settings,
            services.activating,
            activator,
            model,
            self._tenant,
        )
        self._activating = wait.start(keepalive)
        try:
            await self._activating
        except NeverPlaceable as e:
            raise model_unplaceable(model, e.why) from None
        except ActivationRefused:
            # The fleet's bound, the control plane's choice: answered as
            # this router's own full queue.
            raise activation_queue_full(model, wait.retry_after()) from None
        except CancelledError:
            if client_gone(self._request):
                raise
            if self._deadlines.expired:
                raise self._deadlines.error() from None
            if wait.timed_out:
                why = activator.why_not(model)
                after = wait.retry_after()
                raise activation_timeout(
                    model, settings.activation_timeout, why, after
                ) from None
            if wait.evicted:
                raise activation_queue_full(model, wait.retry_after()) from None
            raise
        finally:
            self._activating = None
            wait.end()
