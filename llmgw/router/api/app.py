"""
The data plane: the OpenAI API in front of engine replicas (the path of one
request: docs/architecture.md, "One request").
The routes, API keys and usage accounting; each request's trip to the
replicas is an L{llmgw.router.api.exchange.Exchange}.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

from klein import Klein
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from werkzeug.exceptions import MethodNotAllowed, NotFound

from llmgw.router.api.anthropic import (
    CHAT_PATH,
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    MESSAGES_PATHS,
)
from llmgw.router.api.batch_api import BatchAPI
from llmgw.router.api.credentials import admit, request_key, tenant
from llmgw.router.api.exchange import Exchange, Services
from llmgw.router.api.fastpath import ForwardingRoutes
from llmgw.router.api.prepare import (
    Prepared,
    Refused,
    prepare,
    prepare_messages,
    prepare_responses,
)
from llmgw.router.api.records import request_record
from llmgw.router.api.response_routes import ResponseRoutes
from llmgw.router.api.responses import RESPONSES_PATH, responses_error
from llmgw.router.api.responses_state import Conversations
from llmgw.router.api.stream_usage import MissingStreamUsage
from llmgw.router.edge.cors import Cors
from llmgw.router.edge.site import JSON, RequestIds, client_gone, request_ids
from llmgw.router.errors import (
    APIError,
    anthropic_error,
    body_too_large,
    model_not_found,
)
from llmgw.router.interfaces import (
    Activator,
    Auth,
    Key,
    Readiness,
    ResponseStore,
    UsageSink,
)

# Named here too for the modules that import them from the routes.
from llmgw.router.interfaces import RequestRecord as RequestRecord
from llmgw.router.routing.activation import ActivationQueues
from llmgw.router.routing.affinity import AffinityRule
from llmgw.router.routing.balancer import Balancer
from llmgw.router.routing.decision import wanted
from llmgw.router.routing.fairness import FairShare
from llmgw.router.routing.load import LoadBoard
from llmgw.router.routing.overload import Overload
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import RouterMetrics
from llmgw.router.telemetry.tracing import NO_TRACE, NoTrace, Tracing
from llmgw.router.upstream.base import Upstream

FORWARDED_PATHS = {
    path: path
    for path in (
        b"/v1/chat/completions",
        b"/v1/completions",
        b"/v1/embeddings",
        b"/v1/rerank",
        b"/v1/score",
        b"/v1/responses",
        b"/tokenize",
        b"/detokenize",
        MESSAGES_PATH,
        COUNT_TOKENS_PATH,
    )
}
"""
The paths whose POSTs go to a replica, each to the same path there.  Each
has a Klein route too, for the requests L{ForwardingRoutes} passes on (a
percent-encoded spelling of the path).
"""


def _no_alias(name: str) -> str | None:
    return None


class Router:
    """
    The client-facing OpenAI API.

    @param clock: the reactor's clock, for deadlines.
    @param balancer: the replicas and the choice among them.
    @param upstream: the HTTP client for engine traffic (the servers give
        an L{llmgw.router.upstream.engine_client.EngineClient}).
    @param settings: deadlines, retries and limits.
    @param metrics: where traffic is counted.
    @param usage: receives a record per finished request.
    @param wall_clock: the time of day, seconds since the epoch (the
        C{created} field of model objects).
    @param activator: scale from zero, or L{None}.
    @param auth: API keys, or L{None} for an open gateway.
    @param readiness: the catalog models below their C{min_replicas}, as
        the control plane publishes them (C{/readyz}).
    @param load: each replica's engine load, when the server polls it.
    @param tracing: the requests' spans (C{[tracing]} on), or L{None}.
    @param responses: where Responses API responses are kept, or L{None}.
    """

    app = Klein()
    # werkzeug would answer //v1//models with an HTML redirect built from
    # the Host header; without merging, it is an unknown path (404).
    app.url_map.merge_slashes = False
    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        balancer: Balancer,
        upstream: Upstream,
        settings: RouterConfig,
        metrics: RouterMetrics,
        usage: UsageSink,
        wall_clock: Callable[[], float],
        activator: Activator | None = None,
        auth: Auth | None = None,
        readiness: Readiness | None = None,
        load: LoadBoard | None = None,
        tracing: Tracing | None = None,
        responses: ResponseStore | None = None,
    ) -> None:
        self.clock = clock
        self.stored = ResponseRoutes(responses, auth)
        self.auth = auth
        self.readiness = readiness if readiness is not None else Readiness()
        self.activator = activator
        self.balancer = balancer
        self.settings = settings
        self.metrics = metrics
        self.usage = usage
        self.created = int(wall_clock())
        self.in_flight = 0
        self._stream_usage = MissingStreamUsage(self.knows)
        self.conversations = Conversations(responses, wall_clock)
        self.load = load
        self.tracing = tracing
        self._idle_waiters: list[Deferred[None]] = []
        self._resolve = activator.resolve if activator is not None else _no_alias
        # The Files and Batches APIs' routes too (served beside these).
        maps = (self.app.url_map.bind("gateway"), BatchAPI.app.url_map.bind("gateway"))
        self.cors = Cors(
            settings.cors_allow_origins,
            lambda path: sorted(
                {m for r in maps for m in r.allowed_methods(path)} - {"HEAD"}
            ),
        )
        self.affinity = (
            AffinityRule(
                settings.prefix_bytes,
                settings.prefix_min_tokens,
                settings.session_header.lower().encode("ascii"),
            )
            if balancer.affinity
            else None
        )
        overload = Overload(
            clock,
            lambda model: balancer.overloaded(model, settings.overload_queue_depth),
            balancer.count,
            settings.overload_wait,
            settings.overload_queue_size,
            recheck=settings.load_poll_interval / 4,
            retry_after=settings.load_poll_interval,
            count=lambda model, outcome: metrics.overload.labels(model, outcome).inc(),
            shares=FairShare(clock),
            fifo=settings.waiting_order == "fifo",
        )
        self.services = Services(
            clock=clock,
            settings=settings,
            balancer=balancer,
            upstream=upstream,
            metrics=metrics,
            activator=activator,
            activating=ActivationQueues(),
            log=self.log,
            overload=overload,
        )

    def resource(self) -> IResource:
        """
        @return: the client API as a resource: the forwarding routes
            (L{FORWARDED_PATHS}) served directly, the rest by Klein.
        """
        return ForwardingRoutes(self._forward, FORWARDED_PATHS, self.app.resource())

    def knows(self, model: str) -> bool:
        """
        @return: whether C{model} is served by a replica now or is in the
            catalog.
        """
        if self.balancer.serves(model):
            return True
        return self.activator is not None and self.activator.resolve(model) is not None

    def models(self) -> list[str]:
        """
        @return: the names clients may send, sorted.
        """
        names = set(self.balancer.models())
        if self.activator is not None:
            names.update(self.activator.names())
        return sorted(names)

    def drain(self, timeout: float) -> Deferred[None]:
        """
        Wait for the requests in flight to finish, for at most C{timeout}
        seconds; call once the listener stopped accepting new ones.

        @return: fires with L{None} when none is left or the time is up.
        """
        if self.in_flight == 0:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._idle_waiters.append(waiter)
        timer = self.clock.callLater(timeout, self._stop_waiting, waiter)
        waiter.addBoth(lambda result: timer.cancel() if timer.active() else None)
        self.log.info(
            "draining: waiting up to {timeout}s for {count} requests in flight",
            timeout=timeout,
            count=self.in_flight,
        )
        return waiter

    def _stop_waiting(self, waiter: Deferred[None]) -> None:
        if waiter in self._idle_waiters:
            self._idle_waiters.remove(waiter)
            self.log.warn(
                "drain timed out with {count} requests in flight", count=self.in_flight
            )
            waiter.callback(None)

    def _error(
        self, request: IRequest, error: APIError, anthropic: bool = False
    ) -> bytes:
        """
        @param anthropic: answer in Anthropic's shape (the Messages API's
            routes), else OpenAI's.
        @return: the body of C{error}, its status and headers set.
        """
        status, body = anthropic_error(error) if anthropic else (error.status, None)
        request.setResponseCode(status)
        request.setHeader(b"content-type", JSON)
        if error.retry_after is not None:
            request.setHeader(b"retry-after", str(error.retry_after).encode("ascii"))
        return body if body is not None else error.body()

    async def _forward(self, request: IRequest, path: bytes) -> bytes | None:
        started = self.clock.seconds()
        ids = request_ids(request)
        rid = ids.own
        metrics = self.metrics
        metrics.in_flight.inc()
        self.in_flight += 1
        status = 500
        key: Key | None = None
        prepared: Prepared | None = None
        exchange: Exchange | None = None
        reserved = 0
        # What the record says before the body is prepared (or if it is not).
        model, stream = "", False
        anthropic = path in MESSAGES_PATHS
        translated = anthropic or path == RESPONSES_PATH
        trace = self._trace(request, path)
        try:
            key = self._key_for(request)
            history = None
            if path == RESPONSES_PATH:
                history = await self.conversations.history(request, key)
            try:
                prepared = self._prepare(request, path, history)
            except Refused as refused:
                model, stream = refused.model, refused.stream
                raise refused.error from None
            model, stream = prepared.model, prepared.stream
            exchange = Exchange(
                self.services,
                request,
                CHAT_PATH if translated else path,
                prepared,
                rid,
                ids.upstream,
                tenant=tenant(request, key),
                explain=wanted(request, self.settings.log_candidates),
                trace=trace,
            )
            reserved = await admit(self.auth, key, prepared)
            result = await exchange.run()
            if prepared.responses is not None:
                await self.conversations.keep(prepared, key)
            status = exchange.status
            return result
        except APIError as error:
            if exchange is not None and exchange.prepared.responses is not None:
                error = responses_error(error)
            status = anthropic_error(error)[0] if anthropic else error.status
            if exchange is not None and exchange.headers_sent:
                # A stream already started (activation's keep-alives):
                # the error goes as its last event.
                request.write(exchange.prepared.error_event(error))
                return None
            return self._error(request, error, anthropic)
        except Exception:
            if client_gone(request):
                # The client went away (nginx's 499), unless it had the
                # whole stream: the official client closes at [DONE].
                status = 200 if exchange is not None and exchange.done else 499
                return None
            self.log.failure(
                "request {request_id} failed", request_id=rid.decode("ascii")
            )
            return self._error(
                request,
                APIError(500, "Internal error in the gateway.", "api_error"),
                anthropic,
            )
        finally:
            if exchange is not None:
                exchange.finish()
            metrics.in_flight.dec()
            self.in_flight -= 1
            if self.activator is not None and prepared is not None:
                # Idle time counts from the last completion, not arrival.
                self.activator.touch(prepared.model)
            seen = (ids, started, status, model, stream)
            sent = exchange is not None and exchange.headers_sent
            trace.end(self._account(seen, key, reserved, exchange), sent)

    def _trace(self, request: IRequest, path: bytes) -> NoTrace:
        """
        @return: the request's spans, or L{NO_TRACE} when tracing is off.
        """
        if self.tracing is None:
            return NO_TRACE
        return self.tracing.request(path, request.requestHeaders)

    def _prepare(
        self, request: IRequest, path: bytes, history: list[dict[str, Any]] | None
    ) -> Prepared:
        """
        @param history: the items a Responses API request continues.
        @return: the request's body parsed, checked and rewritten.
        @raise APIError: a 413 for a body past C{max_body_size}.
        @raise Refused: the body is malformed, or names no model served.
        """
        if getattr(request, "body_too_large", False):
            raise body_too_large(self.settings.max_body_size)
        content = request.content
        assert content is not None
        content.seek(0)
        rule = self.affinity
        parse = prepare_messages if path in MESSAGES_PATHS else prepare
        if path == RESPONSES_PATH:
            parse = partial(prepare_responses, history=history)
        return parse(
            content.read(),
            path,
            self.knows,
            self._resolve,
            rule,
            request.getHeader(rule.session_header)
            if rule is not None and rule.session_header
            else None,
        )

    def _account(
        self,
        what: tuple[RequestIds, float, int, str, bool],
        key: Key | None,
        reserved: int,
        exchange: Exchange | None,
    ) -> RequestRecord:
        """
        A request's end, however it ended: its record counted, to the
        balancer and the usage sinks, its tokens to its key, and a drain
        waiting for the last request released.

        @param what: its ids, the clock time it came, the status answered,
            its model and whether it streams.
        @return: its record.
        """
        ids, started, status, model, stream = what
        record = request_record(
            ids,
            started,
            self.clock.seconds(),
            status,
            model,
            self.knows(model),
            stream,
            key,
            reserved,
            exchange,
        )
        self._stream_usage.note(status, exchange, self.log)
        self._count(record)
        self.balancer.observe(record)
        self.usage.record(record)
        if exchange is not None:
            exchange.served(record.prompt_tokens + record.completion_tokens)
        if key is not None and self.auth is not None:
            self.auth.used(
                key, record.prompt_tokens + record.completion_tokens, reserved
            )
        # Last: a drain released here goes straight on to the stop's
        # next steps, "usage flushed" among them, which must find this
        # request's record and its key's tokens.
        if self.in_flight == 0 and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                waiter.callback(None)
        return record

    def _count(self, record: RequestRecord) -> None:
        # Only configured names become labels: a client must not be able
        # to grow the metrics without bound by inventing model names.
        self.metrics.finished(
            record.model if self.knows(record.model) else None,
            record.status,
            record.latency,
            record.time_to_first_token if record.stream else None,
            record.prompt_tokens,
            record.completion_tokens,
        )

    @app.route("/v1/chat/completions", methods=["POST"])
    async def chat_completions(self, request: IRequest) -> bytes | None:
        return await self._forward(request, b"/v1/chat/completions")

    @app.route("/v1/completions", methods=["POST"])
    async def completions(self, request: IRequest) -> bytes | None:
        return await self._forward(request, b"/v1/completions")

    @app.route("/v1/embeddings", methods=["POST"])
    async def embeddings(self, request: IRequest) -> bytes | None:
        return await self._forward(request, b"/v1/embeddings")

    # Engine endpoints passed through when the engine has them (docs/server.md).
    @app.route("/v1/rerank", methods=["POST"])
    @app.route("/v1/score", methods=["POST"])
    @app.route("/tokenize", methods=["POST"])
    @app.route("/detokenize", methods=["POST"])
    async def passthrough(self, request: IRequest) -> bytes | None:
        return await self._forward(request, request.path)

    @app.route("/v1/responses", methods=["POST"])  # docs/responses.md
    async def responses(self, request: IRequest) -> bytes | None:
        return await self._forward(request, RESPONSES_PATH)

    # Anthropic's Messages API (docs/anthropic.md).
    @app.route("/v1/messages", methods=["POST"])
    async def messages(self, request: IRequest) -> bytes | None:
        return await self._forward(request, MESSAGES_PATH)

    @app.route("/v1/messages/count_tokens", methods=["POST"])
    async def count_tokens(self, request: IRequest) -> bytes | None:
        return await self._forward(request, COUNT_TOKENS_PATH)

    @app.route("/v1/responses/<string:response_id>", methods=["GET", "DELETE"])
    async def stored_response(self, request: IRequest, response_id: str) -> bytes:
        return await self.stored.response(request, response_id)

    @app.route("/v1/responses/<string:response_id>/input_items", methods=["GET"])
    async def stored_input_items(self, request: IRequest, response_id: str) -> bytes:
        return await self.stored.input_items(request, response_id)

    def _model_object(self, model: str) -> dict[str, Any]:
        return {
            "id": model,
            "object": "model",
            "created": self.created,
            "owned_by": "llmgw",
        }

    def _key_for(self, request: IRequest) -> Key | None:
        return request_key(self.auth, request)

    def _visible(self, key: Key | None, model: str) -> bool:
        return key is None or key.allows(model, self._resolve)

    @app.route("/v1/models", methods=["GET"])
    def list_models(self, request: IRequest) -> bytes:
        try:
            key = self._key_for(request)
        except APIError as error:
            return self._error(request, error)
        request.setHeader(b"content-type", JSON)
        return json.dumps(
            {
                "object": "list",
                "data": [
                    self._model_object(m)
                    for m in self.models()
                    if self._visible(key, m)
                ],
            }
        ).encode("utf-8")

    @app.route("/v1/models/<path:model>", methods=["GET"])
    def get_model(self, request: IRequest, model: str) -> bytes:
        try:
            key = self._key_for(request)
        except APIError as error:
            return self._error(request, error)
        if not self.knows(model) or not self._visible(key, model):
            return self._error(request, model_not_found(model))
        request.setHeader(b"content-type", JSON)
        return json.dumps(self._model_object(model)).encode("utf-8")

    @app.route("/healthz", methods=["GET"])
    def healthz(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", JSON)
        return b'{"status":"ok"}'

    @app.route("/readyz", methods=["GET"])
    def readyz(self, request: IRequest) -> bytes:
        """
        Ready when every configured model has a replica not in ejection
        cooldown and as many ready as its C{min_replicas}; the body lists
        the models that have not (C{unavailable}), those below their
        minimum with their counts too (C{below_min_replicas}).
        """
        unavailable = [
            m for m in self.balancer.models() if not self.balancer.available(m)
        ]
        short = [vars(s) for s in self.readiness.below_min]
        unavailable += [s["model"] for s in short if s["model"] not in unavailable]
        ready = bool(self.models()) and not unavailable
        request.setResponseCode(200 if ready else 503)
        request.setHeader(b"content-type", JSON)
        return json.dumps(
            {
                "status": "ready" if ready else "not ready",
                "unavailable": unavailable,
                "below_min_replicas": short,
            }
        ).encode("utf-8")

    @app.handle_errors(NotFound)
    def not_found(self, request: IRequest, failure: Failure) -> bytes:
        path = request.path.decode("utf-8", "replace")
        return self._error(
            request,
            APIError(
                404, f"Unknown path {path}.", "invalid_request_error", "unknown_url"
            ),
            request.path.startswith(MESSAGES_PATH),
        )

    @app.handle_errors(MethodNotAllowed)
    def method_not_allowed(self, request: IRequest, failure: Failure) -> bytes:
        method = request.method.decode("ascii", "replace")
        path = request.path.decode("utf-8", "replace")
        allowed = getattr(failure.value, "valid_methods", None)
        if allowed:
            request.setHeader(b"allow", ", ".join(allowed).encode("ascii"))
        return self._error(
            request,
            APIError(
                405,
                f"Method {method} is not allowed on {path}.",
                "invalid_request_error",
                "method_not_allowed",
            ),
            request.path in MESSAGES_PATHS,
        )
