"""
The forwarding routes without Klein: a POST to one of the paths the router
forwards to replicas goes straight to its handler; every other request goes
to the Klein resource, as before.

Klein binds a werkzeug URL map, matches the path through it and wraps the
handler in three Deferreds for every request: on C{bench/router_bench.py}'s
load that was a tenth of the router's CPU per request (cProfile), for paths
a dictionary lookup finds.  What Klein does that matters here is kept: the
handler's result is written and the request finished, the handler is
cancelled when the client goes away, and a failure that escapes it is logged
and answered with a 500 error object.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from llmgw.router.api.anthropic import MESSAGES_PATHS
from llmgw.router.edge.site import JSON
from llmgw.router.errors import APIError, anthropic_error

Handler = Callable[[IRequest, bytes], Coroutine[Any, Any, bytes | None]]
"""
A forwarding handler: the request and the path to forward to; returns the
body to write, or L{None} when it wrote the answer itself.
"""


class ForwardingRoutes(Resource):
    """
    @param handler: serves each POST to a path of C{paths}.
    @param paths: the request paths taken here (exact bytes, as the client
        sent them), each to the upstream path it forwards to.
    @param fallback: every other request (Klein's resource).
    """

    isLeaf = True
    log = Logger()

    def __init__(
        self, handler: Handler, paths: Mapping[bytes, bytes], fallback: IResource
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._handler = handler
        self._paths = paths
        self._fallback = fallback

    def render(self, request: IRequest) -> Any:
        path = self._paths.get(request.path) if request.method == b"POST" else None
        if path is None:
            return self._fallback.render(request)
        finished = False

        def on_finish(result: object) -> None:
            nonlocal finished
            finished = True

        def on_gone(reason: Failure) -> None:
            on_finish(reason)
            answer.cancel()

        answer: Deferred[bytes | None] = Deferred.fromCoroutine(
            self._handler(request, path)
        )
        request.notifyFinish().addCallbacks(on_finish, on_gone)  # type: ignore[attr-defined]

        def write(body: bytes | None) -> None:
            if finished:
                return
            if body:
                request.write(body)
            request.finish()

        def failed(reason: Failure) -> None:
            if reason.check(CancelledError) and finished:
                return
            self.log.failure("unhandled error in {path}", reason, path=path)
            if not finished:
                # An error object, OpenAI's or Anthropic's as the handler's
                # own failures are (twisted.web's processingFailed answers
                # in HTML).
                error = APIError(500, "Internal error in the gateway.", "api_error")
                body = (
                    anthropic_error(error)[1]
                    if path in MESSAGES_PATHS
                    else error.body()
                )
                request.setResponseCode(500)
                request.setHeader(b"content-type", JSON)
                request.write(body)
                request.finish()

        answer.addCallbacks(write, failed)
        return NOT_DONE_YET
