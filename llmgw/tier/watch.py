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

A router is handed only what its protocol version knows
(L{llmgw.wire.versions.FEATURES}): to one older than
L{versions.ADAPTERS} the state names no LoRA adapter (not in C{names}, not
in an endpoint's C{models}, no C{adapters} or C{max_loras}), since it
would send an adapter's requests to the base engine without loading the
adapter, which answers 404; it answers a request for one 404 itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.web.iweb import IRequest

from llmgw.router.interfaces import Endpoint, Shortfall
from llmgw.wire import versions

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
        "gpus": endpoint.gpus,
        "gpu_hour": endpoint.gpu_hour,
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
        gpus=float(value.get("gpus", 0.0)),
        gpu_hour=float(value.get("gpu_hour", 0.0)),
    )


def without_adapters(
    endpoints: Sequence[Endpoint], names: Mapping[str, str], adapters: Collection[str]
) -> tuple[list[Endpoint], dict[str, str]]:
    """
    @param adapters: the catalog's LoRA adapters (their model names).
    @return: C{endpoints} and C{names} with no adapter in them: the names
        leading to an adapter left out, and each endpoint's adapters, their
        names among its C{models}, and its C{max_loras} (for a router older
        than L{versions.ADAPTERS}).
    """
    gone = set(adapters) | {name for e in endpoints for name, _ in e.adapters}
    kept = {name: model for name, model in names.items() if model not in gone}
    named = gone | {name for name in names if name not in kept}
    return [
        replace(
            e,
            models=tuple(m for m in e.models if m not in named),
            adapters=(),
            max_loras=0,
        )
        for e in endpoints
    ], kept


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
    @param adapters: the catalog's LoRA adapters now (their model names),
        withheld from a router older than L{versions.ADAPTERS}.
    @ivar version: bumped by every change; the first state is version 1.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        names: Callable[[], Mapping[str, str]],
        adapters: Callable[[], Collection[str]] = lambda: (),
    ) -> None:
        self.clock = clock
        self._names_now = names
        self._adapters_now = adapters
        self.version = 1
        self.endpoints: tuple[Endpoint, ...] = ()
        self.names: dict[str, str] = {}
        self.keys = 0
        self.below_min: tuple[Shortfall, ...] = ()
        # Each watcher, and the protocol version its router said.
        self._watchers: list[tuple[IRequest, tuple[int, int]]] = []
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
        for request, _ in watchers:
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

    def state(self, version: tuple[int, int] = versions.PROTOCOL) -> bytes:
        """
        @param version: the protocol version of the router it is for: what
            an older one does not know is left out (L{without_adapters}).
        @return: the state as one line of JSON, with its newline.
        """
        endpoints: Sequence[Endpoint] = self.endpoints
        names: Mapping[str, str] = self.names
        if not versions.supports(version, versions.ADAPTERS):
            endpoints, names = without_adapters(endpoints, names, self._adapters_now())
        value = {
            "version": self.version,
            "endpoints": [endpoint_json(e) for e in endpoints],
            "names": names,
            "keys": self.keys,
            "below_min": [shortfall_json(s) for s in self.below_min],
        }
        return json.dumps(value, separators=(",", ":")).encode("utf-8") + b"\n"

    def watch(
        self, request: IRequest, protocol: tuple[int, int] = versions.PROTOCOL
    ) -> Deferred[None]:
        """
        Stream the state to C{request} now and after each change.

        @param protocol: the protocol version the router said
            (L{versions.peer_version}): what it does not know is withheld.
        @return: never fires; cancel it when the watcher goes.
        """
        request.setHeader(b"content-type", b"application/x-ndjson")
        request.setHeader(b"cache-control", b"no-store")
        request.write(self.state(protocol))
        watcher = (request, protocol)
        self._watchers.append(watcher)
        withheld = [
            f.name
            for f in versions.FEATURES
            if f.peer == "router" and not versions.supports(protocol, f)
        ]
        self.log.info(
            "a router watches (version {version}, protocol {protocol}{withheld})",
            version=self.version,
            protocol=versions.text(protocol),
            withheld=f"; withheld: {', '.join(withheld)}" if withheld else "",
        )

        def gone(_: object) -> None:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

        return Deferred(gone)

    def _push(self) -> None:
        self.version += 1
        lines: dict[tuple[int, int], bytes] = {}
        for request, protocol in list(self._watchers):
            if protocol not in lines:
                lines[protocol] = self.state(protocol)
            request.write(lines[protocol])

    def _keepalive(self) -> None:
        self.changed()
        for request, _ in list(self._watchers):
            request.write(b"\n")
