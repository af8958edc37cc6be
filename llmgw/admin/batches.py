"""
The admin API's batches routes (docs/batches.md, "Watching batches"):
every key's batches for the operator, listed with filters, one with its
lines by state, and cancelled whichever key made it.  The clients' own
Batches API (C{/v1/batches}) shows each key its own only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from klein import Klein
from twisted.web.iweb import IRequest

from llmgw.admin.http import AdminError, error_answers, json_answer, not_found
from llmgw.batches.tally import progress
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.api.batch_routes import CANCELLABLE
from llmgw.store.batches import ACTIVE_STATUSES, BatchRow, BatchUsage
from llmgw.store.db import Store

BATCH_STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
)
"""
A batch's statuses (OpenAI's batch object, "status"), for the list's filter.
"""

LIST_LIMIT = 20
"""
The batches a list answers when it names no C{limit}.
"""

MOST_LISTED = 100
"""
The largest C{limit} a list takes.
"""


def batch_json(
    batch: BatchRow, lines: dict[str, int] | None, usage: BatchUsage
) -> dict[str, Any]:
    """
    @param lines: its lines by state (each of
        L{llmgw.store.batches.LINE_STATES}), when read.
    @param usage: what its lines used so far.
    @return: the batch as the admin API shows it: its row's fields, its
        key's name as C{key}, OpenAI's C{request_counts}, C{lines} by
        state when given, C{progress}: C{{"ended", "total"}} lines,
        from C{lines} when given (a line is ended done, failed, cancelled
        or expired), else from C{request_counts} (completed and failed),
        and C{usage}: C{{"requests", "prompt_tokens",
        "completion_tokens", "gpu_seconds", "cost"}}, the sums of its
        lines' usage records (docs/cost.md).
    """
    shown: dict[str, Any] = {
        "id": batch.id,
        "key": batch.key_name,
        "key_id": batch.key_id,
        "api": batch.api,
        "endpoint": batch.endpoint,
        "status": batch.status,
        "input_file_id": batch.input_file_id,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "completion_window": batch.completion_window,
        "created_at": batch.created_at,
        "expires_at": batch.expires_at,
        "in_progress_at": batch.in_progress_at,
        "finalizing_at": batch.finalizing_at,
        "completed_at": batch.completed_at,
        "failed_at": batch.failed_at,
        "expired_at": batch.expired_at,
        "cancelling_at": batch.cancelling_at,
        "cancelled_at": batch.cancelled_at,
        "errors": batch.errors,
        "metadata": batch.metadata,
        "request_counts": {
            "total": batch.total,
            "completed": batch.completed,
            "failed": batch.failed,
        },
    }
    if lines is not None:
        shown["lines"] = lines
        ended, total = progress(lines)
    elif batch.status not in ACTIVE_STATUSES:
        # Over: every line ended (a cancelled one is in neither count).
        ended, total = batch.total, batch.total
    else:
        ended, total = batch.completed + batch.failed, batch.total
    shown["progress"] = {"ended": ended, "total": total}
    shown["usage"] = {
        "requests": usage.requests,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "gpu_seconds": usage.gpu_seconds,
        "cost": usage.cost,
    }
    return shown


class BatchRoutes:
    """
    C{/api/v1/batches}, C{/api/v1/batches/<id>} and
    C{/api/v1/batches/<id>/cancel}.

    @param store: the database (files, batches and their lines).
    @param keys: the API keys, for the C{key} filter (by name).
    @param wall_clock: POSIX seconds now.
    """

    app = error_answers(Klein())

    def __init__(
        self,
        store: Store | None,
        keys: KeyRing | None,
        *,
        wall_clock: Callable[[], float],
    ) -> None:
        self._store_or_none = store
        self._keys = keys
        self._wall_clock = wall_clock

    def _store(self) -> Store:
        if self._store_or_none is None:
            raise AdminError(404, "no store in this server", "not_found")
        return self._store_or_none

    async def _shown(self, batch: BatchRow, with_lines: bool) -> dict[str, Any]:
        store = self._store()
        lines = await store.line_counts(batch.id) if with_lines else None
        usage = await store.batch_usage(batch.id, batch.created_at)
        return batch_json(batch, lines, usage)

    async def _with_lines(self, batch: BatchRow) -> dict[str, Any]:
        return await self._shown(batch, True)

    @app.route("/api/v1/batches", methods=["GET"])
    async def list_batches(self, request: IRequest) -> bytes:
        """
        Every key's batches, newest first: C{{"batches": [...],
        "has_more", "last_id"}}, each as L{batch_json} makes it, those
        not over with their C{lines} by state.  Query: C{status} (one of
        OpenAI's statuses), C{key} (a key's name), C{after} (a batch id:
        those made before it), C{limit} (1 to L{MOST_LISTED}, default
        L{LIST_LIMIT}).  400 for a bad one; 404 C{not_found} for a key
        that does not exist.
        """
        store = self._store()
        args = request.args or {}

        def arg(name: bytes) -> str | None:
            values = args.get(name)
            return values[0].decode("utf-8", "replace") if values else None

        status = arg(b"status")
        if status is not None and status not in BATCH_STATUSES:
            raise AdminError(
                400,
                f"status: expected one of {', '.join(BATCH_STATUSES)},"
                f" got {status[:100]!r}",
                "bad_request",
            )
        key_id = self._key_id(arg(b"key"))
        limit = _limit(arg(b"limit"))
        found = await store.all_batches(
            status=status, key_id=key_id, after=arg(b"after"), limit=limit + 1
        )
        page = found[:limit]
        shown = [await self._shown(b, b.status in ACTIVE_STATUSES) for b in page]
        return json_answer(
            request,
            {
                "batches": shown,
                "has_more": len(found) > limit,
                "last_id": page[-1].id if page else None,
            },
        )

    def _key_id(self, name: str | None) -> int | None:
        """
        @return: the id of the key named C{name}; L{None} for no filter.
        @raise AdminError: 404, no such key.
        """
        if name is None:
            return None
        key = self._keys.find(name) if self._keys is not None else None
        if key is None:
            raise not_found(f"key {name[:200]!r}")
        return key.id

    async def _batch(self, batch_id: str) -> BatchRow:
        batch = await self._store().find_batch(batch_id)
        if batch is None:
            raise not_found(f"batch {batch_id[:200]!r}")
        return batch

    @app.route("/api/v1/batches/<batch_id>", methods=["GET"])
    async def get_batch(self, request: IRequest, batch_id: str) -> bytes:
        """
        One batch, whichever key made it, with its C{lines} by state; 404
        C{not_found}.
        """
        batch = await self._batch(batch_id)
        return json_answer(request, await self._with_lines(batch))

    @app.route("/api/v1/batches/<batch_id>/cancel", methods=["POST"])
    async def cancel_batch(self, request: IRequest, batch_id: str) -> bytes:
        """
        Cancel a batch as the operator, whichever key made it, as its key's
        C{POST /v1/batches/<id>/cancel} does (from the same statuses,
        L{CANCELLABLE}): it is C{cancelling}, its
        pending lines C{cancelled}; those running end first, then the
        runner ends it C{cancelled} with the answers it has.  The batch
        with its C{lines}; a batch already cancelling is answered as it
        is; 409 C{cannot_cancel} for one finalizing or over; 404
        C{not_found}.
        """
        store = self._store()
        batch = await self._batch(batch_id)
        if batch.status != "cancelling":
            changed = await store.update_batch(
                batch_id,
                {"status": "cancelling", "cancelling_at": self._wall_clock()},
                CANCELLABLE,
            )
            if not changed:
                # Over, or changed meanwhile by the runner: say which.
                batch = await self._batch(batch_id)
                if batch.status != "cancelling":
                    raise AdminError(
                        409,
                        f"batch {batch_id[:200]!r} is {batch.status}: only a"
                        " batch validating or in progress can be cancelled",
                        "cannot_cancel",
                    )
        await store.cancel_lines(batch_id)
        return json_answer(request, await self._with_lines(await self._batch(batch_id)))


def _limit(value: str | None) -> int:
    """
    @return: a list's C{limit}: L{LIST_LIMIT} when not given.
    @raise AdminError: 400, not an integer from 1 to L{MOST_LISTED}.
    """
    if value is None:
        return LIST_LIMIT
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MOST_LISTED:
        raise AdminError(
            400,
            f"limit: expected an integer from 1 to {MOST_LISTED}, got {value[:50]!r}",
            "bad_request",
        )
    return limit
