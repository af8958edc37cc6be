"""
What a router tier follows (issue 12 item 2): the endpoint list, with the
engines' secrets, and the catalog's names, as one versioned state pushed
to every watcher of C{GET /api/v1/watch} on the admin API.

The stream is newline-delimited JSON: one line per state, the whole state
each time (C{{"version": int, "endpoints": [...], "names": {name: model},
"keys": int, "below_min": [...]}}, C{keys} counting the changes of API
keys: a router reads the keys from the shared store again when it moves;
C{below_min} the catalog models with fewer ready replicas than their
C{min_replicas}, C{{"model", "ready", "min_replicas"}} each, which every
router's C{/readyz} lists as unavailable; a server before it sent none),
so that a watcher that reconnects starts from the full state, and an empty
line every L{KEEPALIVE} seconds, so that a watcher can tell a silent link
from a dead one.  Engine secrets travel only on this stream, which the
admin listener serves (behind an admin key off loopback).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.web.iweb import IRequest

from llmgw.router.interfaces import Endpoint, Shortfall

KEEPALIVE = 1.0
"""
Seconds between empty lines to each watcher; also how often the catalog's
names are compared with the last state pushed (a change the admin API did
not announce is pushed within this time).
"""


def endpoint_json(endpoint: Endpoint) -> dict[str, Any]:
    """
    @return: C{endpoint} as JSON, its secret included (for the watch only).
    """
    return {
        "id": endpoint.id,
        "url": endpoint.url,
        "models": list(endpoint.models),
        "weight": endpoint.weight,
        "api_key": endpoint.api_key,
        "messages": endpoint.messages,
        "adapters": [list(a) for a in endpoint.adapters],
        "max_loras": endpoint.max_loras,
    }


def endpoint_from_json(value: Mapping[str, Any]) -> Endpoint:
    """
    @return: the endpoint L{endpoint_json} wrote.
    @raise KeyError, TypeError, ValueError: not such an object.
    """
    return Endpoint(
        str(value["id"]),
        str(value["url"]),
        tuple(str(m) for m in value["models"]),
        float(value.get("weight", 1.0)),
        api_key=str(value.get("api_key", "")),
        messages=value.get("messages") is True,
        adapters=tuple((str(n), str(p)) for n, p in value.get("adapters", ())),
        max_loras=int(value.get("max_loras", 0)),
    )


def shortfall_json(shortfall: Shortfall) -> dict[str, Any]:
    """
    @return: C{shortfall} as the watch carries it.
    """
    return {
        "model": shortfall.model,
        "ready": shortfall.ready,
        "min_replicas": shortfall.min_replicas,
    }


def shortfall_from_json(value: Mapping[str, Any]) -> Shortfall:
    """
    @return: the shortfall L{shortfall_json} wrote.
    @raise KeyError, TypeError, ValueError: not such an object.
    """
    return Shortfall(
        str(value["model"]), int(value["ready"]), int(value["min_replicas"])
    )


class Watch(Service):
    """
    The state routers follow, and its watchers.

    @param clock: the reactor.
    @param names: the catalog's names now, C{{name or alias: model}};
        first read when the service starts.
    @ivar version: bumped by every change; the first state is version 1.
    """

    log = Logger()

    def __init__(
        self, clock: IReactorTime, names: Callable[[], Mapping[str, str]]
    ) -> None:
        self.clock = clock
        self._names_now = names
        self.version = 1
        self.endpoints: tuple[Endpoint, ...] = ()
        self.names: dict[str, str] = {}
        self.keys = 0
        self.below_min: tuple[Shortfall, ...] = ()
        self._watchers: list[IRequest] = []
        self._tick = LoopingCall(self._keepalive)
        self._tick.clock = clock

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self.changed()
        self._tick.start(KEEPALIVE, now=False)

    def stopService(self) -> None:
        super().stopService()  # type: ignore[no-untyped-call]
        if self._tick.running:
            self._tick.stop()
        watchers, self._watchers = self._watchers, []
        for request in watchers:
            request.finish()

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """
        The control plane published a new endpoint list: push it.
        """
        endpoints = tuple(endpoints)
        if endpoints != self.endpoints:
            self.endpoints = endpoints
            self._push()

    def set_shortfalls(self, shortfalls: Sequence[Shortfall]) -> None:
        """
        The control plane published the models below their
        C{min_replicas}: push them.
        """
        shortfalls = tuple(shortfalls)
        if shortfalls != self.below_min:
            self.below_min = shortfalls
            self._push()

    def changed(self) -> None:
        """
        The catalog may have changed (a model added or removed): push its
        names if they did.
        """
        names = dict(self._names_now())
        if names != self.names:
            self.names = names
            self._push()

    def keys_changed(self) -> None:
        """
        An API key was made or revoked (and the store has it): push.
        """
        self.keys += 1
        self._push()

    def serves(self, model: str) -> bool:
        """
        @return: whether a published endpoint serves C{model}.
        """
        return any(model in e.models for e in self.endpoints)

    def state(self) -> bytes:
        """
        @return: the state as one line of JSON, with its newline.
        """
        value = {
            "version": self.version,
            "endpoints": [endpoint_json(e) for e in self.endpoints],
            "names": self.names,
            "keys": self.keys,
            "below_min": [shortfall_json(s) for s in self.below_min],
        }
        return json.dumps(value, separators=(",", ":")).encode("utf-8") + b"\n"

    def watch(self, request: IRequest) -> Deferred[None]:
        """
        Stream the state to C{request} now and after each change.

        @return: never fires; cancel it when the watcher goes.
        """
        request.setHeader(b"content-type", b"application/x-ndjson")
        request.setHeader(b"cache-control", b"no-store")
        request.write(self.state())
        self._watchers.append(request)
        self.log.info("a router watches (version {version})", version=self.version)

        def gone(_: object) -> None:
            if request in self._watchers:
                self._watchers.remove(request)

        return Deferred(gone)

    def _push(self) -> None:
        self.version += 1
        line = self.state()
        for request in list(self._watchers):
            request.write(line)

    def _keepalive(self) -> None:
        self.changed()
        for request in list(self._watchers):
            request.write(b"\n")
