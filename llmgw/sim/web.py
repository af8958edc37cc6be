"""
The simulator's HTTP face: one leaf L{Resource} under a L{Site}.

Plain C{twisted.web} rather than Klein, and no per-request logging unless
asked: the simulator shares a CPU core with the load generator in the
throughput benchmark.

Routes::

    POST /v1/chat/completions   POST /v1/completions   POST /v1/embeddings
    GET  /v1/models             GET  /health           GET  /metrics
    POST /tokenize              POST /detokenize
    GET  /sim/stats             POST /sim/stats/reset  POST /sim/fault

with C{--enable-lora} and C{VLLM_ALLOW_RUNTIME_LORA_UPDATING=True}
(L{llmgw.sim.lora})::

    POST /v1/load_lora_adapter  POST /v1/unload_lora_adapter

and with C{--enable-sleep-mode} (L{llmgw.sim.sleep})::

    POST /sleep                 POST /wake_up          GET  /is_sleeping
    POST /collective_rpc
    POST /release_memory_occupation    POST /resume_memory_occupation

With C{--api-key}, the C{/v1} routes need C{Authorization: Bearer KEY}
(401 otherwise), the others stay open, as vLLM's C{--api-key} leaves them.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from twisted.internet.defer import Deferred
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
    full_response,
    json_body,
    model_not_found,
    parse_embeddings,
    parse_generation,
    parse_json_object,
    reasoning_tokens,
    stream_events,
)
from llmgw.sim.core import engine_dead_body
from llmgw.sim.engine import (
    Simulator,
    completion_tokens,
    embedding_vector,
)
from llmgw.sim.exchange import JSON, Exchange
from llmgw.sim.faults import (
    FaultError,
    Faults,
)
from llmgw.sim.kvcache import SequenceBlocks
from llmgw.sim.length import Length, answer_length
from llmgw.sim.lora import LoraError
from llmgw.sim.metrics import METRICS_CONTENT_TYPE
from llmgw.sim.sleep import SGLANG_PATHS, collective_rpc
from llmgw.sim.sleep_query import sglang_tags, sleep_level, wake_tags
from llmgw.sim.tokens import context_error, detokenize, model_card, tokenize

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
    return _respond(request, error.status, error.body(), JSON)


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
            (b"POST", b"/tokenize"): self._tokenize,
            (b"POST", b"/detokenize"): self._detokenize,
            (b"GET", b"/sim/stats"): self._stats,
            (b"POST", b"/sim/stats/reset"): self._stats_reset,
            (b"POST", b"/sim/fault"): self._fault,
        }
        if sim.config.lora.enabled and sim.config.lora.runtime:
            self._routes[(b"POST", b"/v1/load_lora_adapter")] = self._load_lora
            self._routes[(b"POST", b"/v1/unload_lora_adapter")] = self._unload_lora
        if sim.config.sleep.enabled:
            self._routes.update(
                {
                    (b"POST", b"/sleep"): self._sleep,
                    (b"POST", b"/wake_up"): self._wake_up,
                    (b"GET", b"/is_sleeping"): self._is_sleeping,
                    (b"POST", b"/collective_rpc"): self._collective_rpc,
                    (b"POST", b"/release_memory_occupation"): self._release,
                    (b"POST", b"/resume_memory_occupation"): self._resume,
                }
            )
        self._paths = {path for (_, path) in self._routes}

    def render(self, request: Request) -> bytes | int:
        """
        Dispatch C{request}; unknown paths get 404 and known paths with the
        wrong method 405, both with an OpenAI error object.
        """
        method = request.method
        path = request.path
        handler = self._routes.get((method, path))
        if handler is not None and not self._authorized(request, path):
            return _error(
                request,
                ApiError(
                    401,
                    "Unauthorized: this engine needs its API key",
                    type="authentication_error",
                    code="invalid_api_key",
                ),
            )
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

    def _authorized(self, request: Request, path: bytes) -> bool:
        key = self._sim.config.api_key
        if not key or not (path.startswith(b"/v1/") or path in SGLANG_PATHS):
            return True
        given = request.getHeader(b"authorization") or b""
        return hmac.compare_digest(given, b"Bearer " + key.encode("utf-8"))

    def _count(self, path: bytes, request: Request) -> None:
        stats = self._sim.stats
        stats.requests_total += 1
        request_id = request.getHeader(b"x-request-id")
        stats.last_request_id = (
            request_id.decode("ascii", "replace") if request_id is not None else None
        )
        traceparent = request.getHeader(b"traceparent")
        stats.last_traceparent = (
            traceparent.decode("ascii", "replace") if traceparent is not None else None
        )
        tracestate = request.requestHeaders.getRawHeaders(b"tracestate")
        stats.last_tracestate = (
            b",".join(tracestate).decode("ascii", "replace") if tracestate else None
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
            if not sim.serves(req.model):
                raise model_not_found(req.model)
        except ApiError as e:
            return _error(request, e)
        if sim.core.dead:
            return self._engine_dead(request)
        try:
            too_long = context_error(
                req.prompt_tokens, req.max_tokens, sim.config.max_model_len
            )
            if too_long is not None:
                raise too_long
            faults = self._faults(req.faults)
        except ApiError as e:
            return _error(request, e)
        config = sim.config
        cap = config.max_tokens if req.max_tokens is None else req.max_tokens
        if req.script is not None:
            # A scripted answer is whole whatever the cap: a tool call cut
            # short would be no call at all.
            length = Length(req.script.tokens, "stop")
        else:
            length = answer_length(
                req.prompt, cap, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens
            )
        created = int(sim.clock.seconds())
        exchange = self._exchange(request, req, faults, length, created)
        self._when_awake(request, exchange)
        return NOT_DONE_YET

    def _engine_dead(self, request: Request) -> bytes:
        """
        vLLM's answer to a request its dead engine would run (checked
        after the model and the body's shape, before the prompt's length,
        C{_preflight} in C{vllm/entrypoints/generate/base/serving.py}):
        500 C{EngineDeadError}, which ends its server (L{llmgw.sim.core});
        it logs only its access line then.
        """
        self._sim.core.terminate_if_errored()
        return _respond(request, 500, engine_dead_body(), JSON)

    def _when_awake(self, request: Request, exchange: Exchange) -> None:
        """
        Start C{exchange} now, or once the engine is awake (vLLM keeps a
        request that comes while it sleeps until it is woken).
        """
        waiting = self._sim.sleep.awake()
        if waiting is None:
            exchange.start()
            return
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))
        waiting.addCallback(lambda _: None if gone else exchange.start())

    def _exchange(
        self,
        request: Request,
        req: GenerationRequest,
        faults: Faults,
        length: Length,
        created: int,
    ) -> Exchange:
        sim = self._sim
        count = length.count
        config = sim.config
        response_id = sim.new_id("chatcmpl" if req.kind == "chat" else "cmpl")
        if sim.sleep.garbled:
            # Weights discarded by a level-2 sleep and never reloaded: the
            # text no longer depends on the prompt (L{llmgw.sim.sleep}).
            req = replace(req, prompt=b"")
        ttft = config.ttft / config.speed
        itl = config.itl / config.speed
        reasoning = reasoning_tokens(config.reasoning_parser, req, count)
        if req.stream:
            events, first = stream_events(
                req, response_id, created, count, reasoning, length.finish_reason
            )
            first_delay = ttft
        else:
            events = [
                full_response(
                    req, response_id, created, count, reasoning, length.finish_reason
                )
            ]
            first = 0
            first_delay = ttft + max(0, count - 1) * itl
        blocks = None
        if sim.tracks_blocks:
            blocks = SequenceBlocks.of(req.prompt, completion_tokens(req.prompt, count))
        return Exchange(
            sim,
            request,
            faults,
            events,
            stream=req.stream,
            uses_slot=True,
            first=first,
            count=count,
            first_delay=first_delay,
            itl=itl,
            prompt_tokens=req.prompt_tokens,
            blocks=blocks,
            kv_tokens=req.prompt_tokens + count if config.kv_capacity else 0,
            finished_reason=length.finish_reason,
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
        if sim.core.dead:
            return self._engine_dead(request)
        dim = sim.config.embedding_dim
        body = embeddings_response(req, [embedding_vector(x, dim) for x in req.inputs])
        exchange = Exchange(
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
        )
        self._when_awake(request, exchange)
        return NOT_DONE_YET

    def _models(self, request: Request) -> bytes:
        sim = self._sim
        config = sim.config
        data = [model_card(n, sim.created, config.max_model_len) for n in config.models]
        data += sim.adapters.cards(sim.created)
        return _respond(request, 200, json_body({"object": "list", "data": data}), JSON)

    def _tokenize(self, request: Request) -> bytes:
        sim = self._sim
        try:
            answer = tokenize(_body(request), sim.models, sim.config.max_model_len)
        except ApiError as e:
            return _error(request, e)
        return _respond(request, 200, json_body(answer), JSON)

    def _detokenize(self, request: Request) -> bytes:
        try:
            answer = detokenize(_body(request), self._sim.models)
        except ApiError as e:
            return _error(request, e)
        return _respond(request, 200, json_body(answer), JSON)

    def _load_lora(self, request: Request) -> bytes | int:
        sim = self._sim
        try:
            text = sim.adapters.load(parse_json_object(_body(request)), sim.models)
        except ApiError as e:
            return _error(request, e)
        except LoraError as e:
            return _error(
                request, ApiError(e.status, e.message, type=e.type, param=e.param)
            )
        body, plain = text.encode("utf-8"), [b"text/plain; charset=utf-8"]
        delay = sim.config.lora.load_seconds / sim.config.speed
        if not delay:
            return _respond(request, 200, body, plain)
        gone: list[bool] = []
        request.notifyFinish().addErrback(lambda _: gone.append(True))

        def answer() -> None:
            if not gone:
                request.write(_respond(request, 200, body, plain))
                request.finish()

        sim.clock.callLater(delay, answer)
        return NOT_DONE_YET

    def _unload_lora(self, request: Request) -> bytes:
        try:
            text = self._sim.adapters.unload(parse_json_object(_body(request)))
        except ApiError as e:
            return _error(request, e)
        except LoraError as e:
            return _error(
                request, ApiError(e.status, e.message, type=e.type, param=e.param)
            )
        return _respond(
            request, 200, text.encode("utf-8"), [b"text/plain; charset=utf-8"]
        )

    def _health(self, request: Request) -> bytes:
        if self._sim.core.dead:
            # vLLM's answer once its engine core is dead (llmgw.sim.core).
            return _respond(request, 503, b"", [b"text/plain; charset=utf-8"])
        return _respond(request, 200, b"ok", [b"text/plain; charset=utf-8"])

    def _metrics(self, request: Request) -> bytes:
        return _respond(
            request, 200, self._sim.metrics.render(), [METRICS_CONTENT_TYPE]
        )

    def _stats(self, request: Request) -> bytes:
        return _respond(request, 200, json_body(self._sim.stats_json()), JSON)

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
        return _respond(request, 200, json_body(faults), JSON)

    # vLLM's sleep routes are calls to its engine core: its death makes
    # them the 500 that ends the server, and one in flight then never
    # answers (llmgw.sim.core).

    def _sleep(self, request: Request) -> bytes | int:
        try:
            level = sleep_level(_query(request))
        except ApiError as e:
            return _error(request, e)
        core = self._sim.core
        if core.dead:
            return self._engine_dead(request)
        answer = {"status": "sleeping", "level": level}
        return _answer_later(
            request, core.utility(self._sim.sleep.sleep(level)), lambda _: answer
        )

    def _wake_up(self, request: Request) -> bytes | int:
        tags = wake_tags(_query(request))
        core = self._sim.core
        if core.dead:
            return self._engine_dead(request)
        return _answer_later(
            request,
            core.utility(self._sim.sleep.wake(tags)),
            lambda awake: {"status": "awake" if awake else "sleeping", "tags": tags},
        )

    def _is_sleeping(self, request: Request) -> bytes:
        if self._sim.core.dead:
            return self._engine_dead(request)
        body = json_body({"is_sleeping": self._sim.sleep.asleep})
        return _respond(request, 200, body, JSON)

    def _collective_rpc(self, request: Request) -> bytes:
        if self._sim.core.dead:
            return self._engine_dead(request)
        status, answer = collective_rpc(self._sim.sleep, _body(request))
        if status != 200:
            # vLLM's handlers: the HTTP phrase for its router's 400s, its
            # fallback error type for what the workers raise.
            kind = "Bad Request" if status == 400 else "InternalServerError"
            return _error(request, ApiError(status, str(answer), type=kind))
        return _respond(request, status, json_body(answer), JSON)

    def _release(self, request: Request) -> bytes | int:
        try:
            sglang_tags(_body(request))
        except ApiError as e:
            return _error(request, e)
        # SGLang's memory saver releases what it holds: level 1 here.
        return _answer_later(request, self._sim.sleep.sleep(1), lambda _: None)

    def _resume(self, request: Request) -> bytes | int:
        try:
            tags = sglang_tags(_body(request))
        except ApiError as e:
            return _error(request, e)
        return _answer_later(request, self._sim.sleep.wake(tags), lambda _: None)


def _query(request: Request) -> bytes:
    return request.uri.partition(b"?")[2]


def _answer_later(
    request: Request, done: Deferred[Any], answer: Callable[[Any], object]
) -> int:
    """
    Answer C{request} with C{answer}'s JSON once C{done} fires, unless its
    client went away first.
    """
    gone: list[bool] = []
    request.notifyFinish().addErrback(lambda _: gone.append(True))

    def write(result: object) -> None:
        if gone:
            return
        _respond(request, 200, b"", JSON)
        request.write(json_body(answer(result)))
        request.finish()

    done.addCallback(write)
    return NOT_DONE_YET


class SimChannel(HTTPChannel):
    """
    An HTTP/1.1 channel that counts open connections and turns off Nagle's
    algorithm, so each write leaves at once (C{byte_writes} relies on it).
    """

    def __init__(self, simulator: Simulator) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.simulator = simulator

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
        # Each channel built with the simulator it counts its connections
        # in (Factory.buildProtocol calls protocol()).
        self.protocol = partial(SimChannel, sim)  # type: ignore[assignment]
        self.log_requests = sim.config.verbose

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
