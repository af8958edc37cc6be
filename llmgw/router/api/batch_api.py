"""
The Files and Batches APIs as one Klein app beside the router's
(L{BatchAPI}), and the resource that sends their paths to it and every
other path to the router (L{WithBatches}).  The server and each router of
a tier serve both on the client listener; the routes are in
L{llmgw.router.api.file_routes}, L{llmgw.router.api.batch_routes} and
L{llmgw.router.api.message_batches} (docs/batches.md).
"""

from __future__ import annotations

from typing import Any

from klein import Klein
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from werkzeug.exceptions import MethodNotAllowed, NotFound

from llmgw.router.api.batch_answers import anthropic_answer_error, openai_error
from llmgw.router.api.batch_routes import BatchRoutes
from llmgw.router.api.file_routes import FileRoutes
from llmgw.router.api.message_batches import MessageBatchRoutes
from llmgw.router.errors import APIError

FILES_PATH = b"/v1/files"
BATCHES_PATH = b"/v1/batches"
MESSAGE_BATCHES_PATH = b"/v1/messages/batches"
PATHS = (FILES_PATH, BATCHES_PATH, MESSAGE_BATCHES_PATH)
"""
The paths, and those under them, that L{WithBatches} sends to L{BatchAPI}.
"""


def upload_paths(max_file_size: int) -> dict[bytes, int]:
    """
    @param max_file_size: C{[batches] max_file_size}, bytes.
    @return: the POST paths whose body may pass C{[router] max_body_size},
        each to its own limit (L{llmgw.router.edge.site.make_site}): a
        file's upload, and an Anthropic batch's requests, which come
        inline.
    """
    return {FILES_PATH: max_file_size, MESSAGE_BATCHES_PATH: max_file_size}


def _ours(path: bytes) -> bool:
    return any(path == p or path.startswith(p + b"/") for p in PATHS)


class BatchAPI:
    """
    The Files, Batches and Message Batches routes.

    @param files: the Files API's handlers.
    @param batches: the Batches API's.
    @param messages: Anthropic's Message Batches'.
    """

    app = Klein()
    app.url_map.merge_slashes = False

    def __init__(
        self, files: FileRoutes, batches: BatchRoutes, messages: MessageBatchRoutes
    ) -> None:
        self.files = files
        self.batches = batches
        self.messages = messages

    def resource(self) -> IResource:
        """
        @return: the routes as a resource.
        """
        return self.app.resource()

    @app.route("/v1/files", methods=["POST"])
    async def upload(self, request: IRequest) -> bytes:
        return await self.files.create(request)

    @app.route("/v1/files", methods=["GET"])
    async def list_files(self, request: IRequest) -> bytes:
        return await self.files.listing(request)

    @app.route("/v1/files/<string:file_id>", methods=["GET", "DELETE"])
    async def one_file(self, request: IRequest, file_id: str) -> bytes:
        return await self.files.retrieve(request, file_id)

    @app.route("/v1/files/<string:file_id>/content", methods=["GET"])
    async def file_content(self, request: IRequest, file_id: str) -> bytes:
        return await self.files.content(request, file_id)

    @app.route("/v1/batches", methods=["POST"])
    async def create_batch(self, request: IRequest) -> bytes:
        return await self.batches.create(request)

    @app.route("/v1/batches", methods=["GET"])
    async def list_batches(self, request: IRequest) -> bytes:
        return await self.batches.listing(request)

    @app.route("/v1/batches/<string:batch_id>", methods=["GET"])
    async def one_batch(self, request: IRequest, batch_id: str) -> bytes:
        return await self.batches.retrieve(request, batch_id)

    @app.route("/v1/batches/<string:batch_id>/cancel", methods=["POST"])
    async def cancel_batch(self, request: IRequest, batch_id: str) -> bytes:
        return await self.batches.cancel(request, batch_id)

    @app.route("/v1/messages/batches", methods=["POST"])
    async def create_message_batch(self, request: IRequest) -> bytes:
        return await self.messages.create(request)

    @app.route("/v1/messages/batches", methods=["GET"])
    async def list_message_batches(self, request: IRequest) -> bytes:
        return await self.messages.listing(request)

    @app.route("/v1/messages/batches/<string:batch_id>", methods=["GET", "DELETE"])
    async def one_message_batch(self, request: IRequest, batch_id: str) -> bytes:
        return await self.messages.retrieve(request, batch_id)

    @app.route("/v1/messages/batches/<string:batch_id>/cancel", methods=["POST"])
    async def cancel_message_batch(self, request: IRequest, batch_id: str) -> bytes:
        return await self.messages.cancel(request, batch_id)

    @app.route("/v1/messages/batches/<string:batch_id>/results", methods=["GET"])
    async def message_batch_results(self, request: IRequest, batch_id: str) -> bytes:
        return await self.messages.results(request, batch_id)

    def _refused(self, request: IRequest, error: APIError) -> bytes:
        if request.path.startswith(MESSAGE_BATCHES_PATH):
            return anthropic_answer_error(request, error)
        return openai_error(request, error)

    @app.handle_errors(NotFound)
    def not_found(self, request: IRequest, failure: Failure) -> bytes:
        path = request.path.decode("utf-8", "replace")
        error = APIError(
            404, f"Unknown path {path}.", "invalid_request_error", "unknown_url"
        )
        return self._refused(request, error)

    @app.handle_errors(MethodNotAllowed)
    def method_not_allowed(self, request: IRequest, failure: Failure) -> bytes:
        method = request.method.decode("ascii", "replace")
        path = request.path.decode("utf-8", "replace")
        allowed = getattr(failure.value, "valid_methods", None)
        if allowed:
            request.setHeader(b"allow", ", ".join(allowed).encode("ascii"))
        error = APIError(
            405,
            f"Method {method} is not allowed on {path}.",
            "invalid_request_error",
            "method_not_allowed",
        )
        return self._refused(request, error)


class WithBatches(Resource):
    """
    The client API with the Files and Batches APIs: requests on L{PATHS}
    go to C{batches}, every other to C{inner}, as before.
    """

    isLeaf = True

    def __init__(self, inner: IResource, batches: IResource) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._inner = inner
        self._batches = batches

    def render(self, request: IRequest) -> Any:
        if _ours(request.path):
            return self._batches.render(request)
        return self._inner.render(request)


__all__ = ["PATHS", "BatchAPI", "WithBatches", "upload_paths"]
