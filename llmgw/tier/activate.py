"""
Scale from zero through the control plane
(L{llmgw.router.interfaces.Activator}): the catalog's names as the watch
last gave them; an activation is the admin API's
C{POST /api/v1/models/NAME/activate}, repeated until the router's own
activation timeout cancels the wait; where a held request stands is the
same route's C{GET}, asked when a wait begins and every
L{TOUCH_INTERVAL} while it lasts; use is reported in batches.

The server bounds the requests held for a model across the fleet and
refuses the lowest priority's newest past it, whichever router holds it
(L{llmgw.admin.watch.WatchRoutes.activate}): an answer with C{"refused":
true} ends the wait with L{ActivationRefused}, which the router answers as
its own full activation queue.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import readBody

from llmgw.router.interfaces import ActivationRefused, NeverPlaceable, Standing
from llmgw.tier.admin_client import AdminClient

TOUCH_INTERVAL = 2.0
"""
Seconds between reports of the models requests used (the control plane's
idle timeouts count from the last one), and between asks of where the
waits in flight stand.
"""

RETRY_AFTER = 1.0
"""
Seconds between activation requests for one wait.
"""


def _cancelled(error: Exception) -> bool:
    """
    @return: whether C{error} is a request to the admin API that failed
        because it was cancelled (C{ResponseNeverReceived} and
        C{ResponseFailed} carry the cause in C{reasons}).
    """
    reasons = getattr(error, "reasons", None) or []
    return any(
        isinstance(reason, Failure) and reason.check(CancelledError)
        for reason in reasons
    )


class RemoteActivator(Service):
    """
    @param serves: whether this router's balancer has an endpoint for a
        model (the watch brought it).
    @param wait: seconds each activation request asks the control plane
        to wait.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        control: AdminClient,
        serves: Callable[[str], bool],
        wait: float,
    ) -> None:
        self.clock = clock
        self.control = control
        self.serves = serves
        self.wait = max(1.0, min(wait, 600.0))
        self._names: dict[str, str] = {}
        self._why: dict[str, str] = {}
        self._touched: set[str] = set()
        self._ready_waiters: dict[str, list[Deferred[None]]] = {}
        # Waits in flight per model, and where they stood when last asked
        # (with the clock time of the answer).
        self._waits: dict[str, int] = {}
        self._standing: dict[str, tuple[Standing, float]] = {}
        self._asking: set[str] = set()
        self._flush = LoopingCall(self._report)
        self._flush.clock = clock

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._flush.start(TOUCH_INTERVAL, now=False)

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._flush.running:
            self._flush.stop()

    def set_names(self, names: dict[str, str]) -> None:
        """
        The catalog's names from the watch; also a moment the endpoint
        list changed, when waits for a served model end.
        """
        self._names = dict(names)
        for model in [m for m in self._ready_waiters if self.serves(m)]:
            for waiter in self._ready_waiters.pop(model):
                waiter.callback(None)

    def resolve(self, name: str) -> str | None:
        return self._names.get(name)

    def names(self) -> list[str]:
        return sorted(self._names)

    def touch(self, name: str) -> None:
        self._touched.add(name)

    def why_not(self, name: str) -> str:
        model = self._names.get(name)
        return self._why.get(model, "") if model is not None else ""

    def where(self, name: str) -> Standing:
        """
        @return: where a request held for C{name} stood when the control
            plane last said (its C{eta_seconds} less the time since), or
            only why not (L{why_not}) before it said.
        """
        model = self._names.get(name, name)
        known = self._standing.get(model)
        if known is None:
            return Standing(self._why.get(model, ""))
        standing, at = known
        if standing.eta_seconds is None:
            return standing
        left = max(0.0, standing.eta_seconds - (self.clock.seconds() - at))
        return Standing(standing.words, left)

    def activate(self, name: str, priority: int = 1) -> Deferred[None]:
        """
        @param priority: the waiting request's priority number, which the
            control plane's swap queue orders by.
        @return: fires once the control plane answered that a replica is
            ready and the watch brought its endpoint here, or fails with
            L{ActivationRefused} when it answered that the fleet's bound
            refused this request; cancel it to stop waiting.
        """
        model = self._names.get(name, name)
        self._touched.add(model)
        self._waits[model] = self._waits.get(model, 0) + 1
        self._ask_where(model)

        def ended(result: object) -> object:
            left = self._waits.get(model, 1) - 1
            if left:
                self._waits[model] = left
            else:
                self._waits.pop(model, None)
                self._standing.pop(model, None)
            return result

        return ensureDeferred(self._activate(model, priority)).addBoth(ended)

    def _ask_where(self, model: str) -> None:
        if model in self._asking:
            return
        self._asking.add(model)
        asked = ensureDeferred(self._fetch_where(model))

        def failed(failure: object) -> None:
            self.log.debug(
                "cannot ask where {model} stands: {failure}",
                model=model,
                failure=failure,
            )

        asked.addErrback(failed).addBoth(lambda _: self._asking.discard(model))

    async def _fetch_where(self, model: str) -> None:
        path = f"/api/v1/models/{quote(model, safe='')}/activate"
        response = await self.control.request(b"GET", path)
        raw = await readBody(response)
        if response.code != 200 or model not in self._waits:
            return
        value: Any = json.loads(raw)
        words, eta = value.get("words"), value.get("eta_seconds")
        if not isinstance(words, str):
            return
        if not isinstance(eta, (int, float)) or isinstance(eta, bool):
            eta = None
        self._standing[model] = (Standing(words[:200], eta), self.clock.seconds())

    async def _activate(self, model: str, priority: int) -> None:
        began = self.clock.seconds()
        while True:
            # Each post says how long the request has waited already, so
            # that the swap queue's order and swap_max_wait count from its
            # arrival, not from this post.
            waited = round(self.clock.seconds() - began, 3)
            try:
                code, value = await self.control.post(
                    f"/api/v1/models/{quote(model, safe='')}/activate",
                    {"timeout": self.wait, "priority": priority, "waited": waited},
                )
            except CancelledError:
                raise
            except Exception as e:
                if _cancelled(e):
                    # The router's wait was cancelled (its activation
                    # timeout, the client gone): the agent wraps that.
                    raise CancelledError() from None
                code, value = 0, None
                self._why[model] = "the control plane is not reachable"
                self.log.warn(
                    "cannot forward the activation of {model}: {error}",
                    model=model,
                    error=e,
                )
            if code == 200:
                break
            if isinstance(value, dict) and value.get("refused") is True:
                raise ActivationRefused(model)
            if isinstance(value, dict) and isinstance(value.get("unplaceable"), str):
                raise NeverPlaceable(model, value["unplaceable"][:500])
            if isinstance(value, dict) and isinstance(value.get("error"), dict):
                self._why[model] = str(value["error"].get("message", ""))[:200]
            await deferLater(self.clock, RETRY_AFTER)
        self._why.pop(model, None)
        if not self.serves(model):
            waiter: Deferred[None] = Deferred(
                lambda d: (
                    self._ready_waiters.get(model, []).remove(d)
                    if d in self._ready_waiters.get(model, [])
                    else None
                )
            )
            self._ready_waiters.setdefault(model, []).append(waiter)
            await waiter

    def _report(self) -> Deferred[None] | None:
        for model in list(self._waits):
            self._ask_where(model)
        touched, self._touched = self._touched, set()
        if not touched:
            return None
        result = ensureDeferred(
            self.control.post("/api/v1/touch", {"names": sorted(touched)})
        )

        def failed(failure: object) -> None:
            self.log.debug("cannot report use: {failure}", failure=failure)

        return result.addCallbacks(lambda _: None, failed)
