"""
The Files API: C{POST /v1/files} (a C{multipart/form-data} upload of
C{file} and C{purpose}), C{GET /v1/files} (a page, newest first by
default), C{GET /v1/files/{id}}, C{GET /v1/files/{id}/content} and
C{DELETE /v1/files/{id}} (OpenAI's API reference, "Files", as the C{openai}
SDK's C{files} resource calls it).

A file is kept with its bytes where every server reads it (the store) and
belongs to the key that uploaded it: another key's file, like an unknown
one, is OpenAI's 404 C{No such File object}.  Only C{purpose} C{batch} is
taken (the gateway keeps files for its batches alone); another is
OpenAI's 400 naming C{purpose}.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from twisted.web.iweb import IRequest

from llmgw.router.api.batch_answers import answer, key_id, limit, openai_error, query
from llmgw.router.api.batch_shapes import cursor_page, file_object
from llmgw.router.api.uploads import FormError, read_upload
from llmgw.router.batch_interfaces import FileStore, KeptFile
from llmgw.router.errors import APIError, bad_request
from llmgw.router.interfaces import Auth

PURPOSES = ("batch",)
"""
The purposes an upload may have here.
"""

MAX_PAGE = 10_000
"""
Files per page: by default and at most (OpenAI's C{limit}, 1 to 10,000).
"""


def file_not_found(file_id: str) -> APIError:
    """
    @return: OpenAI's 404 for an unknown file (or another key's).
    """
    shown = file_id if len(file_id) <= 200 else file_id[:200] + "..."
    return APIError(
        404, f"No such File object: {shown}", "invalid_request_error", None, "id"
    )


def new_file_id() -> str:
    """
    @return: a new file id, C{file-} and 32 hex digits.
    """
    return "file-" + uuid.uuid4().hex


class FileRoutes:
    """
    The Files API's routes, each for the request's key only (a missing or
    wrong key is a 401, as on the other routes).

    @param files: where files are kept.
    @param auth: the API keys, or L{None} for an open gateway.
    @param max_file_size: C{[batches] max_file_size}, bytes: the body limit
        the site applies to C{POST /v1/files}, said in its 413.
    @param wall_clock: POSIX seconds now.
    @param new_id: makes a file's id.
    """

    def __init__(
        self,
        files: FileStore,
        auth: Auth | None,
        max_file_size: int,
        wall_clock: Callable[[], float],
        new_id: Callable[[], str] = new_file_id,
    ) -> None:
        self._files = files
        self._auth = auth
        self._max_file_size = max_file_size
        self._wall_clock = wall_clock
        self._new_id = new_id

    async def create(self, request: IRequest) -> bytes:
        """
        C{POST /v1/files}: the file kept; its file object.
        """
        try:
            owner = key_id(self._auth, request)
            if getattr(request, "body_too_large", False):
                raise APIError(
                    413,
                    f"File too large: the limit is {self._max_file_size} bytes.",
                    "invalid_request_error",
                    "file_too_large",
                    "file",
                )
            assert request.content is not None
            request.content.seek(0)
            try:
                upload = read_upload(
                    request.content, request.getHeader(b"content-type")
                )
            except FormError as error:
                raise bad_request(str(error), "file") from None
            purpose = upload.fields.get("purpose")
            if purpose is None:
                raise bad_request("Missing required parameter: 'purpose'.", "purpose")
            if purpose not in PURPOSES:
                raise bad_request(
                    f"{purpose!r} is not one of {list(PURPOSES)} - 'purpose'",
                    "purpose",
                )
            kept = KeptFile(
                self._new_id(),
                owner,
                purpose,
                upload.filename,
                len(upload.content),
                self._wall_clock(),
            )
            await self._files.add(kept, upload.content)
            return answer(request, file_object(kept))
        except APIError as error:
            return openai_error(request, error)

    async def listing(self, request: IRequest) -> bytes:
        """
        C{GET /v1/files}: a page of the key's files, by the query's
        C{purpose}, C{after} (a file id), C{limit} (1 to 10,000, the
        default) and C{order} (C{desc}, the default, or C{asc}).
        """
        try:
            owner = key_id(self._auth, request)
            count = limit(request, "limit", MAX_PAGE, MAX_PAGE)
            order = query(request, "order") or "desc"
            if order not in ("asc", "desc"):
                raise bad_request("order must be 'asc' or 'desc'.", "order")
            rows = await self._files.page(
                owner,
                query(request, "purpose"),
                query(request, "after"),
                count + 1,
                order,
            )
            data = [file_object(f) for f in rows[:count]]
            return answer(request, cursor_page(data, len(rows) > count))
        except APIError as error:
            return openai_error(request, error)

    async def retrieve(self, request: IRequest, file_id: str) -> bytes:
        """
        C{GET /v1/files/{id}}: the file object.  C{DELETE}: the file
        deleted, C{{"id", "object": "file", "deleted": true}}.
        """
        try:
            owner = key_id(self._auth, request)
            if request.method == b"DELETE":
                if not await self._files.delete(file_id, owner):
                    raise file_not_found(file_id)
                body = {"id": file_id, "object": "file", "deleted": True}
                return answer(request, body)
            kept = await self._files.get(file_id, owner)
            if kept is None:
                raise file_not_found(file_id)
            return answer(request, file_object(kept))
        except APIError as error:
            return openai_error(request, error)

    async def content(self, request: IRequest, file_id: str) -> bytes:
        """
        C{GET /v1/files/{id}/content}: the file's bytes.
        """
        try:
            owner = key_id(self._auth, request)
            content = await self._files.content(file_id, owner)
            if content is None:
                raise file_not_found(file_id)
            request.setHeader(b"content-type", b"application/octet-stream")
            return content
        except APIError as error:
            return openai_error(request, error)


__all__ = ["PURPOSES", "FileRoutes", "file_not_found", "new_file_id"]
