"""
An exchange's waits before its first attempt (L{llmgw.router.api.exchange}):
for a replica of its model to start (the activation queue,
L{llmgw.router.routing.activation}), then for a turn in the overload room
(L{llmgw.router.routing.overload}).  Both are ordered by the request's tenant, its
key's priority and fair share (L{llmgw.router.routing.fairness}); a request let
go from the overload room has its estimate of tokens counted to its
tenant at once, so that a tenant of many waiting requests does not take
every turn before its first answer ends (L{Exchange.served} corrects the
estimate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twisted.internet.defer import CancelledError

from llmgw.router.edge.site import client_gone
from llmgw.router.errors import activation_queue_full, activation_timeout
from llmgw.router.interfaces import Activator
from llmgw.router.routing.activation import ActivationWait

if TYPE_CHECKING:
    from llmgw.router.api.exchange import Exchange


async def wait_turn(exchange: Exchange) -> None:
    """
    Wait in the overload room, when the model's replicas are all behind.

    @raise APIError: a 429 with C{Retry-After}: the room is full, the wait
        passed C{overload_wait}, or a request of a higher priority took
        this one's place.
    """
    overload = exchange.services.overload
    if overload is None:
        return
    waiting = overload.admit(exchange.model, exchange.tenant)
    if waiting is None:
        return
    await exchange.trace.step("overload", waiting)
    exchange.charged = exchange.prepared.reserve
    overload.shares.served(exchange.tenant, exchange.charged)


async def activate(exchange: Exchange, activator: Activator) -> None:
    """
    Wait for the control plane to make a replica of the model ready, for
    at most C{activation_timeout}; a waiting stream gets an SSE comment
    line every C{activation_keepalive} saying where it stands.

    @raise APIError: 503 with C{Retry-After} from the queue when the wait
        is over, too many requests of the same priority or higher already
        wait for this model, or one of a higher priority took this one's
        place.
    """
    services = exchange.services
    settings = services.settings
    model = exchange.model
    wait = ActivationWait(
        services.clock,
        settings,
        services.activating,
        activator,
        model,
        exchange.tenant,
    )
    exchange.waiting = wait.start(
        exchange.keepalive if exchange.prepared.stream else None
    )
    try:
        await exchange.waiting
    except CancelledError:
        if client_gone(exchange.request):
            raise
        if exchange.deadlines.expired:
            raise exchange.deadlines.error() from None
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
        exchange.waiting = None
        wait.end()
