"""
One client request's journey to the replicas and back: the wait for a replica
to start, the attempts on replicas and the retries between them, and the
answer, whole or relayed as a stream.  Orchestration only: the body was
prepared (L{llmgw.router.api.prepare}), keys are checked and usage is accounted by
the routes (L{llmgw.router.api.app}).

L{Services} is re-exported here for the routes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.web.iweb import IRequest, IResponse

from llmgw.router.api.failures import AnswerTooLarge, Retry, engine_dead, failure_type
from llmgw.router.api.prepare import Prepared
from llmgw.router.api.services import Services
from llmgw.router.api.waiting import Waits
from llmgw.router.edge.site import JSON, client_gone
from llmgw.router.errors import (
    APIError,
    deadline_exceeded,
    engine_error,
    engine_failure,
    no_ready_replica,
    replica_unavailable,
    retry_after,
    upstream_failed,
)
from llmgw.router.interfaces import Tenant
from llmgw.router.routing.balancer import Replica
from llmgw.router.routing.decision import candidates
from llmgw.router.routing.ejection import outcome
from llmgw.router.routing.fairness import ANONYMOUS, is_batch
from llmgw.router.routing.gpu_share import NO_GPU
from llmgw.router.telemetry.tracing import NO_TRACE, NoTrace, error_type
from llmgw.router.upstream.backpressure import Backpressure, abort_client, unsent_bytes
from llmgw.router.upstream.base import (
    BadAnswer,
    BodyReader,
    NoAnswer,
    UpstreamConnectError,
    log_engine_failure,
    refused_answer,
    upstream_headers,
)
from llmgw.router.upstream.deadlines import Deadlines, first_byte_seconds
from llmgw.router.upstream.relay import StreamCut, answer_usage
from llmgw.router.upstream.sse import EventTooLarge

__all__ = ["Exchange", "Services"]

SSE_HEADERS = (
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)


class Exchange:
    """
    One prepared request, from its first attempt to its last byte.

    What it saw is read by the routes and the request's record
    (L{llmgw.router.api.records}) and written by its own methods only.

    @param tenant: whose request it is, for the waits
        (L{llmgw.router.api.waiting}); anonymous by default.
    @param explain: whether the log line carries the candidates each
        attempt chose among.
    @param trace: its spans (L{llmgw.router.telemetry.tracing}), by default none.
    @ivar status: the status answered (200 for a stream, also when it ended
        with an error event that was not a deadline).
    @ivar replica: the replica tried last, or L{None}.
    @ivar usage: the engine's usage object, when one came.
    @ivar first_byte_at: clock time of the replica's first byte, or L{None}.
    @ivar answer_status: the status of the replica's answer, once its
        headers came, or L{None}.
    @ivar events_relayed: C{data:} fields written to the client.
    @ivar headers_sent: whether the client got any byte of the answer.
    @ivar done: whether the stream's last event relayed was C{[DONE]}.
    @ivar finished: whether a choice of the stream finished (vLLM ends one
        its dead engine broke with an error event and C{[DONE]}).
    @ivar candidates: the candidates of the last attempt, when C{explain}.
    @ivar gpu: its share of its replicas' GPU time and its price, over
        its attempts (L{llmgw.router.routing.gpu_share}).
    """

    def __init__(
        self,
        services: Services,
        request: IRequest,
        path: bytes,
        prepared: Prepared,
        request_id: bytes,
        upstream_id: bytes,
        tenant: Tenant = ANONYMOUS,
        explain: bool = False,
        trace: NoTrace = NO_TRACE,
    ) -> None:
        self.services = services
        self.request = request
        self.path = path
        self.prepared = prepared
        self.request_id = request_id
        self.upstream_id = upstream_id
        settings = services.settings
        self._deadlines = deadlines = Deadlines(
            services.clock,
            self._cancel_waiting,
            settings.connect_timeout,
            first_byte_seconds(
                settings.first_byte_timeout,
                prepared.estimate,
                0 if prepared.stream else prepared.max_tokens,
            ),
            settings.idle_timeout,
            settings.total_timeout,
        )
        self.model = model = prepared.model
        self._trace = trace
        self._explain = explain
        self._waits = Waits(services, request, deadlines, model, tenant, trace)
        self._batch = is_batch(tenant)  # counted apart on its replica
        self.status = 200
        self.replica: Replica | None = None
        self.usage: dict[str, Any] | None = None
        self.first_byte_at: float | None = None
        self.answer_status: int | None = None
        self.events_relayed = 0
        self.headers_sent = False
        self.done = False
        self.finished = False
        self.candidates: list[dict[str, Any]] | None = None
        self.gpu = NO_GPU
        self._stale_retried = False
        # What an attempt awaits now (the replica's head, then its body),
        # for a deadline or a cut to cancel.
        self._waiting: Deferred[Any] | None = None
        self._reader: BodyReader | None = None
        self._cut_reason: str | None = None
        self._native = False  # a Messages API request sent as it came
        self._sent = 0.0  # clock time the last attempt was sent
        self._failure: str | None = None  # the last attempt's error.type

    def _cancel_waiting(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
        else:  # an activation, if any: attempts come after it
            self._waits.cancel()

    def _got_bytes(self) -> None:
        if self.first_byte_at is None:
            self.first_byte_at = self.services.clock.seconds()
            self._replica_took(self._sent)
            self._deadlines.start("idle")
        else:
            self._deadlines.touch()

    async def run(self) -> bytes | None:
        """
        Serve the request.

        @return: the response body, or L{None} when already written.
        @raise APIError: for a failure to answer as an error object.
        """
        services = self.services
        self._deadlines.start_total()
        tried: set[str] = set()
        last_error: APIError | None = None
        balancer = services.balancer
        clock = services.clock.seconds
        activator = services.activator
        waits = self._waits
        if activator is not None:
            activator.touch(self.model)
            if not balancer.serves(self.model) and activator.resolve(self.model):
                keepalive = self.keepalive if self.prepared.stream else None
                activating = waits.activate(activator, keepalive)
                await self._trace.step("activation", activating, self._error_type)
        await waits.turn(self.prepared.reserve)
        stale: Replica | None = None
        for attempt in range(services.settings.max_retries + 1):
            if self._deadlines.expired:
                # The total deadline passed between two attempts.
                raise self._deadlines.error()
            replica = balancer.pick(self.model, tried, self.prepared.affinity)
            if replica is None and stale is not None:  # none other left
                tried.discard(stale.id)
                replica = balancer.pick(self.model, tried, self.prepared.affinity)
            if replica is None:
                break
            if self._explain:
                self.candidates = candidates(
                    balancer, self.model, self.prepared.affinity, replica, clock()
                )
            if attempt:
                services.metrics.retries.labels(self.model).inc()
            tried.add(replica.id)
            self.replica = replica
            mark = replica.enter(clock(), self._batch)
            replica.exchanges.add(self.cut)
            self.answer_status = None
            try:
                return await self._trace.attempt(
                    replica.id, self._attempt(replica), attempt, self._error_type
                )
            except Retry as retry:
                last_error = retry.error
                stale = replica if retry.stale else None
            finally:
                self.gpu = self.gpu + replica.leave(clock(), mark, self._batch)
                replica.exchanges.discard(self.cut)
                gone, expired = client_gone(self.request), bool(self._deadlines.expired)
                balancer.report(replica, outcome(self.answer_status, expired, gone))
        raise last_error if last_error is not None else no_ready_replica(self.model)

    def _error_type(self, error: BaseException | None) -> str | None:
        # A span's; none for a stream relayed to its end, whoever closed.
        gone, expired = client_gone(self.request), bool(self._deadlines.expired)
        return None if self.done else error_type(error, gone, expired, self._failure)

    def cut(self, why: str) -> None:
        """
        The replica went away (L{Balancer.cut}): stop waiting for it now.
        Before its answer began the request may go to another replica; a
        stream already relayed ends with an SSE error event.

        @param why: the reason, for the client.
        """
        self._cut_reason = why
        self._cancel_waiting()

    def _cut_error(self) -> APIError | None:
        why, self._cut_reason = self._cut_reason, None
        if why is None:
            return None
        self.services.metrics.upstream_errors.labels("broken").inc()
        return upstream_failed(f"The replica went away: {why}.")

    def keepalive(self, line: bytes) -> None:
        """
        Write an SSE comment line C{line} while the request waits (the
        stream's headers first).
        """
        if client_gone(self.request):
            return
        if not self.headers_sent:
            self.request.setResponseCode(200)
            for name, value in SSE_HEADERS:
                self.request.setHeader(name, value)
        self._write(line)

    def served(self, tokens: int) -> None:
        """
        The request ended having been served C{tokens} (prompt and
        completion): counted to its tenant's share where requests wait
        (L{llmgw.router.routing.fairness}), less what was counted when it went on.
        """
        self._waits.served(tokens)

    def finish(self) -> None:
        """
        Release timers and the upstream connection; called however the
        request ended.
        """
        self._deadlines.stop()
        if self._reader is not None:
            self._reader.abort()

    async def _attempt(self, replica: Replica) -> bytes | None:
        services = self.services
        metrics = services.metrics
        self._failure = None
        self._deadlines.start("first_byte")
        endpoint = replica.endpoint
        accept = self.request.getHeader(b"accept")
        headers = upstream_headers(accept, self.upstream_id, endpoint.api_key)
        headers += self._trace.headers()
        # Once a kept connection was found closed, the others may be too.
        fresh = self._stale_retried
        path, body, self._native = self.prepared.for_replica(self.path, endpoint)
        # An adapter's first request on a replica loads it there first.
        self._waiting = services.adapters.post(
            replica, self.model, path, headers, body, fresh=fresh
        )
        sent = self._sent = services.clock.seconds()
        try:
            response = await self._waiting
        except Exception as e:
            if client_gone(self.request):
                raise
            self._failure = failure_type(e, self._deadlines.expired, self._cut_reason)
            if isinstance(e, UpstreamConnectError):
                self._not_connected(replica, e)
            self._broken(replica, e)
        finally:
            self._waiting = None
        status: int = response.code
        self.answer_status = status
        self._replica_took(sent)
        content_type = response.headers.getRawHeaders(b"content-type", [b""])[0]
        if (
            status == 200
            and self.prepared.stream
            and content_type.startswith(b"text/event-stream")
        ):
            relaying = self._relay_stream(response)
            await self._trace.step("relay", relaying, self._error_type)
            return None
        body = await self._read_whole(response)
        self._replica_took(sent)
        self._failure = str(status) if status >= 400 else None
        wait = retry_after(response.headers)
        dead = engine_dead(status, body)
        if status == 503 or dead:
            metrics.upstream_errors.labels("status").inc()
            log_engine_failure(services.log, self.request_id, replica.id, status, body)
            if dead:  # out of rotation until its agent replaces it
                services.balancer.eject(replica)
            raise Retry(replica_unavailable(wait))
        return self._answer_whole(status, content_type, body, wait)

    def _replica_took(self, sent: float) -> None:
        # For Server-Timing (llmgw.router.edge.timing), on the request.
        took = self.services.clock.seconds() - sent
        setattr(self.request, "replica_seconds", took)  # noqa: B010

    def _not_connected(self, replica: Replica, e: UpstreamConnectError) -> NoReturn:
        """
        @raise APIError: the request's deadline passed.
        @raise Retry: on another replica, C{replica} ejected.
        """
        services = self.services
        if self._deadlines.expired:
            raise self._deadlines.error() from None
        services.balancer.eject(replica)
        services.metrics.upstream_errors.labels("connect").inc()
        services.log.warn(
            "request {request_id}: cannot connect to replica {replica}: {reason}",
            request_id=self.request_id.decode("ascii"),
            replica=replica.id,
            reason=str(e),
        )
        if e.timed_out:
            raise Retry(
                deadline_exceeded("connect", services.settings.connect_timeout)
            ) from None
        raise Retry(
            upstream_failed(f"Could not connect to a replica of model {self.model!r}.")
        ) from None

    def _broken(self, replica: Replica, e: Exception) -> NoReturn:
        """
        The replica broke before its answer's head, or timed out.

        @raise APIError: the deadline passed, or the replica broke (and sits
            out unless the break was on a kept connection).
        @raise Retry: the request was cut for a reason worth a retry, or
            a kept connection was found closed (once per request).
        """
        services = self.services
        metrics = services.metrics
        if self._deadlines.expired:
            metrics.upstream_errors.labels("timeout").inc()
            raise self._deadlines.error() from None
        gone = self._cut_error()
        if gone is not None:
            raise Retry(gone) from None
        metrics.upstream_errors.labels("broken").inc()
        if isinstance(e, BadAnswer):
            raise self._refused(replica, e) from None
        error = upstream_failed("The replica closed the connection before answering.")
        if isinstance(e, NoAnswer):
            if e.reused and not self._stale_retried:
                # No byte of an answer on a connection taken from the
                # pool: most likely one the engine closed (or died on)
                # while it sat idle.  Another replica gets the request,
                # once (this one, on a new connection, if no other is
                # left).  On a new connection the engine had the request
                # and broke: that is not retried (a prompt that crashes
                # engines must not crash them all), and the replica
                # sits out.
                self._stale_retried = True
                services.log.warn(
                    "request {request_id}: replica {replica} closed a pooled"
                    " connection before answering; trying again",
                    request_id=self.request_id.decode("ascii"),
                    replica=replica.id,
                )
                raise Retry(error, stale=True) from None
            services.balancer.eject(replica)
        raise error from None

    def _refused(self, replica: Replica | None, e: Exception) -> APIError:
        assert replica is not None
        return refused_answer(
            self.services.log, self.request_id, replica.id, replica.endpoint.url, e
        )

    async def _read_whole(self, response: IResponse) -> bytes:
        chunks: list[bytes] = []
        size = 0
        limit = self.services.settings.max_response_size

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
        response: IResponse,
        on_data: Callable[[bytes], None],
        broken: str,
        relay: bool = False,
    ) -> None:
        """
        Hand the replica's body to C{on_data} chunk by chunk until it ends.

        @param on_data: called with each chunk, bytes.
        @param broken: the message if the replica breaks the exchange.
        @param relay: whether C{on_data} writes to the client; then the
            replica's connection is paused while the client's is full, so a
            slow reader holds back the engine instead of filling memory.
        @raise APIError: a deadline passed (504), the answer passed a limit
            or the exchange broke (502).
        """
        self._reader = reader = BodyReader(on_data)
        response.deliverBody(reader)
        request = self.request
        metrics = self.services.metrics
        producing = False
        backpressure: Backpressure | None = None
        if relay and reader.transport is not None:
            channel = getattr(request, "channel", None)
            backpressure = Backpressure(
                self.services.clock,
                IPushProducer(reader.transport),
                self._deadlines,
                self.services.settings.client_stall_timeout,
                lambda: unsent_bytes(channel),
                self._client_stalled,
            )
            request.registerProducer(backpressure, True)  # type: ignore[attr-defined]
            producing = True
        self._waiting = reader.done
        try:
            await reader.done
        except (AnswerTooLarge, EventTooLarge) as e:
            self._failure = failure_type(e)
            metrics.upstream_errors.labels("broken").inc()
            raise self._refused(self.replica, e) from None
        except Exception as e:
            if client_gone(request):
                raise
            self._failure = failure_type(e, self._deadlines.expired, self._cut_reason)
            if self._deadlines.expired:
                metrics.upstream_errors.labels("timeout").inc()
                raise self._deadlines.error() from None
            gone = self._cut_error()
            if gone is not None:
                raise gone from None
            metrics.upstream_errors.labels("broken").inc()
            if isinstance(e, BadAnswer):
                raise self._refused(self.replica, e) from None
            raise upstream_failed(broken) from None
        finally:
            self._waiting = None
            self._reader = None
            if backpressure is not None:
                backpressure.stop()
            if producing and not client_gone(request):
                request.unregisterProducer()  # type: ignore[attr-defined]

    def _client_stalled(self) -> None:
        # The client read nothing for client_stall_timeout while it held
        # the replica back: its fault, not the replica's.  Once cut, the
        # request ends as for any client that left (499, usage estimated).
        self.services.log.warn(
            "request {request_id}: client {client} read nothing for"
            " {seconds:g}s; closing its connection (the replica was not late)",
            request_id=self.request_id.decode("ascii"),
            client=abort_client(self.request),
            seconds=self.services.settings.client_stall_timeout,
        )

    def _answer_whole(
        self, status: int, content_type: bytes, body: bytes, wait: int | None
    ) -> bytes:
        if 200 <= status < 300:
            call = self.prepared.call
            if call is not None:
                body, self.usage = call.whole(body, self._native)
                content_type = JSON
            elif content_type.startswith(JSON):
                self.usage = answer_usage(body)
            self.status = status
            self.request.setResponseCode(status)
            self.request.setHeader(b"content-type", content_type or JSON)
            self.request.setHeader(b"content-length", b"%d" % len(body))
            return body
        if 400 <= status < 500:
            # The engine's verdict on the request (bad parameters, context
            # too long, rate limit): the client needs its message, in
            # OpenAI's shape whatever shape the engine used.
            raise engine_error(status, body, wait)
        self.services.metrics.upstream_errors.labels("status").inc()
        replica = self.replica.id if self.replica is not None else None
        log_engine_failure(self.services.log, self.request_id, replica, status, body)
        if 500 <= status < 600:
            # The engine's own error object (vLLM's 500 on an internal
            # error): the client gets its status and message; a broken
            # answer (no such object) stays a 502.
            passed = engine_failure(status, content_type, body, wait)
            if passed is not None:
                raise passed
        raise upstream_failed(f"The replica answered with status {status}.")

    async def _relay_stream(self, response: IResponse) -> None:
        request = self.request
        self.status = 200
        if not self.headers_sent:
            request.setResponseCode(200)
            for name, value in SSE_HEADERS:
                request.setHeader(name, value)
        size = self.services.settings.max_event_size
        relay = self.prepared.relay(size, self.path, self._native)
        write = self._write
        got_bytes = self._got_bytes
        touch = self._deadlines.touch
        feed = relay.feed

        def on_data(data: bytes) -> None:
            # Per chunk of every stream: the idle deadline restarts with one
            # call once the first byte has been seen.
            if self.first_byte_at is None:
                got_bytes()
            else:
                touch()
            out = feed(data)
            if out:
                write(out)

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
            request.write(self.prepared.error_event(error))
            return
        finally:
            # Counted however the stream ended (a client that left too).
            self.usage, self.done = relay.usage, relay.done
            self.finished = relay.finished
        try:
            rest = relay.end()
        except StreamCut as e:
            self._failure = failure_type(e)
            if e.rest:
                self._write(e.rest)
            cut = upstream_failed(str(e))
            self.services.metrics.upstream_errors.labels("broken").inc()
            self.status = cut.status
            self._write(self.prepared.error_event(cut))
            return
        if rest:
            self._write(rest)

    def _write(self, data: bytes) -> None:
        self.headers_sent = True
        self.events_relayed += data.count(b"data:")
        self.request.write(data)
