"""
The objects the Files and Batches APIs answer with, made from the kept
records: OpenAI's file object and batch object, Anthropic's Message Batch
and its results' lines.  Pure: records in, JSON objects out.

Shapes from the official SDKs' types: C{openai.types.FileObject},
C{FileDeleted}, C{Batch} (with C{BatchRequestCounts} and C{BatchError}),
the cursor page C{SyncCursorPage}; C{anthropic.types.messages.MessageBatch},
C{MessageBatchRequestCounts}, C{MessageBatchIndividualResponse},
C{DeletedMessageBatch} and the page C{SyncPage}.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from llmgw.router.batch_interfaces import KeptBatch, KeptFile, KeptLine, KeptUsage

_TIMES = (
    "expires_at",
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)

ENDED = ("completed", "failed", "expired", "cancelled")
"""
The statuses of a batch that is over.
"""


def _seconds(when: float | None) -> int | None:
    return None if when is None else int(when)


def file_object(kept: KeptFile) -> dict[str, Any]:
    """
    @return: OpenAI's file object.  C{status} is always C{processed}: a
        file is checked when a batch is made of it, not on upload.
    """
    return {
        "id": kept.id,
        "object": "file",
        "bytes": kept.bytes,
        "created_at": int(kept.created_at),
        "filename": kept.filename,
        "purpose": kept.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def cursor_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """
    @return: OpenAI's list object, for the SDK's cursor pages (the next
        page asks C{after} the last id).
    """
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def batch_object(
    batch: KeptBatch, counts: dict[str, int], usage: KeptUsage
) -> dict[str, Any]:
    """
    @param counts: the batch's lines per state: C{request_counts} are read
        from them (C{completed} the lines done, C{failed} those failed or
        expired), so that they move as the lines end.
    @param usage: what its lines used so far: OpenAI's C{usage} (its
        C{BatchUsage}: input, output and total tokens) is read from it.
        Cached and reasoning tokens are not in llmgw's usage records:
        their details say 0.
    @return: OpenAI's batch object.
    """
    body: dict[str, Any] = {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "created_at": int(batch.created_at),
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "errors": ({"object": "list", "data": batch.errors} if batch.errors else None),
        "metadata": batch.metadata or None,
        "request_counts": {
            "total": sum(counts.values()),
            "completed": counts.get("done", 0),
            "failed": counts.get("failed", 0) + counts.get("expired", 0),
        },
        "usage": {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        },
    }
    for name in _TIMES:
        body[name] = _seconds(getattr(batch, name))
    return body


def _rfc3339(when: float | None) -> str | None:
    if when is None:
        return None
    stamp = datetime.fromtimestamp(when, tz=UTC)
    return stamp.isoformat(timespec="microseconds").replace("+00:00", "Z")


def processing_status(batch: KeptBatch) -> str:
    """
    @return: Anthropic's C{processing_status}: C{in_progress},
        C{canceling} or C{ended}.
    """
    if batch.status in ENDED:
        return "ended"
    return "canceling" if batch.status == "cancelling" else "in_progress"


def ended_at(batch: KeptBatch) -> float | None:
    """
    @return: when the batch ended, POSIX seconds, or L{None}.
    """
    for when in (
        batch.completed_at,
        batch.cancelled_at,
        batch.expired_at,
        batch.failed_at,
    ):
        if when is not None:
            return when
    return None


def message_batch(
    batch: KeptBatch, counts: dict[str, int], results_url: str
) -> dict[str, Any]:
    """
    @param counts: the batch's lines per state.
    @param results_url: where its results are read, given once it ended.
    @return: Anthropic's Message Batch.  Its requests count as
        C{processing} until the batch ends (as Anthropic's do), then by how
        each ended.
    """
    status = processing_status(batch)
    total = sum(counts.values())
    if status == "ended":
        request_counts = {
            "processing": counts.get("pending", 0) + counts.get("running", 0),
            "succeeded": counts.get("done", 0),
            "errored": counts.get("failed", 0),
            "canceled": counts.get("cancelled", 0),
            "expired": counts.get("expired", 0),
        }
    else:
        request_counts = dict.fromkeys(
            ("succeeded", "errored", "canceled", "expired"), 0
        )
        request_counts["processing"] = total
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": request_counts,
        "created_at": _rfc3339(batch.created_at),
        "expires_at": _rfc3339(batch.expires_at),
        "ended_at": _rfc3339(ended_at(batch)),
        "cancel_initiated_at": _rfc3339(batch.cancelling_at),
        "archived_at": None,
        "results_url": results_url if status == "ended" else None,
    }


def anthropic_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """
    @return: Anthropic's list page (C{first_id}, C{last_id} for the SDK's
        C{after_id} and C{before_id}).
    """
    return {
        "data": data,
        "has_more": has_more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


def _anthropic_error(result: str | None, status: int | None) -> dict[str, Any]:
    try:
        body = json.loads(result) if result else None
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("type") == "error":
        return body
    message = "The request failed"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = str(body["error"].get("message") or message)
    kind = "invalid_request_error" if status and status < 500 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": message}}


def result_line(line: KeptLine) -> dict[str, Any] | None:
    """
    @return: the line's entry in an Anthropic batch's results: its
        C{custom_id} and C{result}, C{succeeded} with the Message,
        C{errored} with an error response, C{canceled} or C{expired};
        L{None} for a line not ended.
    """
    result: dict[str, Any]
    if line.state == "done" and line.result is not None:
        result = {"type": "succeeded", "message": json.loads(line.result)}
    elif line.state == "failed":
        result = {
            "type": "errored",
            "error": _anthropic_error(line.result, line.status_code),
        }
    elif line.state == "cancelled":
        result = {"type": "canceled"}
    elif line.state == "expired":
        result = {"type": "expired"}
    else:
        return None
    return {"custom_id": line.custom_id, "result": result}


def results_jsonl(lines: Sequence[KeptLine]) -> bytes:
    """
    @return: the results of an Anthropic batch, one JSON object a line.
    """
    entries = (result_line(line) for line in lines)
    return b"".join(
        json.dumps(entry).encode("utf-8") + b"\n" for entry in entries if entry
    )


__all__ = [
    "ENDED",
    "anthropic_page",
    "batch_object",
    "cursor_page",
    "ended_at",
    "file_object",
    "message_batch",
    "processing_status",
    "result_line",
    "results_jsonl",
]
