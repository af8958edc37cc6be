"""
LoRA adapters on the replicas of their base model (vLLM's runtime LoRA
updating: C{POST /v1/load_lora_adapter} C{{"lora_name", "lora_path"}} and
C{POST /v1/unload_lora_adapter} C{{"lora_name"}}, with the engine's key).

An endpoint lists the adapters it may load (L{Endpoint.adapters}) and how
many it keeps (L{Endpoint.max_loras}).  What a replica holds is what its
engine lists: read from its C{GET /v1/models} when the replica appears
(L{llmgw.router.routing.adapter_state}), so that a router started anew
sends an adapter's requests where the engines already hold it, then kept
up with the loads and unloads the router does.  The router loads one on a
replica the first time a request for it goes there, the request held
meanwhile (one load per replica and adapter however many requests wait
for it).  C{max_loras} is never passed: before a load that would pass it,
the least recently used adapter with no request in flight there is
unloaded; when every one has a request in flight, the load waits until
one has none.  The balancer sends a request for an adapter to the replicas
that have it loaded while the least loaded of them is within the
bounded-load test (L{llmgw.router.routing.affinity.within_bound}); else, and
when none has it, to the least loaded replica, which loads it.

A load the engine refuses answers the request with the engine's own error
(status and body), and so does every request for that adapter there until
its back-off is over (L{llmgw.router.routing.adapter_state.LoadBackoff}):
then one load is tried again.  The refusals are shown on the model
(L{refusals}).  An adapter removed from the catalog (no longer in its
replica's C{adapters}) is unloaded from the engines that hold it once no
request for it is in flight there.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from llmgw.router.routing.adapter_state import (
    MODELS_PATH,
    LoadBackoff,
    Refusal,
    backoff_seconds,
    listed_adapters,
)
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
    @param clock: the reactor's clock, for the back-off of refused loads.
    """

    log = Logger()

    def __init__(
        self,
        upstream: Upstream,
        epsilon: float = 0.25,
        count: Callable[[str, str], None] = lambda adapter, outcome: None,
        *,
        clock: IReactorTime,
    ) -> None:
        self.upstream = upstream
        self.epsilon = epsilon
        self.count = count
        self.backoff = LoadBackoff(clock)
        self._loaded: dict[str, OrderedDict[str, None]] = {}
        self._loading: set[tuple[str, str]] = set()
        self._waiting: dict[tuple[str, str], list[Deferred[IResponse | None]]] = {}
        self._busy: dict[tuple[str, str], int] = {}
        # Loads past their max_loras check, not yet ended: they hold a slot.
        self._admitted: set[tuple[str, str]] = set()
        # Per replica: loads waiting for an adapter to have no request.
        self._slots: dict[str, list[Deferred[None]]] = {}
        # Replicas whose engine's list was read, and reads in flight.
        self._read: set[str] = set()
        self._reads: dict[str, Deferred[None]] = {}
        # The replicas of the last sync, by id: what each may hold now.
        self._replicas: dict[str, Any] = {}

    def loaded(self, replica_id: str) -> list[str]:
        """
        @return: the adapters loaded on the replica, least recently used
            first.
        """
        return list(self._loaded.get(replica_id, ()))

    def refusals(self, adapter: str | None = None) -> list[dict[str, Any]]:
        """
        @param adapter: only this adapter's; all by default.
        @return: the loads refused and not yet loaded since
            (L{Refusal.describe}): the engine's error and when the load is
            tried again.
        """
        kept = self.backoff.all() if adapter is None else self.backoff.of(adapter)
        return [r.describe() for r in kept]

    def forget(self, replica_ids: set[str]) -> None:
        """
        Keep only what is known of these replicas (the others are gone).
        """
        for gone in set(self._loaded) - replica_ids:
            del self._loaded[gone]
        self._read &= replica_ids
        # A load waiting for room on a replica gone goes on, and fails
        # there (its requests with it), rather than wait for good.
        for gone in set(self._slots) - replica_ids:
            for slot in self._slots.pop(gone):
                slot.callback(None)

    def sync(self, replicas: Sequence[Any]) -> None:
        """
        The replicas now (L{llmgw.router.routing.balancer.Replica}s): those
        gone forgotten, the adapters of each new one read from its engine,
        and an adapter no longer among a replica's unloaded there.
        """
        self.forget({r.endpoint.id for r in replicas})
        self._replicas = {r.endpoint.id: r for r in replicas}
        self.backoff.forget(
            {r.endpoint.id for r in replicas},
            {name for r in replicas for name, _ in r.endpoint.adapters},
        )
        for replica in replicas:
            replica_id = replica.endpoint.id
            if not replica.endpoint.adapters or replica_id in self._reads:
                continue
            if replica_id in self._read:
                self._unload_removed(replica)
                continue
            reading = Deferred.fromCoroutine(self._read_listing(replica))
            if not reading.called:
                self._reads[replica_id] = reading
                reading.addBoth(self._read_done, replica_id)

    def _read_done(self, _: object, replica_id: str) -> None:
        self._reads.pop(replica_id, None)

    async def _read_listing(self, replica: Any) -> None:
        """
        Learn what the replica's engine holds from its C{GET /v1/models}; a
        failed read is logged and taken as nothing held (the loads' answers
        tell the rest: "already loaded").
        """
        endpoint = replica.endpoint
        try:
            response = await self.upstream.get(
                replica.url_bytes, MODELS_PATH, _auth(endpoint.api_key)
            )
            body = await _read(response)
            if response.code != 200:
                raise ValueError(f"status {response.code}")
            listed = listed_adapters(body)
        except Exception as e:
            self.log.warn(
                "cannot read which adapters replica {replica} holds: {error}",
                replica=endpoint.id,
                error=e,
            )
            self._read.add(endpoint.id)
            return
        self._read.add(endpoint.id)
        loaded = self._loaded.setdefault(endpoint.id, OrderedDict())
        for name in listed:
            if name not in loaded:
                loaded[name] = None
                loaded.move_to_end(name, last=False)
        if listed:
            self.log.info(
                "replica {replica} holds adapters {adapters} (its /v1/models)",
                replica=endpoint.id,
                adapters=", ".join(sorted(listed)),
            )
        self._unload_removed(replica)

    def _unload_removed(self, replica: Any) -> None:
        """
        Unload from the replica each adapter it holds that is no longer
        one of its model's, once no request for it is in flight there.
        """
        endpoint = replica.endpoint
        names = {name for name, _ in endpoint.adapters}
        for adapter in list(self._loaded.get(endpoint.id, ())):
            if adapter not in names and (endpoint.id, adapter) not in self._busy:
                unloading = Deferred.fromCoroutine(
                    self._unload(replica, adapter, _auth(endpoint.api_key), "removed")
                )
                unloading.addErrback(
                    lambda f: self.log.failure("unloading a removed adapter", f)
                )

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
        C{observe}): it no longer keeps the adapter there; a load waiting
        for a slot there looks again, and the adapter, if it was removed
        meanwhile, is unloaded.
        """
        key = (replica_id or "", model)
        if key in self._busy:
            self._busy[key] -= 1
            if self._busy[key] <= 0:
                del self._busy[key]
                for slot in self._slots.pop(key[0], []):
                    slot.callback(None)
                replica = self._replicas.get(key[0])
                if replica is not None and key[0] in self._read:
                    self._unload_removed(replica)

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

        @return: the engine's response; for a load it refused (or one
            refused before whose back-off is not over), the load's answer
            (its status and body).  Cancellable.
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
        if model in loaded and endpoint.id not in self._reads:
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
        reading = self._reads.get(key[0])
        if reading is not None:
            # What the engine holds comes first: it may hold this one.
            await _after(reading)
        loaded = self._loaded.setdefault(key[0], OrderedDict())
        if model in loaded and key not in self._loading:
            loaded.move_to_end(model)
            return await self.upstream.post(replica.url_bytes, path, headers, body)
        refusal = self.backoff.waiting(*key)
        if refusal is not None:
            return _replay(refusal)
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
        self._admitted.discard(key)
        for waiter in self._waiting.pop(key, []):
            if waiter.called:  # cancelled
                continue
            if isinstance(result, Failure):
                waiter.errback(result)
            else:
                waiter.callback(result)

    async def _slot(
        self, replica: Any, model: str, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """
        Room for one more adapter on the replica within its C{max_loras}:
        the least recently used adapter with no request in flight unloaded
        when none is free, or, every one busy, a wait until one is not.
        The room is the caller's (L{_admitted}) once this returns.
        """
        endpoint = replica.endpoint
        told = False
        while endpoint.max_loras:
            # Read again each time: a replica gone has none (forget).
            loaded = self._loaded.get(endpoint.id, OrderedDict())
            admitted = sum(1 for r, _ in self._admitted if r == endpoint.id)
            if len(loaded) + admitted < endpoint.max_loras:
                break
            idle = [a for a in loaded if (endpoint.id, a) not in self._busy]
            if idle:
                await self._unload(replica, idle[0], headers, "least recently used")
                continue
            if not told:
                told = True
                self.log.info(
                    "replica {replica}: its {max_loras} adapters (max_loras) all"
                    " have requests in flight; {adapter} waits for one to end",
                    replica=endpoint.id,
                    max_loras=endpoint.max_loras,
                    adapter=model,
                )
            slot: Deferred[None] = Deferred()
            self._slots.setdefault(endpoint.id, []).append(slot)
            await slot
        self._admitted.add((endpoint.id, model))

    async def _load(
        self,
        replica: Any,
        model: str,
        source: str,
        headers: list[tuple[bytes, bytes]],
    ) -> IResponse | None:
        """
        Load C{model} on the replica once there is room for it
        (L{_slot}).

        @return: L{None} once loaded; the engine's refusal as a response.
        """
        endpoint = replica.endpoint
        await self._slot(replica, model, headers)
        loaded = self._loaded.setdefault(endpoint.id, OrderedDict())
        body = json.dumps({"lora_name": model, "lora_path": source}).encode()
        response = await self.upstream.post(replica.url_bytes, LOAD_PATH, headers, body)
        answer = await _read(response)
        if response.code == 200 or (response.code == 400 and ALREADY in answer):
            loaded[model] = None
            self.backoff.loaded(endpoint.id, model)
            self.count(model, "loaded")
            self.log.info(
                "loaded adapter {adapter} on replica {replica}",
                adapter=model,
                replica=endpoint.id,
            )
            return None
        self.count(model, "failed")
        error = answer[:300].decode("utf-8", "replace")
        refusal = self.backoff.refused(
            endpoint.id,
            model,
            response.code,
            error,
            (response.code, response.headers, answer),
        )
        self.log.warn(
            "replica {replica} refused to load adapter {adapter} from {source}:"
            " {status} {answer}; refusal {failures} in a row, tried again in"
            " {wait:.0f}s",
            replica=endpoint.id,
            adapter=model,
            source=source,
            status=response.code,
            answer=error,
            failures=refusal.failures,
            wait=backoff_seconds(refusal.failures),
        )
        return _replay(refusal)

    async def _unload(
        self,
        replica: Any,
        adapter: str,
        headers: list[tuple[bytes, bytes]],
        why: str,
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
            "unloaded adapter {adapter} from replica {replica} ({why},"
            " max_loras = {max_loras}): {status} {answer}",
            adapter=adapter,
            replica=endpoint.id,
            why=why,
            max_loras=endpoint.max_loras,
            status=response.code,
            answer=answer[:200].decode("utf-8", "replace"),
        )


def _auth(api_key: str) -> list[tuple[bytes, bytes]]:
    """
    @return: the headers of a request of the router's own to an engine
        (its key, if any).
    """
    if not api_key:
        return []
    return [(b"Authorization", b"Bearer " + api_key.encode("utf-8"))]


def _replay(refusal: Refusal) -> IResponse:
    """
    @return: a refused load's answer, to be read again.
    """
    code, headers, body = refusal.answer
    return _Replayed(code, headers, body)  # type: ignore[return-value]


def _after(d: Deferred[Any]) -> Deferred[None]:
    """
    @return: fires with L{None} when C{d} fires, whatever with; C{d}'s
        result is passed on to its other callbacks.
    """
    done: Deferred[None] = Deferred()

    def fire(result: object) -> object:
        done.callback(None)
        return result

    d.addBoth(fire)
    return done
