"""
Anthropic's Message Batches on the same batches and lines as OpenAI's:
C{POST /v1/messages/batches} (C{requests} inline, each C{custom_id} and
C{params}, a Messages API request), C{GET /v1/messages/batches},
C{GET /v1/messages/batches/{id}}, C{POST /v1/messages/batches/{id}/cancel},
C{GET /v1/messages/batches/{id}/results} (JSONL, one result per request)
and C{DELETE /v1/messages/batches/{id}} (Anthropic's API reference,
"Message Batches", as the C{anthropic} SDK's C{messages.batches} calls
them).  Errors are in Anthropic's shape (L{llmgw.router.errors.anthropic_error}).

A request's shape is checked at once (a bad one refuses the batch, 400); a
model the key may not use or no one serves makes that request C{errored}
in the results, as Anthropic checks C{params} while the batch runs.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace

from twisted.web.iweb import IRequest

from llmgw.router.api.batch_answers import (
    answer,
    anthropic_answer_error,
    json_body,
    limit,
    query,
)
from llmgw.router.api.batch_lines import (
    MESSAGES_URL,
    LineError,
    anthropic_requests,
)
from llmgw.router.api.batch_routes import (
    WINDOW,
    WINDOW_SECONDS,
    cancel,
    keep_batch,
    model_check,
)
from llmgw.router.api.batch_shapes import (
    anthropic_page,
    message_batch,
    processing_status,
    results_jsonl,
)
from llmgw.router.api.credentials import request_key
from llmgw.router.batch_interfaces import BatchStore, KeptBatch, KeptLine
from llmgw.router.errors import APIError, anthropic_error, bad_request
from llmgw.router.interfaces import Auth

MAX_PAGE = 1000
DEFAULT_PAGE = 20
"""
Batches per page: at most, and by default (Anthropic's C{limit}).
"""

_MODEL_STATUS = {"model_not_allowed": 403, "model_not_found": 404}


def message_batch_not_found(batch_id: str) -> APIError:
    """
    @return: the 404 of an unknown message batch (or another key's).
    """
    shown = batch_id if len(batch_id) <= 200 else batch_id[:200] + "..."
    return APIError(404, f"Message batch {shown} not found.", "not_found_error")


def new_message_batch_id() -> str:
    """
    @return: a new message batch id, C{msgbatch_} and 32 hex digits.
    """
    return "msgbatch_" + uuid.uuid4().hex


def results_url(request: IRequest, batch_id: str) -> str:
    """
    @return: where the SDK reads a batch's results: this gateway, as the
        client reached it (its C{Host}).
    """
    host = (request.getHeader(b"host") or b"localhost").decode("latin-1")
    scheme = "https" if request.isSecure() else "http"
    return f"{scheme}://{host}/v1/messages/batches/{batch_id}/results"


class MessageBatchRoutes:
    """
    Anthropic's Message Batches routes, each for the request's key only.

    @param batches: where batches and their lines are kept.
    @param auth: the API keys, or L{None} for an open gateway.
    @param resolve: a name's catalog model, or L{None}.
    @param known: whether the gateway serves a model.
    @param max_lines: C{[batches] max_lines}: the most requests.
    @param wall_clock: POSIX seconds now.
    @param new_id: makes a batch's id.
    """

    def __init__(
        self,
        batches: BatchStore,
        auth: Auth | None,
        resolve: Callable[[str], str | None],
        known: Callable[[str], bool],
        max_lines: int,
        wall_clock: Callable[[], float],
        new_id: Callable[[], str] = new_message_batch_id,
    ) -> None:
        self._batches = batches
        self._auth = auth
        self._resolve = resolve
        self._known = known
        self._max_lines = max_lines
        self._wall_clock = wall_clock
        self._new_id = new_id

    async def create(self, request: IRequest) -> bytes:
        """
        C{POST /v1/messages/batches}: the batch made of C{requests}.
        """
        try:
            key = request_key(self._auth, request)
            body = json_body(request)
            try:
                requests = anthropic_requests(body.get("requests"))
            except LineError as error:
                raise bad_request(error.message, error.param) from None
            if len(requests) > self._max_lines:
                raise bad_request(
                    f"A batch holds at most {self._max_lines} requests.", "requests"
                )
            now = self._wall_clock()
            batch_id = self._new_id()
            check = model_check(key, self._resolve, self._known)
            lines = []
            for place, line in enumerate(requests):
                wrong = check.error(line.model, f"requests[{place}].params.model")
                kept = KeptLine(
                    batch_id,
                    line.line_no,
                    line.custom_id,
                    line.model,
                    line.url,
                    line.body,
                )
                if wrong is not None:
                    status = _MODEL_STATUS.get(wrong.code, 400)
                    failure = APIError(
                        status, wrong.message, "", wrong.code, wrong.param
                    )
                    kept = replace(
                        kept,
                        state="failed",
                        status_code=status,
                        result=anthropic_error(failure)[1].decode("utf-8"),
                        finished_at=now,
                    )
                lines.append(kept)
            row = KeptBatch(
                id=batch_id,
                key_id=key.id if key is not None else None,
                key_name=key.name if key is not None else None,
                endpoint=MESSAGES_URL,
                input_file_id=None,
                completion_window=WINDOW,
                status="validating",
                created_at=now,
                expires_at=now + WINDOW_SECONDS,
                api="anthropic",
            )
            row = await keep_batch(self._batches, row, lines, now)
            return answer(request, await self._shown(request, row))
        except APIError as error:
            return anthropic_answer_error(request, error)

    async def _shown(self, request: IRequest, row: KeptBatch) -> dict[str, object]:
        counts = await self._batches.line_counts(row.id)
        return message_batch(row, counts, results_url(request, row.id))

    async def _get(self, request: IRequest, batch_id: str) -> KeptBatch:
        key = request_key(self._auth, request)
        row = await self._batches.get(batch_id, key.id if key is not None else None)
        if row is None or row.api != "anthropic":
            raise message_batch_not_found(batch_id)
        return row

    async def retrieve(self, request: IRequest, batch_id: str) -> bytes:
        """
        C{GET}: the Message Batch.  C{DELETE}: the batch deleted once it
        ended (one not ended is a 400: cancel it first).
        """
        try:
            row = await self._get(request, batch_id)
            if request.method == b"DELETE":
                if processing_status(row) != "ended":
                    raise bad_request(
                        f"Message batch {batch_id} has not ended: cancel it"
                        " before deleting it."
                    )
                await self._batches.delete(row.id, row.key_id)
                return answer(
                    request, {"id": batch_id, "type": "message_batch_deleted"}
                )
            return answer(request, await self._shown(request, row))
        except APIError as error:
            return anthropic_answer_error(request, error)

    async def listing(self, request: IRequest) -> bytes:
        """
        C{GET /v1/messages/batches}: a page of the key's batches, newest
        first, by the query's C{after_id}, C{before_id} and C{limit} (1 to
        1,000, 20 by default).
        """
        try:
            key = request_key(self._auth, request)
            owner = key.id if key is not None else None
            count = limit(request, "limit", DEFAULT_PAGE, MAX_PAGE)
            before = query(request, "before_id")
            if before is None:
                rows = await self._batches.page(
                    owner, query(request, "after_id"), count + 1, "anthropic"
                )
                page, more = rows[:count], len(rows) > count
            else:
                rows = await self._batches.page(owner, None, 10_000, "anthropic")
                end = next((i for i, r in enumerate(rows) if r.id == before), 0)
                page, more = rows[max(0, end - count) : end], end > count
            data = [await self._shown(request, row) for row in page]
            return answer(request, anthropic_page(data, more))
        except APIError as error:
            return anthropic_answer_error(request, error)

    async def cancel(self, request: IRequest, batch_id: str) -> bytes:
        """
        C{POST /v1/messages/batches/{id}/cancel}: the batch C{canceling},
        its requests not yet sent canceled.
        """
        try:
            row = await self._get(request, batch_id)
            try:
                row = await cancel(self._batches, row, self._wall_clock())
            except APIError:
                raise bad_request(
                    f"Message batch {batch_id} has ended: it cannot be canceled."
                ) from None
            return answer(request, await self._shown(request, row))
        except APIError as error:
            return anthropic_answer_error(request, error)

    async def results(self, request: IRequest, batch_id: str) -> bytes:
        """
        C{GET /v1/messages/batches/{id}/results}: one JSON object a line,
        C{custom_id} and C{result}, once the batch ended.
        """
        try:
            row = await self._get(request, batch_id)
            if processing_status(row) != "ended":
                raise bad_request(
                    f"Message batch {batch_id} has not ended: its results are"
                    " not ready."
                )
            lines = await self._batches.lines(row.id)
            request.setHeader(b"content-type", b"application/x-jsonl")
            return results_jsonl(lines)
        except APIError as error:
            return anthropic_answer_error(request, error)


__all__ = [
    "MessageBatchRoutes",
    "message_batch_not_found",
    "new_message_batch_id",
    "results_url",
]
