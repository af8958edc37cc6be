"""
LoRA adapters on the replicas of their base model (vLLM's runtime LoRA
updating: C{POST /v1/load_lora_adapter} C{{"lora_name", "lora_path"}} and
C{POST /v1/unload_lora_adapter} C{{"lora_name"}}, with the engine's key).

An endpoint lists the adapters it may load (L{Endpoint.adapters}) and how
many it keeps (L{Endpoint.max_loras}).  The router loads one on a replica
the first time a request for it goes there, the request held meanwhile
(one load per replica and adapter however many requests wait for it);
before a load that would pass C{max_loras}, the least recently used
adapter with no request in flight there is unloaded (none is: the engine
keeps one more for now).  The balancer sends a request for an adapter to
the replicas that have it loaded while the least loaded of them is within
the bounded-load test (L{llmgw.router.routing.affinity.within_bound}); else, and
when none has it, to the least loaded replica, which loads it.

What the router knows is its own: routers of a tier each load adapters
as their requests need them; an engine that answers that an adapter is
already loaded counts as having it.  A load the engine refuses answers the
request with the engine's own error (status and body).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from llmgw.router.routing.affinity import within_bound
from llmgw.router.upstream.base import BodyReader, Upstream

LOAD_PATH = b"/v1/load_lora_adapter"
UNLOAD_PATH = b"/v1/unload_lora_adapter"
ALREADY = b"has already been loaded"
MAX_ANSWER = 64 * 1024
"""
Bytes of a load or unload answer read at most.
"""


class _Replayed:
    """
    An engine's answer already read, given to the exchange as a response
    (C{code}, C{headers}, C{length}, C{deliverBody}: what it reads).
    """

    def __init__(self, code: int, headers: Headers, body: bytes) -> None:
        self.code = code
        self.headers = headers
        self.length = len(body)
        self._body = body

    def deliverBody(self, protocol: Any) -> None:
        protocol.makeConnection(None)
        if self._body:
            protocol.dataReceived(self._body)
        protocol.connectionLost(Failure(ResponseDone()))


async def _read(response: IResponse) -> bytes:
    chunks: list[bytes] = []
    size = 0

    def on_data(data: bytes) -> None:
        nonlocal size
        size += len(data)
        if size > MAX_ANSWER:
            raise ValueError("the engine's answer is too long")
        chunks.append(data)

    reader = BodyReader(on_data)
    response.deliverBody(reader)
    await reader.done
    return b"".join(chunks)


class AdapterLoads:
    """
    Which adapters each replica has loaded, in the order of their last use
    (least recent first), the loads in flight and the requests in flight.

    @param upstream: the client to the replicas.
    @param epsilon: the bounded-load test's slack (C{affinity_epsilon}).
    @param count: called with the adapter and C{"loaded"}, C{"unloaded"} or
        C{"failed"} for each load and unload (the router's metrics).
    """

    log = Logger()

    def __init__(
        self,
        upstream: Upstream,
        epsilon: float = 0.25,
        count: Callable[[str, str], None] = lambda adapter, outcome: None,
    ) -> None:
        self.upstream = upstream
        self.epsilon = epsilon
        self.count = count
        self._loaded: dict[str, OrderedDict[str, None]] = {}
        self._loading: set[tuple[str, str]] = set()
        self._waiting: dict[tuple[str, str], list[Deferred[IResponse | None]]] = {}
        self._busy: dict[tuple[str, str], int] = {}

    def loaded(self, replica_id: str) -> list[str]:
        """
        @return: the adapters loaded on the replica, least recently used
            first.
        """
        return list(self._loaded.get(replica_id, ()))

    def forget(self, replica_ids: set[str]) -> None:
        """
        Keep only what is known of these replicas (the others are gone).
        """
        for gone in set(self._loaded) - replica_ids:
            del self._loaded[gone]

    def narrow(
        self, model: str, ready: Sequence[Any], load_of: Callable[[Any], float]
    ) -> Sequence[Any]:
        """
        @param ready: the replicas a request for C{model} may go to
            (L{llmgw.router.routing.balancer.Replica}s).
        @param load_of: a replica's load score.
        @return: those that have the adapter C{model} loaded or loading,
            while the least loaded of them passes the bounded-load test;
            else C{ready} (the balancer's choice among them loads it).
        """
        having = [
            r
            for r in ready
            if model in self._loaded.get(r.endpoint.id, ())
            or (r.endpoint.id, model) in self._loading
        ]
        if not having or len(having) == len(ready):
            return having or ready
        loads = {r.endpoint.id: load_of(r) for r in ready}
        best = min(having, key=lambda r: loads[r.endpoint.id])
        total = sum(loads.values())
        weights = sum(r.endpoint.weight for r in ready)
        fits = within_bound(
            loads[best.endpoint.id], best.endpoint.weight, total, weights, self.epsilon
        )
        return having if fits else ready

    def finished(self, replica_id: str | None, model: str) -> None:
        """
        A request for C{model} on the replica ended (the balancer's
        C{observe}): it no longer keeps the adapter there.
        """
        key = (replica_id or "", model)
        if key in self._busy:
            self._busy[key] -= 1
            if self._busy[key] <= 0:
                del self._busy[key]

    def post(
        self,
        replica: Any,
        model: str,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        fresh: bool = False,
    ) -> Deferred[IResponse]:
        """
        L{Upstream.post} to C{replica} (a L{llmgw.router.routing.balancer.Replica}),
        the adapter C{model} loaded there first when it is one of its
        adapters and not loaded yet.

        @return: the engine's response; for a load it refused, the load's
            answer (its status and body).  Cancellable.
        """
        endpoint = replica.endpoint
        source = dict(endpoint.adapters).get(model)
        if source is None:
            return self.upstream.post(
                replica.url_bytes, path, headers, body, fresh=fresh
            )
        key = (endpoint.id, model)
        self._busy[key] = self._busy.get(key, 0) + 1
        loaded = self._loaded.setdefault(endpoint.id, OrderedDict())
        if model in loaded:
            loaded.move_to_end(model)
            d = self.upstream.post(replica.url_bytes, path, headers, body, fresh=fresh)
        else:
            d = Deferred.fromCoroutine(
                self._load_then_post(replica, model, source, (path, headers, body))
            )
        return d.addCallbacks(self._answered(key), self._failed(key))

    def _answered(self, key: tuple[str, str]) -> Callable[[IResponse], IResponse]:
        def answered(response: IResponse) -> IResponse:
            if response.code == 503:  # the exchange tries another replica
                self.finished(*key)
            return response

        return answered

    def _failed(self, key: tuple[str, str]) -> Callable[[Failure], Failure]:
        def failed(failure: Failure) -> Failure:
            self.finished(*key)
            return failure

        return failed

    async def _load_then_post(
        self,
        replica: Any,
        model: str,
        source: str,
        request: tuple[bytes, list[tuple[bytes, bytes]], bytes],
    ) -> IResponse:
        path, headers, body = request
        key = (replica.endpoint.id, model)
        mine: Deferred[IResponse | None] = Deferred()
        self._waiting.setdefault(key, []).append(mine)
        if key not in self._loading:
            self._loading.add(key)
            load = Deferred.fromCoroutine(self._load(replica, model, source, headers))
            load.addBoth(self._settle, key)
        refused = await mine
        if refused is not None:
            return refused
        return await self.upstream.post(replica.url_bytes, path, headers, body)

    def _settle(self, result: IResponse | None | Failure, key: tuple[str, str]) -> None:
        """
        A load ended: every request waiting for it goes on (or fails).
        """
        self._loading.discard(key)
        for waiter in self._waiting.pop(key, []):
            if waiter.called:  # cancelled
                continue
            if isinstance(result, Failure):
                waiter.errback(result)
            else:
                waiter.callback(result)

    async def _load(
        self,
        replica: Any,
        model: str,
        source: str,
        headers: list[tuple[bytes, bytes]],
    ) -> IResponse | None:
        """
        Load C{model} on the replica, the least recently used idle adapter
        unloaded first when it would pass C{max_loras}.

        @return: L{None} once loaded; the engine's refusal as a response.
        """
        endpoint = replica.endpoint
        loaded = self._loaded.setdefault(endpoint.id, OrderedDict())
        pending = sum(1 for r, _ in self._loading if r == endpoint.id)  # this one too
        if endpoint.max_loras and len(loaded) + pending > endpoint.max_loras:
            idle = [a for a in loaded if (endpoint.id, a) not in self._busy]
            if idle:
                await self._unload(replica, idle[0], headers)
        body = json.dumps({"lora_name": model, "lora_path": source}).encode()
        response = await self.upstream.post(replica.url_bytes, LOAD_PATH, headers, body)
        answer = await _read(response)
        if response.code == 200 or (response.code == 400 and ALREADY in answer):
            loaded[model] = None
            self.count(model, "loaded")
            self.log.info(
                "loaded adapter {adapter} on replica {replica}",
                adapter=model,
                replica=endpoint.id,
            )
            return None
        self.count(model, "failed")
        self.log.warn(
            "replica {replica} refused to load adapter {adapter} from {source}:"
            " {status} {answer}",
            replica=endpoint.id,
            adapter=model,
            source=source,
            status=response.code,
            answer=answer[:300].decode("utf-8", "replace"),
        )
        return _Replayed(response.code, response.headers, answer)  # type: ignore[return-value]

    async def _unload(
        self, replica: Any, adapter: str, headers: list[tuple[bytes, bytes]]
    ) -> None:
        endpoint = replica.endpoint
        self._loaded.get(endpoint.id, OrderedDict()).pop(adapter, None)
        body = json.dumps({"lora_name": adapter}).encode()
        try:
            response = await self.upstream.post(
                replica.url_bytes, UNLOAD_PATH, headers, body
            )
            answer = await _read(response)
        except Exception as e:
            self.log.warn(
                "unloading adapter {adapter} from replica {replica} failed: {error}",
                adapter=adapter,
                replica=endpoint.id,
                error=e,
            )
            return
        self.count(adapter, "unloaded")
        self.log.info(
            "unloaded adapter {adapter} from replica {replica} (least recently"
            " used, max_loras = {max_loras}): {status} {answer}",
            adapter=adapter,
            replica=endpoint.id,
            max_loras=endpoint.max_loras,
            status=response.code,
            answer=answer[:200].decode("utf-8", "replace"),
        )
