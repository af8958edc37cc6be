"""
Files and batches: the row types the store keeps for the Files API, the
Batches API and Anthropic's Message Batches (tables C{files}, C{batches}
and C{batch_lines}, migration 11), and the statements both engines share
(L{llmgw.store.batch_tables.BatchTables} runs them).

A file's bytes are kept in the store (a BLOB, a C{bytea}), not on a disk:
every server of a standby set reads the same.  A file or a batch belongs
to the key that made it: the key is part of every lookup, so that another
key's reads as an unknown one (the API answers 404, as OpenAI's does).

A batch's lines are one row each, in the state machine the runner drives::

    pending --claim--> running --finish--> done | failed
       ^                  |
       +--release/requeue-+      pending --cancel--> cancelled

C{expired} is for lines the runner gives up on when the batch's window
ends.  A line ends once: L{finish_line} takes only a line still running
under the owner that claimed it.

A leaf, as the whole store: it imports nothing from the rest of llmgw.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

LINE_STATES = ("pending", "running", "done", "failed", "cancelled", "expired")
"""
The states of a batch line, in the order of its life.
"""

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
"""
The statuses of a batch that is not over (OpenAI's batch object, "status").
"""


@dataclass(frozen=True)
class FileRow:
    """
    One uploaded file, without its bytes.

    @ivar id: C{"file-..."}.
    @ivar key_id: the key that uploaded it; L{None} on a server without keys.
    @ivar purpose: C{"batch"}, or C{"batch_output"} for a batch's output
        and error files (OpenAI's file object, "purpose").
    @ivar filename: the name the client gave.
    @ivar bytes: its size, bytes.
    @ivar created_at: POSIX seconds.
    """

    id: str
    key_id: int | None
    purpose: str
    filename: str
    bytes: int
    created_at: float


@dataclass(frozen=True)
class BatchRow:
    """
    One batch, of either API.

    Times are POSIX seconds, L{None} until the batch gets there (OpenAI's
    batch object has the same C{*_at} fields).  C{total}, C{completed} and
    C{failed} are its C{request_counts}.

    @ivar key_name: the key's name, for the operator's views.
    @ivar input_file_id: the JSONL file it was made of; L{None} for an
        Anthropic batch (its requests come inline).
    @ivar errors: the validation errors, OpenAI's C{BatchError} objects
        (C{code}, C{line}, C{message}, C{param}).
    @ivar metadata: the client's string pairs.
    @ivar api: C{"openai"} or C{"anthropic"}: the API it was made through,
        so that each lists only its own.
    """

    id: str
    key_id: int | None
    key_name: str | None
    endpoint: str
    input_file_id: str | None
    completion_window: str
    status: str
    created_at: float
    expires_at: float | None = None
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    api: str = "openai"
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass(frozen=True)
class BatchLine:
    """
    One request of a batch.

    @ivar line_no: 1-based, its line in the input file (its index in an
        Anthropic batch's C{requests}, plus one).
    @ivar url: the path it is sent to, C{"/v1/chat/completions"}...
    @ivar body: the request body, JSON text.
    @ivar state: one of L{LINE_STATES}.
    @ivar owner: the runner that claimed it last; L{None} before.
    @ivar attempts: how many times it was claimed.
    @ivar status_code: the HTTP status of its answer, once finished.
    @ivar result: the answer's body or the error, JSON text, once finished.
    @ivar finished_at: POSIX seconds, once finished.
    """

    batch_id: str
    line_no: int
    custom_id: str
    model: str
    url: str
    body: str
    state: str = "pending"
    owner: str | None = None
    attempts: int = 0
    status_code: int | None = None
    result: str | None = None
    finished_at: float | None = None


FILE_COLUMNS = "id, key_id, purpose, filename, bytes, created_at"
BATCH_FIELDS = tuple(f.name for f in fields(BatchRow))
BATCH_COLUMNS = ", ".join(BATCH_FIELDS)
LINE_COLUMNS = ", ".join(f.name for f in fields(BatchLine))
_JSON_FIELDS = ("errors", "metadata")


def file_row(values: Sequence[Any]) -> FileRow:
    """
    @param values: a row of C{SELECT FILE_COLUMNS FROM files}.
    """
    fid, key_id, purpose, filename, size, created = values
    return FileRow(
        id=str(fid),
        key_id=None if key_id is None else int(key_id),
        purpose=str(purpose),
        filename=str(filename),
        bytes=int(size),
        created_at=float(created),
    )


def batch_values(row: BatchRow) -> tuple[Any, ...]:
    """
    @return: the values of L{BATCH_COLUMNS}, the JSON fields as text.
    """
    return tuple(
        json.dumps(getattr(row, name)) if name in _JSON_FIELDS else getattr(row, name)
        for name in BATCH_FIELDS
    )


def batch_row(values: Sequence[Any]) -> BatchRow:
    """
    @param values: a row of C{SELECT BATCH_COLUMNS FROM batches}.
    """
    named = dict(zip(BATCH_FIELDS, values, strict=True))
    for name in _JSON_FIELDS:
        named[name] = json.loads(named[name])
    for name in ("total", "completed", "failed"):
        named[name] = int(named[name])
    if named["key_id"] is not None:
        named["key_id"] = int(named["key_id"])
    return BatchRow(**named)


def line_values(line: BatchLine) -> tuple[Any, ...]:
    """
    @return: the values of L{LINE_COLUMNS}.
    """
    return tuple(getattr(line, f.name) for f in fields(BatchLine))


def line_row(values: Sequence[Any]) -> BatchLine:
    """
    @param values: a row of C{SELECT LINE_COLUMNS FROM batch_lines}.
    """
    return BatchLine(*values)


def batch_changes(changes: dict[str, Any], placeholder: str) -> tuple[str, list[Any]]:
    """
    @param changes: some fields of L{BatchRow} but C{id}, to their new
        values.
    @return: the C{SET} clause's text and its values.
    @raise ValueError: an unknown field, C{id}, or no change at all.
    """
    unknown = set(changes) - set(BATCH_FIELDS[1:])
    if unknown or not changes:
        raise ValueError(f"batch changes: {sorted(unknown) or 'none'}")
    names = sorted(changes)
    values = [
        json.dumps(changes[n]) if n in _JSON_FIELDS else changes[n] for n in names
    ]
    return ", ".join(f"{n} = {placeholder}" for n in names), values


def owned_by(key_id: int | None, placeholder: str) -> tuple[str, tuple[Any, ...]]:
    """
    The condition of a row of one key's (C{key_id = NULL} is never true).

    @return: the C{WHERE} clause's text (to follow C{AND}) and its
        parameters.
    """
    if key_id is None:
        return "key_id IS NULL", ()
    return f"key_id = {placeholder}", (key_id,)


@dataclass(frozen=True)
class BatchUsage:
    """
    What a batch's lines used so far: the sums of their usage rows (one
    per line answered, C{BATCH-LINE} its request id).

    @ivar requests: lines with a usage row.
    @ivar prompt_tokens: their prompt tokens.
    @ivar completion_tokens: their completion tokens.
    @ivar gpu_seconds: their share of their replicas' GPU time, seconds
        (docs/cost.md).
    @ivar cost: that time's price, in the C{[cost]} prices' unit.
    """

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    gpu_seconds: float = 0.0
    cost: float = 0.0


def marks(placeholder: str, count: int) -> str:
    """
    @return: C{count} parameter markers, comma-separated.
    """
    return ",".join([placeholder] * count)


__all__ = [
    "ACTIVE_STATUSES",
    "BATCH_COLUMNS",
    "BATCH_FIELDS",
    "FILE_COLUMNS",
    "LINE_COLUMNS",
    "LINE_STATES",
    "BatchLine",
    "BatchRow",
    "BatchUsage",
    "FileRow",
    "batch_changes",
    "batch_row",
    "batch_values",
    "file_row",
    "line_row",
    "line_values",
    "marks",
    "owned_by",
]
