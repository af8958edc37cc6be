"""
The Batches API: C{POST /v1/batches}, C{GET /v1/batches/{id}},
C{GET /v1/batches} and C{POST /v1/batches/{id}/cancel} (OpenAI's API
reference, "Batch", as the C{openai} SDK's C{batches} resource calls them).

Making a batch reads its input file and checks every line
(L{llmgw.router.api.batch_lines}): a file with a bad line makes a batch
that is C{failed} at once, each bad line in its C{errors}; a good one's
lines are kept (C{validating}) and the batch is C{in_progress}, for the
runner to send.  An empty file, or one over C{[batches] max_lines}, is
refused (400).  docs/batches.md says why.

A batch belongs to the key that made it; another key's, like an unknown
one, is a 404.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from twisted.internet.defer import Deferred, succeed
from twisted.web.iweb import IRequest

from llmgw.router.api.batch_answers import (
    answer,
    json_body,
    limit,
    openai_error,
    query,
)
from llmgw.router.api.batch_lines import (
    ENDPOINTS,
    LineRequest,
    ModelCheck,
    openai_file,
    split_lines,
)
from llmgw.router.api.batch_shapes import batch_object, cursor_page
from llmgw.router.api.credentials import request_key
from llmgw.router.api.file_routes import file_not_found
from llmgw.router.batch_interfaces import BatchStore, FileStore, KeptBatch, KeptLine
from llmgw.router.errors import APIError, bad_request
from llmgw.router.interfaces import Auth, Key

T = TypeVar("T")

WINDOW = "24h"
"""
The one C{completion_window} OpenAI takes.
"""

WINDOW_SECONDS = 86400.0

MAX_PAGE = 100
DEFAULT_PAGE = 20
"""
Batches per page: at most, and by default (OpenAI's C{limit}, 1 to 100).
"""

MAX_METADATA = 16
"""
The most C{metadata} pairs (OpenAI's C{Metadata}: 16 pairs, keys of at
most 64 characters, values of at most 512).
"""

CANCELLABLE = ("validating", "in_progress")
"""
The statuses a batch may be cancelled from.
"""


class Offload(Protocol):
    """
    Runs C{work()} off the reactor thread (a thread pool), for a check
    of a large input file.
    """

    def __call__(self, work: Callable[[], T]) -> Deferred[T]: ...


def inline(work: Callable[[], T]) -> Deferred[T]:
    """
    An L{Offload} that runs C{work} at once, on this thread (tests).
    """
    return succeed(work())


def check_metadata(metadata: object) -> dict[str, str]:
    """
    @return: the client's C{metadata}, checked.
    @raise APIError: 400 naming C{metadata}: not an object of at most
        L{MAX_METADATA} string pairs of the sizes OpenAI allows.
    """
    if metadata is None:
        return {}
    if (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items()
        )
    ):
        raise bad_request(
            f"metadata must be an object of at most {MAX_METADATA} string pairs,"
            " keys of at most 64 characters and values of at most 512.",
            "metadata",
        )
    return metadata


def batch_not_found(batch_id: str) -> APIError:
    """
    @return: the 404 of an unknown batch (or another key's).
    """
    shown = batch_id if len(batch_id) <= 200 else batch_id[:200] + "..."
    return APIError(
        404, f"No such Batch object: {shown}", "invalid_request_error", None, "id"
    )


def new_batch_id() -> str:
    """
    @return: a new batch id, C{batch_} and 32 hex digits.
    """
    return "batch_" + uuid.uuid4().hex


def lines_of(batch_id: str, requests: Sequence[LineRequest]) -> list[KeptLine]:
    """
    @return: the lines to keep for C{requests}, pending.
    """
    return [
        KeptLine(batch_id, r.line_no, r.custom_id, r.model, r.url, r.body)
        for r in requests
    ]


async def keep_batch(
    batches: BatchStore, row: KeptBatch, lines: Sequence[KeptLine], now: float
) -> KeptBatch:
    """
    Keep a checked batch: its lines with it, C{validating}, then
    C{in_progress} (the runner sends the lines of batches in progress).

    @return: the batch as kept.
    """
    await batches.add(replace(row, status="validating", total=len(lines)), lines)
    changes: dict[str, Any] = {"status": "in_progress", "in_progress_at": now}
    await batches.update(row.id, changes, ("validating",))
    return replace(row, total=len(lines), **changes)


def model_check(
    key: Key | None,
    resolve: Callable[[str], str | None],
    known: Callable[[str], bool],
) -> ModelCheck:
    """
    @return: the check of models for C{key}'s batch.
    """
    if key is None:
        return ModelCheck(lambda model: True, known)
    return ModelCheck(lambda model: key.allows(model, resolve), known)


class BatchRoutes:
    """
    The Batches API's routes, each for the request's key only.

    @param batches: where batches and their lines are kept.
    @param files: where their input files are.
    @param auth: the API keys, or L{None} for an open gateway.
    @param resolve: a name's catalog model, or L{None} (a key allowed a
        model may use its aliases).
    @param known: whether the gateway serves a model.
    @param max_lines: C{[batches] max_lines}.
    @param wall_clock: POSIX seconds now.
    @param offload: runs the check of an input file off the reactor.
    @param new_id: makes a batch's id.
    """

    def __init__(
        self,
        batches: BatchStore,
        files: FileStore,
        auth: Auth | None,
        resolve: Callable[[str], str | None],
        known: Callable[[str], bool],
        max_lines: int,
        wall_clock: Callable[[], float],
        offload: Offload = inline,
        new_id: Callable[[], str] = new_batch_id,
    ) -> None:
        self._batches = batches
        self._files = files
        self._auth = auth
        self._resolve = resolve
        self._known = known
        self._max_lines = max_lines
        self._wall_clock = wall_clock
        self._offload = offload
        self._new_id = new_id

    async def create(self, request: IRequest) -> bytes:
        """
        C{POST /v1/batches}: the batch made of C{input_file_id}'s lines.
        """
        try:
            key = request_key(self._auth, request)
            owner = key.id if key is not None else None
            body = json_body(request)
            file_id = body.get("input_file_id")
            endpoint = body.get("endpoint")
            if not isinstance(file_id, str) or not file_id:
                raise bad_request("input_file_id must be a file's id.", "input_file_id")
            if endpoint not in ENDPOINTS:
                raise bad_request(
                    f"endpoint must be one of {list(ENDPOINTS)}.", "endpoint"
                )
            if body.get("completion_window") != WINDOW:
                raise bad_request(
                    f"completion_window must be {WINDOW!r}.", "completion_window"
                )
            metadata = check_metadata(body.get("metadata"))
            content = await self._input(file_id, owner)
            checked = await self._offload(lambda: openai_file(content, endpoint))
            checked = model_check(key, self._resolve, self._known).openai(checked)
            now = self._wall_clock()
            row = KeptBatch(
                id=self._new_id(),
                key_id=owner,
                key_name=key.name if key is not None else None,
                endpoint=endpoint,
                input_file_id=file_id,
                completion_window=WINDOW,
                status="failed",
                created_at=now,
                expires_at=now + WINDOW_SECONDS,
                metadata=metadata,
            )
            if checked.errors:
                row = replace(row, failed_at=now, errors=checked.errors)
                await self._batches.add(row, [])
            else:
                lines = lines_of(row.id, checked.requests)
                row = await keep_batch(self._batches, row, lines, now)
            return answer(request, await self._shown(row))
        except APIError as error:
            return openai_error(request, error)

    async def _input(self, file_id: str, owner: int | None) -> bytes:
        """
        @return: the bytes of the batch's input file.
        @raise APIError: 404, no such file of the key's; 400, not a batch
            file, empty, or over C{max_lines} lines.
        """
        kept = await self._files.get(file_id, owner)
        content = await self._files.content(file_id, owner)
        if kept is None or content is None:
            raise file_not_found(file_id)
        if kept.purpose != "batch":
            raise bad_request(
                f"The file {file_id} has purpose {kept.purpose!r}, not 'batch'.",
                "input_file_id",
            )
        lines = content.count(b"\n") + (0 if content.endswith(b"\n") else 1)
        if not split_lines(content):
            raise bad_request(f"The file {file_id} is empty.", "input_file_id")
        if lines > self._max_lines:
            raise bad_request(
                f"The file {file_id} has {lines} lines: a batch holds at most"
                f" {self._max_lines}.",
                "input_file_id",
            )
        return content

    async def _shown(self, row: KeptBatch) -> dict[str, Any]:
        return batch_object(
            row,
            await self._batches.line_counts(row.id),
            await self._batches.usage(row),
        )

    async def _get(self, request: IRequest, batch_id: str) -> KeptBatch:
        key = request_key(self._auth, request)
        row = await self._batches.get(batch_id, key.id if key is not None else None)
        if row is None or row.api != "openai":
            raise batch_not_found(batch_id)
        return row

    async def retrieve(self, request: IRequest, batch_id: str) -> bytes:
        """
        C{GET /v1/batches/{id}}: the batch object.
        """
        try:
            return answer(
                request, await self._shown(await self._get(request, batch_id))
            )
        except APIError as error:
            return openai_error(request, error)

    async def listing(self, request: IRequest) -> bytes:
        """
        C{GET /v1/batches}: a page of the key's batches, newest first, by
        the query's C{after} (a batch id) and C{limit} (1 to 100, 20 by
        default).
        """
        try:
            key = request_key(self._auth, request)
            count = limit(request, "limit", DEFAULT_PAGE, MAX_PAGE)
            rows = await self._batches.page(
                key.id if key is not None else None,
                query(request, "after"),
                count + 1,
                "openai",
            )
            data = [await self._shown(row) for row in rows[:count]]
            return answer(request, cursor_page(data, len(rows) > count))
        except APIError as error:
            return openai_error(request, error)

    async def cancel(self, request: IRequest, batch_id: str) -> bytes:
        """
        C{POST /v1/batches/{id}/cancel}: the batch C{cancelling}, its
        pending lines cancelled (the runner ends those in flight, then the
        batch); a batch already cancelling is answered as it is, one over
        is a 409.
        """
        try:
            row = await cancel(
                self._batches, await self._get(request, batch_id), self._wall_clock()
            )
            return answer(request, await self._shown(row))
        except APIError as error:
            return openai_error(request, error)


async def cancel(batches: BatchStore, row: KeptBatch, now: float) -> KeptBatch:
    """
    Cancel a batch: C{cancelling}, its pending lines cancelled.

    @return: the batch as it is after.
    @raise APIError: 409, the batch is over.
    """
    if row.status in CANCELLABLE:
        changes = {"status": "cancelling", "cancelling_at": now}
        if await batches.update(row.id, changes, CANCELLABLE):
            await batches.cancel_lines(row.id)
        fresh = await batches.get(row.id, row.key_id)
        row = fresh if fresh is not None else row
    if row.status != "cancelling":
        raise APIError(
            409,
            f"Cannot cancel a batch with status {row.status!r}.",
            "invalid_request_error",
            # The admin API's cancel answers the same code.
            "cannot_cancel",
        )
    return row


__all__ = [
    "CANCELLABLE",
    "WINDOW",
    "BatchRoutes",
    "Offload",
    "batch_not_found",
    "cancel",
    "check_metadata",
    "inline",
    "keep_batch",
    "lines_of",
    "model_check",
    "new_batch_id",
]
