"""
The data plane: the OpenAI API in front of engine replicas (DESIGN.md §2).
"""

from __future__ import annotations

import io
import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from typing import Protocol as TypingProtocol
from urllib.parse import unquote_to_bytes

from klein import Klein
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import (
    RequestTransmissionFailed,
    ResponseDone,
    ResponseNeverReceived,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IRequest
from twisted.web.server import Request, Site
from werkzeug.exceptions import MethodNotAllowed, NotFound

from llmgw.config import RouterConfig
from llmgw.router.balancer import Balancer, Replica
from llmgw.router.errors import (
    APIError,
    bad_request,
    body_too_large,
    deadline_exceeded,
    model_not_found,
    no_ready_replica,
    upstream_failed,
)
from llmgw.router.metrics import RouterMetrics
from llmgw.router.sse import USAGE_OBJECT, EventTooLarge, SSEParser, usage_of
from llmgw.router.upstream import BytesProducer, UpstreamConnectError

# Paths whose streams follow the chat/completions chunk format, where
# stream_options.include_usage applies (OpenAI API reference).
_USAGE_STREAM_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions"})
_SSE_HEADERS = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)
_JSON = b"application/json"
DEFAULT_RESERVED_COMPLETION = 256
"""
Completion tokens held against a key's budget for a request that sets no
max_tokens, until its real count comes.
"""


@dataclass(frozen=True)
class RequestRecord:
    """
    What one client request used, for usage accounting.

    @ivar latency: seconds from receipt to the last byte.
    @ivar time_to_first_token: seconds from receipt to the first byte of the
        replica's answer; L{None} when none came.
    """

    request_id: str
    upstream_request_id: str
    model: str
    replica: str | None
    status: int
    stream: bool
    prompt_tokens: int
    completion_tokens: int
    latency: float
    time_to_first_token: float | None
    key_id: int | None = None
    key_name: str | None = None
    # The token counts are the router's estimate: the engine's never came.
    usage_estimated: bool = False
    reserved_tokens: int = 0


class Auth(TypingProtocol):
    """
    API keys (L{llmgw.store.keys.KeyRing}).
    """

    def authenticate(self, header: bytes | None) -> Any:
        """
        @return: the key, or L{None} when none is needed and none given.
        @raise APIError: 401.
        """

    def admit(self, key: Any, names: Sequence[str], reserve: int) -> None:
        """
        @param reserve: tokens to hold until L{used}.
        @raise APIError: 403 or 429.
        """

    def used(self, key: Any, tokens: int, reserved: int) -> None:
        """
        Count a finished request's tokens; release its reservation.
        """


class Activator(TypingProtocol):
    """
    Scale from zero: the catalog's names, and a replica started on demand
    (L{llmgw.control.plane.ControlPlane}).
    """

    def resolve(self, name: str) -> str | None:
        """
        @return: the catalog model C{name} names, or L{None}.
        """

    def names(self) -> list[str]:
        """
        @return: every catalog name and alias.
        """

    def activate(self, name: str) -> Deferred[None]:
        """
        @return: fires once a replica of C{name} is ready; cancellable.
        """

    def touch(self, name: str) -> None:
        """
        A request for C{name} arrived (the model is not idle).
        """

    def why_not(self, name: str) -> str:
        """
        @return: why C{name} has no ready replica, for the client, or
            C{""}.
        """


class UsageSink(TypingProtocol):
    """
    Receives one L{RequestRecord} per finished request.
    """

    def record(self, record: RequestRecord) -> None: ...


class LimitedRequest(Request):
    """
    A request that keeps at most C{max_body_size} bytes of its body, so an
    oversized upload costs no memory and is answered with a 413 after it is
    read (answering before would reset clients still sending).
    """

    max_body_size = 32 * 1024 * 1024
    body_too_large = False
    _received = 0
    request_id = b""

    def process(self) -> None:
        # Every answer carries X-Request-ID, errors from routing included.
        self.request_id = _request_id(self)
        self.setHeader(b"x-request-id", self.request_id)  # type: ignore[no-untyped-call]
        try:
            unquote_to_bytes(self.path).decode("utf-8")
        except UnicodeDecodeError:
            # Klein would answer in HTML and log a traceback.
            error = bad_request("The URL path is not valid UTF-8.")
            self.setResponseCode(400)
            self.setHeader(b"content-type", _JSON)  # type: ignore[no-untyped-call]
            self.write(error.body())  # type: ignore[no-untyped-call]
            self.finish()  # type: ignore[no-untyped-call]
            return
        super().process()  # type: ignore[no-untyped-call]

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self.max_body_size:
            self.body_too_large = True
            self.content = io.BytesIO()
        else:
            super().gotLength(length)  # type: ignore[no-untyped-call]

    def handleContentChunk(self, data: bytes) -> None:
        if self.body_too_large:
            return
        self._received += len(data)
        if self._received > self.max_body_size:
            self.body_too_large = True
            self.content = io.BytesIO()
            return
        assert self.content is not None
        self.content.write(data)


def make_site(resource: Any, max_body_size: int) -> Site:
    """
    @return: a L{Site} for C{resource} whose requests hold at most
        C{max_body_size} bytes of body, without twisted.web's access log
        (the router logs each request itself).
    """

    class _Request(LimitedRequest):
        pass

    _Request.max_body_size = max_body_size
    # No form parsing: bodies are JSON, and parsing Content-Type through
    # the email package cost 8% of the router's CPU per request.
    site = Site(resource, requestFactory=_Request, parsePOSTFormSubmission=False)
    site.log = lambda request: None  # type: ignore[method-assign]
    return site


class _BodyReader(Protocol):
    """
    Receives a replica's response body chunk by chunk.  C{done} fires when
    the body ends, fails when the exchange breaks, and cancelling it closes
    the upstream connection, so the engine stops generating.
    """

    def __init__(self, on_data: Callable[[bytes], None]) -> None:
        self._on_data = on_data
        self.done: Deferred[None] = Deferred(self._cancel)
        self.finished = False

    def dataReceived(self, data: bytes) -> None:
        if self.finished:
            return
        try:
            self._on_data(data)
        except Exception:
            # The answer broke a limit (or a bug): end the exchange with it.
            failure = Failure()
            self.abort()
            self.done.errback(failure)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.finished:
            return
        self.finished = True
        if reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(None)
        else:
            self.done.errback(reason)

    def abort(self) -> None:
        """
        Close the upstream connection now, unless the body already ended.
        """
        if not self.finished:
            self.finished = True
            if self.transport is not None:
                # The response's transport is a producer; stopping it closes
                # the connection, so the engine sees the client go.
                IPushProducer(self.transport).stopProducing()

    def _cancel(self, d: Deferred[None]) -> None:
        self.abort()


class AnswerTooLarge(Exception):
    """
    A replica's answer passed a size limit.
    """


class _Retry(Exception):
    """
    This attempt failed before anything reached the client, and another
    replica may be tried.
    """

    def __init__(self, error: APIError) -> None:
        self.error = error


def _request_id(request: IRequest) -> bytes:
    given = request.getHeader(b"x-request-id")
    if given and len(given) <= 200 and all(0x21 <= c <= 0x7E for c in given):
        return bytes(given)
    return os.urandom(16).hex().encode("ascii")


def upstream_request_id(request_id: bytes) -> bytes:
    """
    The X-Request-ID to send to the engine: the request's own when it is a
    UUID, otherwise a new UUID (logged beside the client's).
    llama-cpp-python's server answers any other value with an empty 400
    (its starlette-context request-id plugin validates UUIDs); vLLM and
    SGLang take any string.
    """
    try:
        uuid.UUID(request_id.decode("ascii"))
    except ValueError:
        return os.urandom(16).hex().encode("ascii")
    return request_id


def _loggable(text: str, limit: int = 200) -> str:
    """
    @return: C{text} safe for a log line: at most C{limit} characters,
        control characters and lone surrogates escaped.
    """
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        try:
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:
            pass
    return text.encode("unicode_escape").decode("ascii")


def _retry_after(headers: Headers) -> int | None:
    """
    @return: a C{Retry-After} in whole seconds, when the engine sent one.
    """
    value = headers.getRawHeaders(b"retry-after", [b""])[0]
    return int(value) if value.isdigit() and len(value) < 10 else None


def _engine_error(status: int, body: bytes, retry_after: int | None) -> APIError:
    """
    An engine's 4xx answer as an OpenAI error object.  Engines differ:
    OpenAI's and recent vLLM's C{{"error": {...}}} (vLLM with an integer
    C{code}), older vLLM's top-level C{message}, FastAPI's C{detail}.
    """
    error: dict[str, Any] = {}
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        nested = parsed.get("error")
        error = nested if isinstance(nested, dict) else parsed
    message = _error_message(body) or (
        f"The replica rejected the request with status {status}."
    )
    kind = error.get("type")
    code = error.get("code")
    param = error.get("param")
    default_kind = "rate_limit_error" if status == 429 else "invalid_request_error"
    return APIError(
        status,
        message,
        kind if isinstance(kind, str) and kind else default_kind,
        code if isinstance(code, str) else None,
        param if isinstance(param, str) else None,
        retry_after=retry_after,
    )


def _error_message(body: bytes) -> str | None:
    """
    @return: C{error.message} of an OpenAI-style error body, if it has one.
    """
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])[:1000]
        if isinstance(error, str):
            return error[:1000]
        if isinstance(parsed.get("message"), str):
            return str(parsed["message"])[:1000]
        if isinstance(parsed.get("detail"), str):
            return str(parsed["detail"])[:1000]
    return None


class _Exchange:
    """
    One client request, from its body to its last byte, across the
    replicas tried for it.
    """

    def __init__(self, router: Router, request: IRequest, path: bytes) -> None:
        self.router = router
        self.request = request
        self.path = path
        self.clock = router.clock
        self.settings = router.settings
        self.started = self.clock.seconds()
        self.request_id: bytes = getattr(request, "request_id", None) or _request_id(
            request
        )
        self.upstream_id = upstream_request_id(self.request_id)
        self.model = ""
        self.requested_model = ""
        self.key: Any = None
        self.events_relayed = 0
        self.stale_retried = False
        self.max_tokens = 0
        # Tokens held against the key's budget and tokens per minute while
        # the request runs: its prompt (estimated) and max_tokens.
        self.reserved_tokens = 0
        self.stream = False
        self.strip_usage = False
        self.body = b""
        self.replica: Replica | None = None
        self.status = 200
        self.usage: dict[str, Any] | None = None
        self.first_byte_at: float | None = None
        self.headers_sent = False
        self.expired: str | None = None
        self.waiting: Deferred[Any] | None = None
        self.reader: _BodyReader | None = None
        self.phase_timer: IDelayedCall | None = None
        self.phase_seconds = 0.0
        self.total_timer: IDelayedCall | None = None

    @property
    def client_gone(self) -> bool:
        """
        Whether the client's connection is gone.  Read from the request, which
        sets it before notifying anyone (Klein cancels the handler from such
        a notification, so a flag set by another would come too late).
        """
        return bool(getattr(self.request, "_disconnected", False))

    # Deadlines

    def _start_phase(self, phase: str, seconds: float) -> None:
        if self.phase_timer is not None and self.phase_timer.active():
            self.phase_timer.cancel()
        self.phase_timer = None
        self.phase_seconds = seconds
        if seconds > 0:
            self.phase_timer = self.clock.callLater(seconds, self._expire, phase)

    def _expire(self, phase: str) -> None:
        self.expired = phase
        if self.waiting is not None:
            self.waiting.cancel()

    def _deadline_error(self) -> APIError:
        assert self.expired is not None
        seconds = {
            "total": self.settings.total_timeout,
            "connect": self.settings.connect_timeout,
        }.get(self.expired, self.phase_seconds)
        return deadline_exceeded(self.expired, seconds)

    def _stop_timers(self) -> None:
        for timer in (self.phase_timer, self.total_timer):
            if timer is not None and timer.active():
                timer.cancel()
        self.phase_timer = self.total_timer = None

    def _got_bytes(self) -> None:
        if self.first_byte_at is None:
            self.first_byte_at = self.clock.seconds()
            self._start_phase("idle", self.settings.idle_timeout)
        elif self.phase_timer is not None:
            self.phase_timer.reset(self.phase_seconds)

    # The request

    def _parse(self) -> None:
        request = self.request
        if getattr(request, "body_too_large", False):
            raise body_too_large(self.settings.max_body_size)
        content = request.content
        assert content is not None
        content.seek(0)
        self.body = content.read()
        try:
            payload = json.loads(self.body)
        except ValueError as e:
            raise bad_request(f"The request body is not valid JSON: {e}.") from None
        except RecursionError:
            raise bad_request("The request body is nested too deeply.") from None
        if not isinstance(payload, dict):
            raise bad_request("The request body must be a JSON object.")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request(
                "You must provide a model parameter (a string).", param="model"
            )
        self.model = self.requested_model = model
        limit = next(
            (
                payload[k]
                for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                if isinstance(payload.get(k), int)
                and not isinstance(payload.get(k), bool)
            ),
            DEFAULT_RESERVED_COMPLETION,
        )
        self.max_tokens = min(max(limit, 0), 1_000_000)
        stream = payload.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise bad_request("'stream' must be a boolean.", param="stream")
        self.stream = stream
        if not self.router.knows(model):
            raise model_not_found(model)
        activator = self.router.activator
        canonical = activator.resolve(model) if activator is not None else None
        # The body is written again (once) only when something in it changes
        # other than the usage request of a body without stream_options.
        rewrite = canonical is not None and canonical != model
        if rewrite:
            # An alias: engines serve the catalog name.
            self.model = payload["model"] = str(canonical)
        if stream and self.path in _USAGE_STREAM_PATHS:
            # Ask for usage so it can be accounted, and hide the chunk that
            # carries it from a client that did not ask.
            options = payload.get("stream_options")
            if "stream_options" not in payload and not rewrite:
                self.strip_usage = True
                # The body stays as the client wrote it, with one member
                # more before its closing brace (the body parsed as a JSON
                # object, so it ends with one).
                end = self.body.rstrip().rfind(b"}")
                self.body = (
                    self.body[:end]
                    + b',"stream_options":{"include_usage":true}'
                    + self.body[end:]
                )
            elif options is not None and not isinstance(options, dict):
                raise bad_request(
                    "'stream_options' must be an object.", param="stream_options"
                )
            elif options is None or not options.get("include_usage"):
                payload["stream_options"] = {**(options or {}), "include_usage": True}
                self.strip_usage = True
                rewrite = True
        if rewrite:
            # ASCII escapes: any string JSON can hold encodes, lone
            # surrogates included.
            self.body = json.dumps(payload).encode("ascii")

    async def run(self) -> bytes | None:
        """
        Serve the request.

        @return: the response body, or L{None} when already written.
        @raise APIError: for a failure to answer as an error object.
        """
        self._parse()
        if self.settings.total_timeout > 0:
            self.total_timer = self.clock.callLater(
                self.settings.total_timeout, self._expire, "total"
            )
        if self.key is not None:
            assert self.router.auth is not None
            estimate = len(self.body) // 4 + self.max_tokens
            self.router.auth.admit(
                self.key, (self.requested_model, self.model), estimate
            )
            self.reserved_tokens = estimate
        tried: set[str] = set()
        last_error: APIError | None = None
        balancer = self.router.balancer
        activator = self.router.activator
        if activator is not None:
            activator.touch(self.model)
            if not balancer.serves(self.model) and activator.resolve(self.model):
                await self._activate(activator)
        for attempt in range(self.settings.max_retries + 1):
            if self.expired:
                # The total deadline passed between two attempts.
                raise self._deadline_error()
            replica = balancer.pick(self.model, tried)
            if replica is None:
                break
            if attempt:
                self.router.metrics.retries.labels(self.model).inc()
            tried.add(replica.id)
            self.replica = replica
            replica.outstanding += 1
            try:
                return await self._attempt(replica)
            except _Retry as retry:
                last_error = retry.error
            finally:
                replica.outstanding -= 1
        raise last_error if last_error is not None else no_ready_replica(self.model)

    async def _activate(self, activator: Activator) -> None:
        """
        Wait for the control plane to make a replica of the model ready,
        for at most C{activation_timeout}; a waiting stream gets an SSE
        comment line every C{activation_keepalive}.

        @raise APIError: 503 with C{Retry-After} when the wait is over or
            too many requests already wait for this model.
        """
        router = self.router
        settings = self.settings
        model = self.model
        waiting = router.activating.get(model, 0)
        if waiting >= settings.activation_queue:
            raise APIError(
                503,
                f"Too many requests are waiting for model {model!r} to start;"
                " try again later.",
                "service_unavailable_error",
                "activation_queue_full",
                retry_after=5,
            )
        router.activating[model] = waiting + 1
        timed_out = False

        def time_out() -> None:
            nonlocal timed_out
            timed_out = True
            ready.cancel()

        ready = self.waiting = activator.activate(model)
        timer = (
            self.clock.callLater(settings.activation_timeout, time_out)
            if settings.activation_timeout > 0
            else None
        )
        keepalive: LoopingCall | None = None
        if self.stream and settings.activation_keepalive > 0:
            keepalive = LoopingCall(self._keepalive)
            keepalive.clock = self.clock
            keepalive.start(settings.activation_keepalive, now=False)
        try:
            await ready
        except CancelledError:
            if self.client_gone:
                raise
            if self.expired:
                raise self._deadline_error() from None
            if timed_out:
                why = activator.why_not(model)
                raise APIError(
                    503,
                    f"No replica of model {model!r} became ready within"
                    f" {settings.activation_timeout:g}s"
                    + (f" ({why})" if why else "")
                    + "; try again later.",
                    "service_unavailable_error",
                    "activation_timeout",
                    retry_after=30,
                ) from None
            raise
        finally:
            self.waiting = None
            if timer is not None and timer.active():
                timer.cancel()
            if keepalive is not None and keepalive.running:
                keepalive.stop()
            left = router.activating.get(model, 1) - 1
            if left:
                router.activating[model] = left
            else:
                router.activating.pop(model, None)

    def _keepalive(self) -> None:
        if self.client_gone:
            return
        if not self.headers_sent:
            self.request.setResponseCode(200)
            for name, value in _SSE_HEADERS:
                self.request.setHeader(name, value)
        # A comment line: clients skip it (WHATWG HTML, server-sent events).
        self._write(b": waiting for a replica to start\n\n")

    def finish(self) -> None:
        """
        Release timers and the upstream connection; called however the
        request ended.
        """
        self._stop_timers()
        if self.reader is not None:
            self.reader.abort()

    async def _attempt(self, replica: Replica) -> bytes | None:
        router = self.router
        self._start_phase("first_byte", self.settings.first_byte_timeout)
        headers = Headers(
            {
                b"content-type": [_JSON],
                b"accept": [self.request.getHeader(b"accept") or b"*/*"],
                b"x-request-id": [self.upstream_id],
            }
        )
        self.waiting = router.agent.request(
            b"POST",
            replica.url_bytes + self.path,
            headers,
            BytesProducer(self.body),
        )
        # Agent.request takes its connection from the pool synchronously.
        reused = router.pool is not None and router.pool.last_reused
        try:
            response = await self.waiting
        except UpstreamConnectError as e:
            if self.client_gone:
                raise
            if self.expired:
                raise self._deadline_error() from None
            router.balancer.eject(replica)
            router.metrics.upstream_errors.labels("connect").inc()
            router.log.warn(
                "request {request_id}: cannot connect to replica {replica}: {reason}",
                request_id=self.request_id.decode("ascii"),
                replica=replica.id,
                reason=str(e),
            )
            if e.timed_out:
                raise _Retry(
                    deadline_exceeded("connect", self.settings.connect_timeout)
                ) from None
            raise _Retry(
                upstream_failed(
                    f"Could not connect to a replica of model {self.model!r}."
                )
            ) from None
        except Exception as e:
            if self.client_gone:
                raise
            if self.expired:
                router.metrics.upstream_errors.labels("timeout").inc()
                raise self._deadline_error() from None
            router.metrics.upstream_errors.labels("broken").inc()
            error = upstream_failed(
                "The replica closed the connection before answering."
            )
            never = isinstance(e, (ResponseNeverReceived, RequestTransmissionFailed))
            if never and reused and not self.stale_retried:
                # No byte of an answer on a connection taken from the pool:
                # most likely one the engine closed (or died on) while it
                # sat idle.  Another replica gets the request, once.  On a
                # new connection the engine had the request and broke: that
                # is not retried (a prompt that crashes engines must not
                # crash them all), and the replica sits out.
                self.stale_retried = True
                router.log.warn(
                    "request {request_id}: replica {replica} closed a pooled"
                    " connection before answering; trying another",
                    request_id=self.request_id.decode("ascii"),
                    replica=replica.id,
                )
                raise _Retry(error) from None
            if never:
                router.balancer.eject(replica)
            raise error from None
        finally:
            self.waiting = None
        status: int = response.code
        content_type = response.headers.getRawHeaders(b"content-type", [b""])[0]
        if (
            status == 200
            and self.stream
            and content_type.startswith(b"text/event-stream")
        ):
            await self._relay_stream(response)
            return None
        body = await self._read_whole(response)
        retry_after = _retry_after(response.headers)
        if status == 503:
            router.metrics.upstream_errors.labels("status").inc()
            self._log_engine_failure(status, body)
            raise _Retry(
                APIError(
                    503,
                    "The replica is overloaded or not ready.",
                    "service_unavailable_error",
                    "replica_unavailable",
                    retry_after=retry_after or 1,
                )
            )
        return self._answer_whole(status, content_type, body, retry_after)

    async def _read_whole(self, response: Any) -> bytes:
        chunks: list[bytes] = []

        size = 0
        limit = self.settings.max_response_size

        def on_data(data: bytes) -> None:
            nonlocal size
            self._got_bytes()
            size += len(data)
            if size > limit:
                raise AnswerTooLarge(f"it is over max_response_size, {limit} bytes")
            chunks.append(data)

        if response.length == 0:
            self._got_bytes()
            return b""
        await self._receive_body(
            response,
            on_data,
            "The replica closed the connection in the middle of its answer.",
        )
        return b"".join(chunks)

    async def _receive_body(
        self,
        response: Any,
        on_data: Callable[[bytes], None],
        broken: str,
        relay: bool = False,
    ) -> None:
        """
        Hand the replica's body to C{on_data} chunk by chunk until it ends.

        @param broken: the message if the replica breaks the exchange.
        @param relay: whether C{on_data} writes to the client; then the
            replica's connection is paused while the client's is full, so a
            slow reader holds back the engine instead of filling memory.
        @raise APIError: a deadline passed (504), the answer passed a limit
            or the exchange broke (502).
        """
        self.reader = reader = _BodyReader(on_data)
        response.deliverBody(reader)
        request = self.request
        producing = False
        if relay and reader.transport is not None:
            request.registerProducer(IPushProducer(reader.transport), True)  # type: ignore[attr-defined]
            producing = True
        self.waiting = reader.done
        try:
            await reader.done
        except (AnswerTooLarge, EventTooLarge) as e:
            self.router.metrics.upstream_errors.labels("broken").inc()
            raise upstream_failed(f"The replica's answer was refused: {e}.") from None
        except Exception:
            if self.client_gone:
                raise
            if self.expired:
                self.router.metrics.upstream_errors.labels("timeout").inc()
                raise self._deadline_error() from None
            self.router.metrics.upstream_errors.labels("broken").inc()
            raise upstream_failed(broken) from None
        finally:
            self.waiting = None
            self.reader = None
            if producing and not self.client_gone:
                request.unregisterProducer()  # type: ignore[attr-defined]

    def _answer_whole(
        self, status: int, content_type: bytes, body: bytes, retry_after: int | None
    ) -> bytes:
        if 200 <= status < 300:
            if content_type.startswith(_JSON):
                try:
                    parsed = json.loads(body)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
                    self.usage = parsed["usage"]
            self.status = status
            self.request.setResponseCode(status)
            self.request.setHeader(b"content-type", content_type or _JSON)
            self.request.setHeader(b"content-length", b"%d" % len(body))
            return body
        if 400 <= status < 500:
            # The engine's verdict on the request (bad parameters, context
            # too long, rate limit): the client needs its message, in
            # OpenAI's shape whatever shape the engine used.
            raise _engine_error(status, body, retry_after)
        self.router.metrics.upstream_errors.labels("status").inc()
        self._log_engine_failure(status, body)
        raise upstream_failed(f"The replica answered with status {status}.")

    def _log_engine_failure(self, status: int, body: bytes) -> None:
        # An engine's 5xx message can hold its traceback, file paths and
        # addresses: the operator gets it in the log, the client only the
        # status.
        self.router.log.warn(
            "request {request_id}: replica {replica} answered status {status}:"
            " {message}",
            request_id=self.request_id.decode("ascii"),
            replica=self.replica.id if self.replica is not None else None,
            status=status,
            message=(_error_message(body) or body[:500].decode("utf-8", "replace")),
        )

    async def _relay_stream(self, response: Any) -> None:
        request = self.request
        self.status = 200
        if not self.headers_sent:
            request.setResponseCode(200)
            for name, value in _SSE_HEADERS:
                request.setHeader(name, value)
        parser = SSEParser(self.settings.max_event_size)
        strip = self.strip_usage
        # Only whole events go to the client: the bytes of an event still
        # arriving wait here (stream offsets base..) until it ends.  So a
        # stream that breaks mid-event ends with a clean error event, not
        # with half an event the client cannot parse, and with strip on the
        # usage-only chunk can be left out.  Engines write whole events,
        # which take the path without copies.
        pending = bytearray()
        base = 0

        def on_data(data: bytes) -> None:
            nonlocal base
            self._got_bytes()
            if (
                not pending
                and USAGE_OBJECT.search(data) is None
                and parser.skip_whole(data)
            ):
                # Whole events and no usage among them: nothing to read or
                # hide, so no event needs making.
                base += len(data)
                self._write(data)
                return
            events = parser.feed(data)
            if not pending and events and events[-1].end == base + len(data):
                for event in events:
                    found = usage_of(event.data)
                    if found is not None:
                        self.usage = found[0]
                        if strip and found[1]:
                            break
                else:
                    base += len(data)
                    self._write(data)
                    return
            pending.extend(data)
            emit_from = 0
            event_start = 0
            for event in events:
                event_end = event.end - base
                found = usage_of(event.data)
                if found is not None:
                    self.usage = found[0]
                    if strip and found[1]:
                        if event_start > emit_from:
                            self._write(bytes(pending[emit_from:event_start]))
                        emit_from = event_end
                event_start = event_end
            if event_start > emit_from:
                self._write(bytes(pending[emit_from:event_start]))
            del pending[:event_start]
            base += event_start

        try:
            await self._receive_body(
                response,
                on_data,
                "The replica closed the stream before it ended.",
                relay=True,
            )
        except APIError as error:
            if not self.headers_sent:
                raise
            self.status = error.status
            request.write(error.sse_event())
            return None
        if pending:
            if pending[-1] in (0x0A, 0x0D):  # LF, CR
                # Whole lines without the blank line after the last event:
                # pass on what the engine sent.
                self._write(bytes(pending))
            else:
                # Cut inside a line: a body delimited by the connection's
                # close looks complete however it ended.
                cut = upstream_failed(
                    "The replica's stream ended in the middle of an event."
                )
                self.router.metrics.upstream_errors.labels("broken").inc()
                self.status = cut.status
                self._write(cut.sse_event())
        return None

    def _write(self, data: bytes) -> None:
        self.headers_sent = True
        self.events_relayed += data.count(b"data:")
        self.request.write(data)

    def record(self, status: int) -> RequestRecord:
        usage = self.usage or {}
        # Chat and completions name them so; the Responses API input and
        # output.
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        estimated = False
        if (
            self.usage is None
            and self.replica is not None
            and status in (200, 499)
            and self.body
        ):
            # The engine's count never came (the client left mid-stream, or
            # the engine sends none): estimated, so that leaving early is
            # not free.  About 4 bytes of request per prompt token; one
            # token per event relayed.
            estimated = True
            prompt = len(self.body) // 4
            completion = self.events_relayed
        now = self.clock.seconds()
        return RequestRecord(
            request_id=self.request_id.decode("ascii"),
            upstream_request_id=self.upstream_id.decode("ascii"),
            # A name no replica serves came from the client: it goes to
            # logs cut short and escaped (it could be 32 MiB, or hold
            # newlines and lone surrogates).
            model=(
                self.model if self.router.knows(self.model) else _loggable(self.model)
            ),
            replica=self.replica.id if self.replica is not None else None,
            status=status,
            stream=self.stream,
            prompt_tokens=prompt if isinstance(prompt, int) else 0,
            completion_tokens=completion if isinstance(completion, int) else 0,
            latency=now - self.started,
            time_to_first_token=(
                self.first_byte_at - self.started
                if self.first_byte_at is not None
                else None
            ),
            key_id=self.key.id if self.key is not None else None,
            key_name=self.key.name if self.key is not None else None,
            usage_estimated=estimated,
            reserved_tokens=self.reserved_tokens,
        )


class UsageSinks:
    """
    Hands each record to several sinks.
    """

    def __init__(self, *sinks: UsageSink) -> None:
        self.sinks = sinks

    def record(self, record: RequestRecord) -> None:
        for sink in self.sinks:
            sink.record(record)


class LogUsageSink:
    """
    A L{UsageSink} that writes one log line per request.
    """

    log = Logger()

    def record(self, record: RequestRecord) -> None:
        self.log.info(
            "request {request_id} upstream_id={upstream_request_id} model={model}"
            " replica={replica} key={key} status={status}"
            " prompt_tokens={prompt_tokens} completion_tokens={completion_tokens}"
            " latency={latency:.3f}s",
            request_id=record.request_id,
            upstream_request_id=record.upstream_request_id,
            model=record.model,
            replica=record.replica,
            key=record.key_name,
            status=record.status,
            prompt_tokens=record.prompt_tokens,
            completion_tokens=record.completion_tokens,
            latency=record.latency,
        )


class Router:
    """
    The client-facing OpenAI API.

    @param clock: the reactor's clock, for deadlines.
    @param balancer: the replicas and the choice among them.
    @param agent: the HTTP client for engine traffic (see
        L{llmgw.router.upstream.make_upstream_client}).
    @param settings: deadlines, retries and limits.
    @param metrics: where traffic is counted.
    @param usage: receives a record per finished request.
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
        agent: IAgent,
        settings: RouterConfig,
        metrics: RouterMetrics,
        usage: UsageSink,
        activator: Activator | None = None,
        auth: Auth | None = None,
        pool: Any = None,
    ) -> None:
        self.clock = clock
        self.auth = auth
        # The upstream pool (QuietConnectionPool), to tell a reused
        # connection from a new one.
        self.pool = pool
        self.activator = activator
        # Requests waiting for activation, per model.
        self.activating: dict[str, int] = {}
        self.balancer = balancer
        self.agent = agent
        self.settings = settings
        self.metrics = metrics
        self.usage = usage
        self.created = int(time.time())
        self.in_flight = 0
        self._idle_waiters: list[Deferred[None]] = []

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

    def _error(self, request: IRequest, error: APIError) -> bytes:
        request.setResponseCode(error.status)
        request.setHeader(b"content-type", _JSON)
        if error.retry_after is not None:
            request.setHeader(b"retry-after", str(error.retry_after).encode("ascii"))
        return error.body()

    async def _forward(self, request: IRequest, path: bytes) -> bytes | None:
        exchange = _Exchange(self, request, path)
        metrics = self.metrics
        metrics.in_flight.inc()
        self.in_flight += 1
        status = 500
        try:
            if self.auth is not None:
                exchange.key = self.auth.authenticate(
                    request.getHeader(b"authorization")
                )
            result = await exchange.run()
            status = exchange.status
            return result
        except APIError as error:
            status = error.status
            if exchange.headers_sent:
                # A stream already started (activation's keep-alives):
                # the error goes as its last event.
                request.write(error.sse_event())
                return None
            return self._error(request, error)
        except Exception:
            if exchange.client_gone:
                status = 499  # the client went away (nginx's convention)
                return None
            self.log.failure(
                "request {request_id} failed",
                request_id=exchange.request_id.decode("ascii"),
            )
            return self._error(
                request, APIError(500, "Internal error in the gateway.", "api_error")
            )
        finally:
            exchange.finish()
            metrics.in_flight.dec()
            self.in_flight -= 1
            if self.in_flight == 0 and self._idle_waiters:
                waiters, self._idle_waiters = self._idle_waiters, []
                for waiter in waiters:
                    waiter.callback(None)
            record = exchange.record(status)
            # Only configured names become labels: a client must not be able
            # to grow the metrics without bound by inventing model names.
            known = self.knows(record.model)
            metrics.requests.labels(record.model if known else "", str(status)).inc()
            if known:
                metrics.request_duration.labels(record.model).observe(record.latency)
                if record.time_to_first_token is not None and record.stream:
                    metrics.time_to_first_token.labels(record.model).observe(
                        record.time_to_first_token
                    )
                if record.prompt_tokens:
                    metrics.tokens.labels(record.model, "prompt").inc(
                        record.prompt_tokens
                    )
                if record.completion_tokens:
                    metrics.tokens.labels(record.model, "completion").inc(
                        record.completion_tokens
                    )
            self.usage.record(record)
            if exchange.key is not None and self.auth is not None:
                self.auth.used(
                    exchange.key,
                    record.prompt_tokens + record.completion_tokens,
                    exchange.reserved_tokens,
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

    # Engine endpoints passed through when the engine has them (DESIGN.md §2).
    @app.route("/v1/rerank", methods=["POST"])
    @app.route("/v1/score", methods=["POST"])
    @app.route("/v1/responses", methods=["POST"])
    @app.route("/tokenize", methods=["POST"])
    @app.route("/detokenize", methods=["POST"])
    async def passthrough(self, request: IRequest) -> bytes | None:
        return await self._forward(request, request.path)

    def _model_object(self, model: str) -> dict[str, Any]:
        return {
            "id": model,
            "object": "model",
            "created": self.created,
            "owned_by": "llmgw",
        }

    def _key_for(self, request: IRequest) -> Any:
        if self.auth is None:
            return None
        return self.auth.authenticate(request.getHeader(b"authorization"))

    def _visible(self, key: Any, model: str) -> bool:
        if key is None:
            return True
        resolve = self.activator.resolve if self.activator else (lambda m: None)
        return bool(key.allows(model, resolve))

    @app.route("/v1/models", methods=["GET"])
    def list_models(self, request: IRequest) -> bytes:
        try:
            key = self._key_for(request)
        except APIError as error:
            return self._error(request, error)
        request.setHeader(b"content-type", _JSON)
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
        request.setHeader(b"content-type", _JSON)
        return json.dumps(self._model_object(model)).encode("utf-8")

    @app.route("/healthz", methods=["GET"])
    def healthz(self, request: IRequest) -> bytes:
        request.setHeader(b"content-type", _JSON)
        return b'{"status":"ok"}'

    @app.route("/readyz", methods=["GET"])
    def readyz(self, request: IRequest) -> bytes:
        """
        Ready when every configured model has a replica not in ejection
        cooldown; the body lists the models that have none.
        """
        unavailable = [
            m for m in self.balancer.models() if not self.balancer.available(m)
        ]
        ready = bool(self.models()) and not unavailable
        request.setResponseCode(200 if ready else 503)
        request.setHeader(b"content-type", _JSON)
        return json.dumps(
            {"status": "ready" if ready else "not ready", "unavailable": unavailable}
        ).encode("utf-8")

    @app.handle_errors(NotFound)
    def not_found(self, request: IRequest, failure: Failure) -> bytes:
        path = request.path.decode("utf-8", "replace")
        return self._error(
            request,
            APIError(
                404, f"Unknown path {path}.", "invalid_request_error", "unknown_url"
            ),
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
        )
