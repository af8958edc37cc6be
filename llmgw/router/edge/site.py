"""
The router's listening side: the L{Site} whose requests cap their body size,
and the request ids every answer carries.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from twisted.internet.interfaces import IReactorTime
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

from llmgw.router.edge.connections import EdgeSite
from llmgw.router.edge.cors import Cors
from llmgw.router.edge.timing import server_timing
from llmgw.router.errors import bad_request, reason_phrase
from llmgw.router.settings import RouterConfig

JSON = b"application/json"
"""
The content type of the router's own answers.
"""


class LimitedRequest(Request):
    """
    A request that keeps at most C{max_body_size} bytes of its body, so an
    oversized upload costs no memory and is answered with a 413 after it is
    read (answering before would reset clients still sending).

    @cvar upload_limits: the POST paths whose body has a limit of its own
        in place of C{max_body_size}, bytes (a file's upload).
    @ivar body_too_large: whether the body passed its limit; its bytes
        were dropped.
    @ivar request_id: the request's X-Request-ID, set when it is processed.
    @ivar ids: its ids (L{RequestIds}), set when it is processed.
    @ivar cors: the cross-origin policy whose headers every answer
        carries, or L{None}.
    @ivar clock: the reactor's clock, for C{Server-Timing}.
    @ivar arrived: clock time the request was processed.
    @ivar replica_seconds: seconds the replica that answered took
        (L{llmgw.router.edge.timing}), set by the exchange, or L{None}.
    @ivar batch_line: the batch line the request is, vouched for by the
        batches' runner on its own listener (L{llmgw.router.edge.internal});
        L{None} on the client listener, whatever its headers say.
    """

    max_body_size = 32 * 1024 * 1024
    upload_limits: Mapping[bytes, int] = {}
    body_too_large = False
    _received = 0
    _limit: int | None = None
    request_id = b""
    ids: RequestIds | None = None
    cors: Cors | None = None
    clock: IReactorTime | None = None
    arrived = 0.0
    replica_seconds: float | None = None
    batch_line: BatchLineId | None = None

    def process(self) -> None:
        # Every answer carries X-Request-ID, errors from routing included.
        if self.clock is not None:
            self.arrived = self.clock.seconds()
        self.ids = request_ids(self)
        self.request_id = self.ids.header
        self.setHeader(b"x-request-id", self.request_id)  # type: ignore[no-untyped-call]
        try:
            path = unquote_to_bytes(self.path).decode("utf-8")
        except UnicodeDecodeError:
            # Klein would answer in HTML and log a traceback.
            error = bad_request("The URL path is not valid UTF-8.")
            self.setResponseCode(400)
            self.setHeader(b"content-type", JSON)  # type: ignore[no-untyped-call]
            self.write(error.body())
            self.finish()  # type: ignore[no-untyped-call]
            return
        if self.cors is not None and self._cors(path):
            return
        super().process()  # type: ignore[no-untyped-call]

    def _cors(self, path: str) -> bool:
        """
        Add the CORS headers, on every answer, errors included (a script
        must be able to read a 401), and answer a preflight.

        @return: whether the request was answered (a preflight).
        """
        assert self.cors is not None
        origin = self.getHeader(b"origin")
        for name, value in self.cors.answer_headers(origin):
            self.setHeader(name, value)  # type: ignore[no-untyped-call]
        if self.method != b"OPTIONS":
            return False
        preflight = self.cors.preflight(
            path,
            origin,
            self.getHeader(b"access-control-request-method"),
            self.getHeader(b"access-control-request-headers"),
        )
        if preflight is None:
            return False
        for name, value in preflight:
            self.setHeader(name, value)  # type: ignore[no-untyped-call]
        self.setResponseCode(204)
        self.finish()  # type: ignore[no-untyped-call]
        return True

    def write(self, data: bytes) -> None:
        # Every answer carries Server-Timing: set as its head goes out.
        if not self.startedWriting and self.clock is not None:
            total = self.clock.seconds() - self.arrived
            self.setHeader(  # type: ignore[no-untyped-call]
                b"server-timing", server_timing(total, self.replica_seconds)
            )
        super().write(data)  # type: ignore[no-untyped-call]

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        # twisted.web would send "429 Unknown Status".
        super().setResponseCode(
            code, reason_phrase(code) if message is None else message
        )

    def headed(self, method: bytes, target: bytes) -> None:
        """
        The request line's method and target, told by the HTTP/1.1 channel
        (L{llmgw.router.edge.channel}) before the headers: the body's limit
        is the route's.
        """
        path = target.split(b"?", 1)[0]
        self._limit = self.upload_limits.get(path) if method == b"POST" else None
        if self._limit is None:
            self._limit = self.max_body_size

    def body_limit(self) -> int:
        """
        @return: the most bytes this request's body may have: its path's in
            L{upload_limits} for a POST, else C{max_body_size}.  Over
            HTTP/2 the stream (the request's channel) has the method and
            path when the headers came.
        """
        if self._limit is None:
            stream = self.channel
            self.headed(
                getattr(stream, "command", b"") or b"",
                getattr(stream, "path", b"") or b"",
            )
        assert self._limit is not None
        return self._limit

    def gotLength(self, length: int | None) -> None:
        if length is not None and length > self.body_limit():
            self.body_too_large = True
            self.content = io.BytesIO()
        else:
            super().gotLength(length)  # type: ignore[no-untyped-call]

    def handleContentChunk(self, data: bytes) -> None:
        if self.body_too_large:
            return
        self._received += len(data)
        if self._received > self.body_limit():
            self.body_too_large = True
            self.content = io.BytesIO()
            return
        assert self.content is not None
        self.content.write(data)


def make_site(
    resource: IResource,
    settings: RouterConfig,
    reactor: IReactorTime,
    cors: Cors | None = None,
    uploads: Mapping[bytes, int] | None = None,
) -> Site:
    """
    @param settings: the router's settings: C{max_body_size}, bytes of body
        a request may hold, and the bounds of the connection edge (see
        L{llmgw.router.edge.channel}).
    @param reactor: the reactor its connections' deadlines run on.
    @param cors: the cross-origin policy, or L{None} for none.
    @param uploads: POST paths whose body has a limit of its own, bytes
        (L{LimitedRequest.upload_limits}).
    @return: an L{EdgeSite} for C{resource} whose requests are
        L{LimitedRequest}s, without twisted.web's access log (the router
        logs each request itself).
    """

    edge_cors = cors if cors is not None and cors.enabled else None

    class _Request(LimitedRequest):
        max_body_size = settings.max_body_size
        upload_limits = dict(uploads or {})
        clock = reactor
        cors = edge_cors

    # No form parsing: bodies are JSON, and parsing Content-Type through
    # the email package cost 8% of the router's CPU per request.
    site = EdgeSite(
        resource,
        settings,
        reactor,
        requestFactory=_Request,
        parsePOSTFormSubmission=False,
    )
    return site


def client_gone(request: IRequest) -> bool:
    """
    @return: whether the client's connection is gone.  Read from the
        request, which sets it before notifying anyone (Klein cancels the
        handler from such a notification, so a flag set by another would
        come too late).
    """
    return bool(getattr(request, "_disconnected", False))


@dataclass(frozen=True)
class BatchLineId:
    """
    A batch line as the batches' runner sends it to the client API.

    @ivar batch_id: its batch, C{batch_...}.
    @ivar line_no: its line in the batch's input file, from 1.
    @ivar key_id: the key that made the batch, which the line runs as, or
        L{None} for a batch made without keys.
    """

    batch_id: str
    line_no: int
    key_id: int | None

    @property
    def request_id(self) -> bytes:
        """
        The line's own llmgw request id, C{BATCH-LINE}: the same every time
        it runs (after a crash, on another server), its usage record's key.
        """
        return f"{self.batch_id}-{self.line_no}".encode("ascii")


@dataclass(frozen=True)
class RequestIds:
    """
    The ids of one request.

    @ivar own: llmgw's own id of it, made for it alone: the 32 hex digits
        of a random (version 4) UUID, unique across routers and restarts
        with no coordination; its usage record's key, and the id its log
        lines give; ASCII.
    @ivar client: the client's own C{X-Request-ID} when it sent one that
        is at most 200 printable ASCII characters without spaces, else
        L{None}.  Not unique: a retry, or two agents, may send the same.
    @ivar batch: the batch whose line the request is, when the batches'
        runner sent it (L{llmgw.router.edge.internal}); C{own} is then the
        line's own stable id, C{BATCH-LINE}, the same each time the line
        runs, so that its usage record is kept once.
    """

    own: bytes
    client: bytes | None
    batch: str | None = None

    @property
    def header(self) -> bytes:
        """
        The C{X-Request-ID} answered: the client's own, else llmgw's.
        """
        return self.client if self.client is not None else self.own

    @property
    def upstream(self) -> bytes:
        """
        The C{X-Request-ID} sent to the engine: the client's own when it is
        a UUID, else llmgw's (a UUID in hex).  llama-cpp-python's server
        answers any other value with an empty 400 (its starlette-context
        request-id plugin validates UUIDs); vLLM and SGLang take any
        string.  A batch line's is a UUID made from its stable id.
        """
        if self.batch is not None:
            return uuid.uuid5(uuid.NAMESPACE_URL, self.own.decode()).hex.encode()
        if self.client is not None:
            try:
                uuid.UUID(self.client.decode("ascii"))
            except ValueError:
                return self.own
            return self.client
        return self.own


def request_ids(request: IRequest) -> RequestIds:
    """
    @return: the ids of C{request}: those set when the site processed it,
        else new ones (a request not made by L{LimitedRequest}).
    """
    ids = getattr(request, "ids", None)
    if isinstance(ids, RequestIds):
        return ids
    given = request.getHeader(b"x-request-id")
    if not (given and len(given) <= 200 and all(0x21 <= c <= 0x7E for c in given)):
        given = None
    return RequestIds(uuid.uuid4().hex.encode("ascii"), given)
