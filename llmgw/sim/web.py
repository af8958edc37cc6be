"""
The simulator's HTTP face: one leaf L{Resource} under a L{Site}.

Plain C{twisted.web} rather than Klein, and no per-request logging unless
asked: the simulator shares a CPU core with the load generator in the
throughput benchmark.

Routes::

    POST /v1/chat/completions   POST /v1/completions   POST /v1/embeddings
    GET  /v1/models             GET  /health           GET  /metrics
    GET  /sim/stats             POST /sim/stats/reset  POST /sim/fault
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IAddress, IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from llmgw.sim.api import (
    ApiError,
    GenerationRequest,
    Kind,
    embeddings_response,
    error_body,
    error_type_for,
    full_response,
    json_body,
    model_not_found,
    parse_embeddings,
    parse_generation,
    parse_json_object,
    stream_events,
)
from llmgw.sim.engine import (
    FOREVER,
    FaultError,
    Faults,
    QueueFull,
    Simulator,
    embedding_vector,
)
from llmgw.sim.metrics import METRICS_CONTENT_TYPE

BYTE_GAP = 0.002
"""
Seconds between single-byte writes under the C{byte_writes} fault.
"""

DROP_DELAY = 0.01
"""
Seconds between the last event before a C{drop_after_chunks} fault and the
abort, for the events to leave the transport's buffer.
"""

_JSON = [b"application/json"]
_SSE = [b"text/event-stream"]
_NO_CACHE = [b"no-cache"]

CHAT_PATH = b"/v1/chat/completions"
COMPLETIONS_PATH = b"/v1/completions"
EMBEDDINGS_PATH = b"/v1/embeddings"


def _respond(
    request: Request, status: int, body: bytes, content_type: list[bytes]
) -> bytes:
    request.setResponseCode(status)
    request.responseHeaders.setRawHeaders(b"content-type", content_type)
    return body


def _body(request: Request) -> bytes:
    content = request.content
    return b"" if content is None else bytes(content.read())


def _error(request: Request, error: ApiError) -> bytes:
    return _respond(request, error.status, error.body(), _JSON)


class _Exchange:
    """
    Drives one response through its faults, its wait for a slot, its timed
    events and the client's departure.

    The body is a list of events (SSE events for a stream, one JSON body
    otherwise).  Event C{0} waits C{first_delay} seconds after admission;
    token events after the first wait C{itl}; the others follow at once.
    """

    __slots__ = (
        "_sim",
        "_request",
        "_faults",
        "_events",
        "_stream",
        "_uses_slot",
        "_first",
        "_count",
        "_first_delay",
        "_itl",
        "_prompt_tokens",
        "_arrival",
        "_admitted_at",
        "_last_token",
        "_index",
        "_waited",
        "_stall_at",
        "_drop_at",
        "_bytes",
        "_pos",
        "_call",
        "_waiter",
        "_watching",
        "_holding",
        "_done",
    )

    def __init__(
        self,
        sim: Simulator,
        request: Request,
        faults: Faults,
        events: list[bytes],
        *,
        stream: bool,
        uses_slot: bool,
        first: int,
        count: int,
        first_delay: float,
        itl: float,
        prompt_tokens: int,
    ) -> None:
        """
        @param events: the response body, in events.
        @param stream: an event stream (headers go out before the first
            event; the stream counters apply).
        @param uses_slot: take a concurrency slot (chat and completions).
        @param first: the index of the first token's event.
        @param count: completion tokens, one event each from C{first}.
        @param first_delay: seconds from admission to event 0.
        @param itl: seconds between token events.
        @param prompt_tokens: for the metrics.
        """
        self._sim = sim
        self._request = request
        self._faults = faults
        self._events = events
        self._stream = stream
        self._uses_slot = uses_slot
        self._first = first
        self._count = count
        self._first_delay = first_delay
        self._itl = itl
        self._prompt_tokens = prompt_tokens
        self._arrival = sim.clock.seconds()
        self._admitted_at = self._arrival
        self._last_token = self._arrival
        self._index = 0
        self._waited = -1
        self._stall_at = (
            -1 if faults.stall_after_chunks is None else faults.stall_after_chunks
        )
        self._drop_at = (
            -1 if faults.drop_after_chunks is None else faults.drop_after_chunks
        )
        self._bytes: bytes | None = None
        self._pos = 0
        self._call: IDelayedCall | None = None
        self._waiter: Deferred[None] | None = None
        self._watching = False
        self._holding = False
        self._done = False

    def start(self) -> None:
        """
        Begin: stall if asked, then answer.
        """
        stall = self._faults.stall_before_first_byte
        if stall > 0:
            self._later(stall, self._begin)
            return
        self._begin()

    def _watch(self) -> None:
        # Only responses that outlive render() need to hear of the client
        # leaving; the hot path (no delays) finishes inside render().
        if not self._watching:
            self._watching = True
            self._request.notifyFinish().addErrback(self._lost)

    def _later(self, delay: float, f: Callable[[], None]) -> None:
        self._watch()
        if delay < FOREVER:
            self._call = self._sim.clock.callLater(delay, f)

    def _begin(self) -> None:
        self._call = None
        request = self._request
        status = self._faults.status
        if status is not None:
            self._fail(
                status,
                error_body(
                    f"simulated fault: status {status}",
                    error_type_for(status),
                    None,
                    "llmgw_sim_fault",
                ),
            )
            return
        waiter = None
        if self._uses_slot:
            try:
                waiter = self._sim.scheduler.acquire()
            except QueueFull:
                self._fail(
                    503,
                    ApiError(
                        503,
                        "the simulated engine's queue is full",
                        type="server_error",
                        code="queue_full",
                    ).body(),
                )
                return
            if waiter is None:
                self._holding = True
        headers = request.responseHeaders
        if self._stream:
            headers.setRawHeaders(b"content-type", _SSE)
            headers.setRawHeaders(b"cache-control", _NO_CACHE)
            request.write(b"")
            self._sim.stats.streams_started += 1
        else:
            headers.setRawHeaders(b"content-type", _JSON)
            headers.setRawHeaders(b"content-length", [b"%d" % len(self._events[0])])
        if waiter is None:
            self._step()
        else:
            self._watch()
            self._waiter = waiter
            waiter.addCallbacks(self._admitted, self._not_admitted)

    def _fail(self, status: int, body: bytes) -> None:
        self._done = True
        request = self._request
        request.setResponseCode(status)
        request.responseHeaders.setRawHeaders(b"content-type", _JSON)
        request.responseHeaders.setRawHeaders(b"content-length", [b"%d" % len(body)])
        request.write(body)
        request.finish()

    def _admitted(self, _: None) -> None:
        self._waiter = None
        self._holding = True
        self._admitted_at = self._sim.clock.seconds()
        self._step()

    def _not_admitted(self, failure: Failure) -> None:
        failure.trap(CancelledError)

    def _delay(self, i: int) -> float:
        if i == 0:
            return self._first_delay
        if self._first < i < self._first + self._count:
            return self._itl
        return 0.0

    def _step(self) -> None:
        """
        Write events until the next delay, stall, drop or the end.
        """
        self._call = None
        events = self._events
        while True:
            chunk = self._bytes
            if chunk is not None:
                pos = self._pos
                self._request.write(chunk[pos : pos + 1])
                pos += 1
                if pos >= len(chunk):
                    self._bytes = None
                    self._index += 1
                else:
                    self._pos = pos
                self._later(BYTE_GAP, self._step)
                return
            i = self._index
            if i >= len(events):
                self._complete()
                return
            if i == self._drop_at:
                self._drop()
                return
            if i == self._stall_at:
                self._stall_at = -1
                stall = self._faults.stall_seconds
                self._later(FOREVER if stall is None else stall, self._step)
                return
            if i != self._waited:
                delay = self._delay(i)
                if delay > 0:
                    self._waited = i
                    self._later(delay, self._step)
                    return
            self._observe(i)
            if self._faults.byte_writes:
                self._bytes = events[i]
                self._pos = 0
                continue
            self._request.write(events[i])
            self._index = i + 1

    def _observe(self, i: int) -> None:
        if not self._stream:
            return
        first = self._first
        if i == 0 or (first <= i < first + self._count):
            now = self._sim.clock.seconds()
            if i == 0:
                self._sim.metrics.time_to_first_token.observe(now - self._arrival)
            if i > first:
                self._sim.metrics.inter_token_latency.observe(now - self._last_token)
            self._last_token = now

    def _tokens_sent(self) -> int:
        if not self._stream:
            return self._count if self._index > 0 else 0
        return max(0, min(self._index - self._first, self._count))

    def _complete(self) -> None:
        self._done = True
        sim = self._sim
        if self._stream:
            sim.stats.streams_completed += 1
        self._request.finish()
        if self._uses_slot:
            metrics = sim.metrics
            now = sim.clock.seconds()
            if not self._stream:
                # The first token of an answer sent whole: admission + ttft.
                metrics.time_to_first_token.observe(
                    self._admitted_at + sim.config.ttft - self._arrival
                )
            metrics.e2e_request_latency.observe(now - self._arrival)
            metrics.prompt_tokens.inc(self._prompt_tokens)
            metrics.generation_tokens.inc(self._count)
            metrics.success_length.inc()
        self._release()

    def _release(self) -> None:
        if self._holding:
            self._holding = False
            self._sim.scheduler.release()

    def _cancel_pending(self) -> None:
        if self._call is not None:
            if self._call.active():
                self._call.cancel()
            self._call = None
        if self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            waiter.cancel()

    def _drop(self) -> None:
        self._done = True
        if self._stream:
            self._sim.stats.streams_dropped += 1
        if self._uses_slot:
            self._sim.metrics.generation_tokens.inc(self._tokens_sent())
        self._release()
        # Aborting discards what the transport has not sent yet: let the N
        # events leave first.
        self._watch()
        self._call = self._sim.clock.callLater(DROP_DELAY, self._abort)

    def _abort(self) -> None:
        self._call = None
        transport: Any = self._request.transport
        transport.abortConnection()

    def _lost(self, failure: Failure) -> None:
        """
        The client went away before the end: stop at once and free the slot.
        """
        self._cancel_pending()
        if self._done:
            return
        self._done = True
        stats = self._sim.stats
        stats.requests_cancelled += 1
        stats.last_cancel_time = self._sim.clock.seconds()
        if self._stream:
            stats.streams_cancelled += 1
        if self._uses_slot:
            self._sim.metrics.generation_tokens.inc(self._tokens_sent())
        self._release()


class SimResource(Resource):
    """
    Every route of the simulator, dispatched on method and path.
    """

    log = Logger()

    isLeaf = True

    def __init__(self, sim: Simulator) -> None:
        """
        @param sim: the engine state these routes serve.
        """
        super().__init__()  # type: ignore[no-untyped-call]
        self._sim = sim
        self._routes: dict[tuple[bytes, bytes], Callable[[Request], bytes | int]] = {
            (b"POST", CHAT_PATH): self._chat,
            (b"POST", COMPLETIONS_PATH): self._completions,
            (b"POST", EMBEDDINGS_PATH): self._embeddings,
            (b"GET", b"/v1/models"): self._models,
            (b"GET", b"/health"): self._health,
            (b"GET", b"/metrics"): self._metrics,
            (b"GET", b"/sim/stats"): self._stats,
            (b"POST", b"/sim/stats/reset"): self._stats_reset,
            (b"POST", b"/sim/fault"): self._fault,
        }
        self._paths = {path for (_, path) in self._routes}

    def render(self, request: Request) -> bytes | int:
        """
        Dispatch C{request}; unknown paths get 404 and known paths with the
        wrong method 405, both with an OpenAI error object.
        """
        method = request.method
        path = request.path
        handler = self._routes.get((method, path))
        if handler is not None:
            try:
                return handler(request)
            except Exception:
                # A bug must not answer in twisted.web's HTML.
                self.log.failure("simulator failed on {path}", path=path)
                return _error(request, ApiError(500, "internal simulator error"))
        if path in self._paths:
            return _error(request, ApiError(405, "method not allowed"))
        return _error(
            request,
            ApiError(
                404, f"no route {path.decode('ascii', 'replace')}", code="not_found"
            ),
        )

    def _count(self, path: bytes, request: Request) -> None:
        stats = self._sim.stats
        stats.requests_total += 1
        request_id = request.getHeader(b"x-request-id")
        stats.last_request_id = (
            request_id.decode("ascii", "replace") if request_id is not None else None
        )
        key = path.decode("ascii")
        stats.requests_by_path[key] = stats.requests_by_path.get(key, 0) + 1

    def _faults(self, spec: object) -> Faults:
        try:
            return self._sim.faults_for(spec)
        except FaultError as e:
            raise ApiError(400, str(e), param="llmgw_sim") from None

    def _chat(self, request: Request) -> bytes | int:
        return self._generate(request, "chat", CHAT_PATH)

    def _completions(self, request: Request) -> bytes | int:
        return self._generate(request, "completion", COMPLETIONS_PATH)

    def _generate(self, request: Request, kind: Kind, path: bytes) -> bytes | int:
        self._count(path, request)
        sim = self._sim
        try:
            req = parse_generation(kind, _body(request))
            if req.model not in sim.models:
                raise model_not_found(req.model)
            faults = self._faults(req.faults)
        except ApiError as e:
            return _error(request, e)
        config = sim.config
        count = config.max_tokens if req.max_tokens is None else req.max_tokens
        created = int(sim.clock.seconds())
        exchange = self._exchange(request, req, faults, count, created)
        exchange.start()
        return NOT_DONE_YET

    def _exchange(
        self,
        request: Request,
        req: GenerationRequest,
        faults: Faults,
        count: int,
        created: int,
    ) -> _Exchange:
        sim = self._sim
        config = sim.config
        response_id = sim.new_id("chatcmpl" if req.kind == "chat" else "cmpl")
        if req.stream:
            events, first = stream_events(req, response_id, created, count)
            first_delay = config.ttft
        else:
            events = [full_response(req, response_id, created, count)]
            first = 0
            first_delay = config.ttft + max(0, count - 1) * config.itl
        return _Exchange(
            sim,
            request,
            faults,
            events,
            stream=req.stream,
            uses_slot=True,
            first=first,
            count=count,
            first_delay=first_delay,
            itl=config.itl,
            prompt_tokens=req.prompt_tokens,
        )

    def _embeddings(self, request: Request) -> bytes | int:
        self._count(EMBEDDINGS_PATH, request)
        sim = self._sim
        try:
            req = parse_embeddings(_body(request))
            if req.model not in sim.models:
                raise model_not_found(req.model)
            faults = self._faults(req.faults)
        except ApiError as e:
            return _error(request, e)
        dim = sim.config.embedding_dim
        body = embeddings_response(req, [embedding_vector(x, dim) for x in req.inputs])
        _Exchange(
            sim,
            request,
            faults,
            [body],
            stream=False,
            uses_slot=False,
            first=0,
            count=0,
            first_delay=0.0,
            itl=0.0,
            prompt_tokens=req.prompt_tokens,
        ).start()
        return NOT_DONE_YET

    def _models(self, request: Request) -> bytes:
        sim = self._sim
        data = [
            {
                "id": name,
                "object": "model",
                "created": sim.created,
                "owned_by": "llmgw-sim",
            }
            for name in sim.config.models
        ]
        return _respond(
            request, 200, json_body({"object": "list", "data": data}), _JSON
        )

    def _health(self, request: Request) -> bytes:
        return _respond(request, 200, b"ok", [b"text/plain; charset=utf-8"])

    def _metrics(self, request: Request) -> bytes:
        return _respond(
            request, 200, self._sim.metrics.render(), [METRICS_CONTENT_TYPE]
        )

    def _stats(self, request: Request) -> bytes:
        return _respond(request, 200, json_body(self._sim.stats_json()), _JSON)

    def _stats_reset(self, request: Request) -> bytes:
        self._sim.stats.reset()
        return self._stats(request)

    def _fault(self, request: Request) -> bytes:
        try:
            spec = parse_json_object(_body(request))
            faults = self._sim.set_faults(spec)
        except ApiError as e:
            return _error(request, e)
        except FaultError as e:
            return _error(request, ApiError(400, str(e), param="faults"))
        return _respond(request, 200, json_body(faults), _JSON)


class SimChannel(HTTPChannel):
    """
    An HTTP/1.1 channel that counts open connections and turns off Nagle's
    algorithm, so each write leaves at once (C{byte_writes} relies on it).
    """

    simulator: Simulator

    def connectionMade(self) -> None:
        super().connectionMade()  # type: ignore[no-untyped-call]
        self.simulator.stats.connections_open += 1
        set_no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        self.simulator.stats.connections_open -= 1
        super().connectionLost(reason)  # type: ignore[no-untyped-call]


class SimSite(Site):
    """
    The simulator's site: L{SimResource} at the root, L{SimChannel}
    connections, and an access log only when verbose.
    """

    protocol = SimChannel  # type: ignore[assignment]
    log_requests = False
    _log = Logger()

    def __init__(self, sim: Simulator) -> None:
        """
        @param sim: the engine state to serve.
        """
        super().__init__(  # type: ignore[no-untyped-call]
            SimResource(sim), reactor=sim.clock
        )
        self.simulator = sim
        self.log_requests = sim.config.verbose

    def buildProtocol(self, addr: IAddress) -> SimChannel:  # type: ignore[override]
        channel: SimChannel = super().buildProtocol(addr)  # type: ignore[no-untyped-call]
        channel.simulator = self.simulator
        return channel

    def log(self, request: Request) -> None:  # type: ignore[override]
        """
        Log a finished request when verbose; otherwise nothing, to keep the
        hot path lean.
        """
        if self.log_requests:
            self._log.info(
                "{method} {path} {code} {length} bytes",
                method=request.method.decode("ascii", "replace"),
                path=request.path.decode("ascii", "replace"),
                code=request.code,
                length=request.sentLength,
            )
