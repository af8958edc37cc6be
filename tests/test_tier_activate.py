"""
L{llmgw.tier.activate}: a router of a tier's activations, forwarded to the
admin API (a fake one here, on a L{Clock}).
"""

from __future__ import annotations

import json
from typing import Any, cast

from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone, ResponseNeverReceived

from llmgw.router.interfaces import ActivationRefused, Standing
from llmgw.tier.activate import RETRY_AFTER, RemoteActivator
from llmgw.tier.admin_client import AdminClient


class _Body:
    """
    A response whose body is C{body}, delivered at once.
    """

    def __init__(self, code: int, body: bytes) -> None:
        self.code = code
        self.phrase = b"OK"
        self._body = body

    def deliverBody(self, protocol: Any) -> None:
        protocol.dataReceived(self._body)
        protocol.connectionLost(Failure(ResponseDone()))


class _Control:
    """
    The admin API: activations wait until the test ends them, as an Agent
    does (a cancel fails with L{ResponseNeverReceived}); C{GET}s answer
    C{where}.
    """

    def __init__(self) -> None:
        self.posts: list[Deferred[tuple[int, Any]]] = []
        self.bodies: list[object] = []
        self.where: dict[str, Any] = {"words": "", "eta_seconds": None}

    def post(self, path: str, body: object) -> Deferred[tuple[int, Any]]:
        def cancel(d: Deferred[tuple[int, Any]]) -> None:
            d.errback(ResponseNeverReceived([Failure(CancelledError())]))

        answer: Deferred[tuple[int, Any]] = Deferred(cancel)
        self.posts.append(answer)
        self.bodies.append(body)
        return answer

    def request(self, method: bytes, path: str, body: object = None) -> Deferred[Any]:
        return succeed(_Body(200, json.dumps(self.where).encode()))


def _activator(clock: Clock) -> tuple[RemoteActivator, _Control]:
    control = _Control()
    activator = RemoteActivator(
        clock, cast(AdminClient, control), lambda model: False, 30.0
    )
    activator.set_names({"chat": "chat"})
    return activator, control


class RemoteActivatorTests(SynchronousTestCase):
    def test_cancel_ends_the_wait(self) -> None:
        """
        A wait cancelled while its activation request is in flight ends
        with L{CancelledError} at once; nothing is asked again.
        """
        clock = Clock()
        activator, control = _activator(clock)
        waiting = activator.activate("chat")
        self.assertEqual(len(control.posts), 1)
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        clock.advance(5)
        self.assertEqual(len(control.posts), 1)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_priority_posted(self) -> None:
        """
        Each wait posts its request's priority with the router's wait, for
        the control plane's swap queue.
        """
        clock = Clock()
        activator, control = _activator(clock)
        waits = [activator.activate("chat", 0), activator.activate("chat")]
        self.assertEqual(
            control.bodies,
            [
                {"timeout": 30.0, "priority": 0, "waited": 0.0},
                {"timeout": 30.0, "priority": 1, "waited": 0.0},
            ],
        )
        for wait in waits:
            wait.cancel()
            self.failureResultOf(wait, CancelledError)

    def test_waited_posted_again(self) -> None:
        """
        Asked again after the control plane's 504, a wait says how long
        it has waited since it began, so that the plane counts from its
        arrival.
        """
        clock = Clock()
        activator, control = _activator(clock)
        waiting = activator.activate("chat", 2)
        clock.advance(30)
        control.posts[0].callback((504, {"error": {"message": "no room"}}))
        clock.advance(RETRY_AFTER)
        self.assertEqual(
            control.bodies[1],
            {"timeout": 30.0, "priority": 2, "waited": 30 + RETRY_AFTER},
        )
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)

    def test_where(self) -> None:
        """
        Where a wait stands is asked when it begins; its estimate counts
        down with the clock; once the wait ends, only why not is left.
        """
        clock = Clock()
        activator, control = _activator(clock)
        control.where = {"words": "waking replica r-3", "eta_seconds": 4.0}
        waiting = activator.activate("chat")
        clock.advance(1.5)
        self.assertEqual(activator.where("chat"), Standing("waking replica r-3", 2.5))
        control.posts[0].callback((200, {"ready": "chat"}))
        activator.set_names({"chat": "chat"})
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
        self.assertEqual(activator.where("chat"), Standing(""))

    def test_refused_ends_the_wait(self) -> None:
        """
        An answer that says the fleet's bound refused the request
        (C{"refused": true}) ends the wait with L{ActivationRefused}, for
        the router to answer as its own full queue; nothing is asked
        again.
        """
        clock = Clock()
        activator, control = _activator(clock)
        waiting = activator.activate("chat", 0)
        error = {"message": "too many", "code": "activation_queue_full"}
        control.posts[0].callback((429, {"error": error, "refused": True}))
        refused = self.failureResultOf(waiting, ActivationRefused).value
        assert isinstance(refused, ActivationRefused)
        self.assertEqual(refused.model, "chat")
        clock.advance(RETRY_AFTER * 5)
        self.assertEqual(len(control.posts), 1)

    def test_unknown_refusal_waits_on(self) -> None:
        """
        An answer but 200 whose C{refused} is not C{true} is asked again
        a second later, as every such answer was before the field: the
        wait goes on, its message the reason why not.
        """
        clock = Clock()
        activator, control = _activator(clock)
        waiting = activator.activate("chat", 0)
        error = {"message": "too many", "code": "activation_queue_full"}
        control.posts[0].callback((429, {"error": error, "refused": "yes"}))
        self.assertNoResult(waiting)
        self.assertEqual(activator.why_not("chat"), "too many")
        clock.advance(RETRY_AFTER)
        self.assertEqual(len(control.posts), 2)
        waiting.cancel()
        self.failureResultOf(waiting, CancelledError)
