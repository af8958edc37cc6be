"""
An exchange's waits (L{llmgw.router.api.waiting.Waits}): for an activation and
for a turn in the overload room, and the tokens counted to a tenant on the
way.
"""

from __future__ import annotations

import json
from typing import cast

from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest

from llmgw.router.api.exchange import Exchange, Services
from llmgw.router.api.prepare import prepare
from llmgw.router.api.waiting import Waits
from llmgw.router.errors import APIError
from llmgw.router.interfaces import ActivationRefused, Standing
from llmgw.router.routing.activation import ActivationQueues
from llmgw.router.routing.balancer import Balancer
from llmgw.router.routing.fairness import FairShare, Tenant
from llmgw.router.routing.overload import Overload
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import RouterMetrics
from llmgw.router.telemetry.tracing import NO_TRACE
from llmgw.router.upstream.deadlines import Deadlines
from tests.exchange_fakes import FakeAgent, FakeRequest
from tests.test_activation import _Activator

CHAT = b"/v1/chat/completions"
TENANT = Tenant("team", 1, 1.0)


class _CatalogActivator(_Activator):
    """
    An activator whose catalog holds every name, none of them running.
    """

    def resolve(self, name: str) -> str | None:
        return name

    def names(self) -> list[str]:
        return []

    def touch(self, name: str) -> None:
        pass


class WaitsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.busy = True
        self.shares = FairShare(self.clock)
        self.room = Overload(
            self.clock,
            lambda m: self.busy,
            lambda m: 1,
            30,
            2,
            0.25,
            1.0,
            shares=self.shares,
        )
        self.queues = ActivationQueues()
        self.request = FakeRequest()
        self.addCleanup(lambda: self.assertEqual(self.clock.getDelayedCalls(), []))

    def services(self, settings: RouterConfig) -> Services:
        return Services(
            clock=self.clock,
            settings=settings,
            balancer=Balancer(self.clock, 10.0),
            upstream=FakeAgent(),
            metrics=RouterMetrics(CollectorRegistry()),
            activator=None,
            activating=self.queues,
            log=Logger(),
            overload=self.room,
        )

    def waits(self, settings: RouterConfig) -> tuple[Waits, Deadlines]:
        deadlines = Deadlines(self.clock, lambda: None, 0, 0, 0, 0)
        request = cast(IRequest, self.request)
        services = self.services(settings)
        waits = Waits(services, request, deadlines, "m", TENANT, NO_TRACE)
        return waits, deadlines

    def test_turn_counts_the_estimate_until_served(self) -> None:
        """
        A request let go from the overload room has its estimate counted to
        its tenant at once; its end puts the tokens it was served in the
        estimate's place.
        """
        waits, _ = self.waits(RouterConfig())
        turn = Deferred.fromCoroutine(waits.turn(100))
        self.assertNoResult(turn)
        self.assertEqual(self.shares.share(TENANT), 0)
        self.busy = False
        self.clock.advance(0.25)
        self.successResultOf(turn)
        self.assertEqual(self.shares.share(TENANT), 100)
        waits.served(30)
        self.assertEqual(self.shares.share(TENANT), 30)
        waits.served(5)
        self.assertEqual(self.shares.share(TENANT), 35)

    def test_no_wait_counts_only_what_was_served(self) -> None:
        """
        A request that never waited counts nothing in advance: its end
        counts what it was served.
        """
        self.busy = False
        waits, _ = self.waits(RouterConfig())
        self.successResultOf(Deferred.fromCoroutine(waits.turn(100)))
        self.assertEqual(self.shares.share(TENANT), 0)
        waits.served(30)
        self.assertEqual(self.shares.share(TENANT), 30)

    def test_activation_timeout(self) -> None:
        """
        An activation not done within C{activation_timeout} ends the wait
        with a 503 and C{Retry-After}; the request leaves the queue.
        """
        waits, _ = self.waits(RouterConfig(activation_timeout=5))
        activator = _CatalogActivator()
        done = Deferred.fromCoroutine(waits.activate(activator, None))
        self.assertEqual(self.queues.waiting(), {"m": 1})
        self.clock.advance(5)
        error = self.failureResultOf(done, APIError).value
        assert isinstance(error, APIError)
        self.assertEqual((error.status, error.retry_after), (503, 5))
        self.assertEqual(self.queues.waiting(), {})

    def test_refused_by_the_fleet(self) -> None:
        """
        An activation the control plane refuses for the fleet's bound
        (L{ActivationRefused}) ends the wait as this router's own full
        queue does: 503 C{activation_queue_full}, its message, and a
        C{Retry-After} from the queue; the request leaves the queue.
        """
        waits, _ = self.waits(RouterConfig(activation_timeout=30))
        activator = _CatalogActivator()
        activator.standing = Standing("starting", 7.0)
        done = Deferred.fromCoroutine(waits.activate(activator, None))
        self.assertEqual(self.queues.waiting(), {"m": 1})
        self.clock.advance(2)
        activator.asked[0].errback(ActivationRefused("m"))
        error = self.failureResultOf(done, APIError).value
        assert isinstance(error, APIError)
        self.assertEqual(
            (error.status, error.code, error.retry_after),
            (503, "activation_queue_full", 7),
        )
        self.assertEqual(
            error.message,
            "Too many requests are waiting for model 'm' to start; try again in 7s.",
        )
        self.assertEqual(self.queues.waiting(), {})

    def test_cancel_gives_up_the_activation(self) -> None:
        """
        L{Waits.cancel} ends the activation awaited; once it is over,
        L{Waits.cancel} does nothing.
        """
        waits, _ = self.waits(RouterConfig(activation_timeout=0))
        activator = _CatalogActivator()
        done = Deferred.fromCoroutine(waits.activate(activator, None))
        waits.cancel()
        self.failureResultOf(done)
        self.assertEqual(self.queues.waiting(), {})
        waits.cancel()


class ExchangeWaitsTests(SynchronousTestCase):
    def test_deadline_during_activation(self) -> None:
        """
        The request's total deadline passing while it waits for an
        activation ends it with the deadline's 504, not the activation's
        503, and the request leaves the activation queue.
        """
        clock = Clock()
        queues = ActivationQueues()
        settings = RouterConfig(total_timeout=5, activation_timeout=0)
        services = Services(
            clock=clock,
            settings=settings,
            balancer=Balancer(clock, 10.0),
            upstream=FakeAgent(),
            metrics=RouterMetrics(CollectorRegistry()),
            activator=_CatalogActivator(),
            activating=queues,
            log=Logger(),
        )
        body = json.dumps({"model": "m", "messages": [{"role": "user"}]}).encode()
        prepared = prepare(body, CHAT, lambda m: True, lambda m: m)
        request = cast(IRequest, FakeRequest())
        exchange = Exchange(services, request, CHAT, prepared, b"id", b"uid")
        done = Deferred.fromCoroutine(exchange.run())
        self.assertEqual(queues.waiting(), {"m": 1})
        clock.advance(5)
        error = self.failureResultOf(done, APIError).value
        assert isinstance(error, APIError)
        self.assertEqual(error.status, 504)
        self.assertEqual(queues.waiting(), {})
        exchange.finish()
        self.assertEqual(clock.getDelayedCalls(), [])
