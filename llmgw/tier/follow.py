"""
Following the control plane: the admin API's watch (L{llmgw.tier.watch})
read as a stream, each state handed on at once; a dropped or silent
stream is opened again after a short back-off, and its first line is the
full state again.

With several control planes (a leader and its standbys), a standby
answers the watch with 503 naming the leader: the follower goes on to
the next URL at once (the leader's host first), and backs off only once
every URL has failed in a row.  Meanwhile the router keeps the endpoints
it last heard of; the leader's first line replaces them whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import readBody
from twisted.web.iweb import IResponse

from llmgw.router.interfaces import Endpoint, Shortfall
from llmgw.tier.admin_client import AdminClient
from llmgw.tier.watch import KEEPALIVE, endpoint_from_json, shortfall_from_json

NEXT_URL_AFTER = 0.05
"""
Seconds before the next control plane is tried after one refused or
failed, while some in the round are untried.
"""

SILENT_AFTER = 10 * KEEPALIVE
"""
Seconds without a byte (the server sends an empty line every KEEPALIVE)
after which the stream counts as dead and is opened again.
"""

MAX_LINE = 64 * 1024 * 1024
"""
Bytes of one state line at most (about 100,000 endpoints).
"""


class _Lines(Protocol):
    def __init__(self, line: Callable[[bytes], None], ended: Deferred[None]) -> None:
        self._line = line
        self._ended = ended
        self._buffer = b""

    def dataReceived(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > MAX_LINE:
            assert self.transport is not None
            self.transport.loseConnection()
            return
        for line in lines:
            self._line(line)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self._ended.callback(None)


class Follower(Service):
    """
    @param apply: called with each state's endpoints, names (C{{name or
        alias: model}}) and keys counter (L{llmgw.tier.watch}).
    @param short: called with each state's models below their
        C{min_replicas}, before C{apply}.
    @ivar version: the last state's version, 0 before the first.
    @ivar first: fires once the first state is applied.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        control: AdminClient,
        apply: Callable[[list[Endpoint], dict[str, str], int], None],
        short: Callable[[list[Shortfall]], None] = lambda shortfalls: None,
    ) -> None:
        self.clock = clock
        self.control = control
        self.apply = apply
        self.short = short
        self.version = 0
        self.first: Deferred[None] = Deferred()
        self._backoff = 0.2
        self._failures = 0
        self._pending: Deferred[Any] | None = None
        self._retry: IDelayedCall | None = None
        self._watchdog: IDelayedCall | None = None
        self._transport: Any = None

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._open()

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        if self._pending is not None:
            self._pending.cancel()
        if self._transport is not None:
            self._transport.stopProducing()
        self._stop_watchdog()

    def _open(self) -> None:
        self._retry = None
        if not self.running:
            return
        pending = self._pending = self.control.request(b"GET", "/api/v1/watch")
        pending.addCallbacks(self._answered, self._failed)

    def _answered(self, response: IResponse) -> Deferred[None] | None:
        self._pending = None
        if response.code != 200:
            return readBody(response).addBoth(self._refused, response.code)
        ended: Deferred[None] = Deferred()
        ended.addCallback(self._ended)
        protocol = _Lines(self._line, ended)
        response.deliverBody(protocol)
        self._transport = protocol.transport
        self._feed()
        return None

    def _refused(self, body: object, code: int) -> None:
        """
        The watch answered C{code}, not 200: a standby's 503 names the
        leader (C{{"error": {"message", "code": "standby", "leader"}}}).
        """
        leader = message = ""
        if isinstance(body, bytes):
            try:
                error = json.loads(body)["error"]
                leader = str(error.get("leader", ""))
                message = str(error.get("message", ""))[:500]
            except (ValueError, KeyError, TypeError, AttributeError):
                pass
        self.log.warn(
            "the control plane at {url} refused the watch: HTTP {code}{why}",
            url=self.control.url,
            code=code,
            why=f" (a standby; the leader is {leader})"
            if leader
            else (f": {message}" if message and code != 503 else ""),
        )
        self._again(leader)

    def _failed(self, failure: Failure) -> None:
        self._pending = None
        if self.running:
            self.log.warn(
                "cannot watch the control plane at {url}: {error}",
                url=self.control.url,
                error=failure.getErrorMessage(),
            )
            self._again()

    def _ended(self, _: object) -> None:
        self._transport = None
        self._stop_watchdog()
        if self.running:
            self.log.warn("the control plane's watch ended; opening it again")
            self._again()

    def _again(self, leader: str = "") -> None:
        """
        Open the watch again: on the next control plane soon while some
        are untried in this round of failures, else after the back-off
        (0.2 s doubling to 5 s), on the next one too.
        """
        if not self.running:
            return
        self._failures += 1
        if len(self.control.urls) > 1:
            self.control.advance(leader)
        if self._failures % len(self.control.urls):
            self._retry = self.clock.callLater(NEXT_URL_AFTER, self._open)
            return
        self._retry = self.clock.callLater(self._backoff, self._open)
        self._backoff = min(self._backoff * 2, 5.0)

    def _feed(self) -> None:
        self._stop_watchdog()
        self._watchdog = self.clock.callLater(SILENT_AFTER, self._silent)

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None and self._watchdog.active():
            self._watchdog.cancel()
        self._watchdog = None

    def _silent(self) -> None:
        self._watchdog = None
        self.log.warn("the control plane's watch is silent; opening it again")
        if self._transport is not None:
            self._transport.stopProducing()

    def _line(self, line: bytes) -> None:
        self._feed()
        if not line.strip():
            return
        try:
            value = json.loads(line)
            endpoints = [endpoint_from_json(e) for e in value["endpoints"]]
            names = {str(k): str(v) for k, v in value["names"].items()}
            version = int(value["version"])
            keys = int(value.get("keys", 0))
            below_min = [shortfall_from_json(s) for s in value.get("below_min", [])]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            self.log.warn("a bad line in the control plane's watch: {error}", error=e)
            return
        self._backoff = 0.2
        self._failures = 0
        self.version = version
        self.short(below_min)
        self.apply(endpoints, names, keys)
        if not self.first.called:
            self.first.callback(None)
        self.log.info(
            "following the control plane: version {version}, {count} endpoints,"
            " {names} model names",
            version=version,
            count=len(endpoints),
            names=len(names),
        )
