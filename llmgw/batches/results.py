"""
A batch's output and error files and its request counts, from its lines
as the store keeps them (pure: no I/O).

The shapes are OpenAI's (its Batch API guide, "Retrieve the results", and
"Batch expiration"): one JSON object per line,
C{{"id": "batch_req_...", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}}, in the order of the input file.  A line
answered 2xx goes to the output file; one answered otherwise goes to the
error file with its answer as C{response} (C{error} null); a line that was
never answered goes to the error file with C{response} null and C{error}
C{{"code", "message"}}: C{batch_expired} (OpenAI's code and words) past the
completion window, C{batch_cancelled} when the batch was cancelled first
(llmgw's: every line ends in one of the two files, exactly once).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

EXPIRED = {
    "code": "batch_expired",
    "message": (
        "This request could not be executed before the completion window expired."
    ),
}
CANCELLED = {
    "code": "batch_cancelled",
    "message": "This request was not executed: the batch was cancelled first.",
}


class Line(Protocol):
    """
    What is read of a batch line (L{llmgw.store.batches.BatchLine}).
    """

    @property
    def batch_id(self) -> str: ...

    @property
    def line_no(self) -> int: ...

    @property
    def custom_id(self) -> str: ...

    @property
    def state(self) -> str: ...

    @property
    def status_code(self) -> int | None: ...

    @property
    def result(self) -> str | None: ...


def request_id(batch_id: str, line_no: int) -> str:
    """
    @return: llmgw's request id of a line, C{BATCH-LINE}: its usage
        record's key, the same each time it runs.
    """
    return f"{batch_id}-{line_no}"


def line_object_id(batch_id: str, line_no: int) -> str:
    """
    @return: the line's C{batch_req_...} id in the output files: made from
        the batch and the line, so that files written twice agree.
    """
    digest = hashlib.sha256(request_id(batch_id, line_no).encode()).hexdigest()
    return "batch_req_" + digest[:32]


def file_id(batch_id: str, which: str) -> str:
    """
    @param which: C{"output"} or C{"error"}.
    @return: the id of a batch's output or error file, made from the batch
        (a finalizing batch taken up again after a crash writes the same
        ids, and finds them written).
    """
    digest = hashlib.sha256(f"{batch_id}:{which}".encode()).hexdigest()
    return "file-" + digest[:24]


@dataclass(frozen=True)
class Files:
    """
    A batch's two files.

    @ivar output: the output file's JSONL, C{b""} when no line succeeded.
    @ivar error: the error file's JSONL, C{b""} when none failed.
    """

    output: bytes
    error: bytes


def _body(result: str | None) -> Any:
    if result is None:
        return None
    try:
        return json.loads(result)
    except ValueError:
        return result


def line_object(line: Line) -> tuple[bool, dict[str, Any]]:
    """
    @return: whether C{line} goes to the output file (else the error
        file), and its object there.
    """
    entry: dict[str, Any] = {
        "id": line_object_id(line.batch_id, line.line_no),
        "custom_id": line.custom_id,
        "response": None,
        "error": None,
    }
    if line.status_code is not None:
        entry["response"] = {
            "status_code": line.status_code,
            "request_id": request_id(line.batch_id, line.line_no),
            "body": _body(line.result),
        }
        return line.state == "done" and 200 <= line.status_code < 300, entry
    if line.state == "expired":
        entry["error"] = dict(EXPIRED)
    elif line.state == "cancelled":
        entry["error"] = dict(CANCELLED)
    else:
        error = _body(line.result)
        entry["error"] = (
            error
            if isinstance(error, dict)
            else {"code": "batch_line_failed", "message": str(error)}
        )
    return False, entry


def files(lines: Iterable[Line]) -> Files:
    """
    @param lines: a batch's lines, in the input file's order, none pending
        nor running.
    @return: its output and error files.
    """
    output: list[bytes] = []
    error: list[bytes] = []
    for line in lines:
        ok, entry = line_object(line)
        text = json.dumps(entry, separators=(",", ":")).encode("utf-8") + b"\n"
        (output if ok else error).append(text)
    return Files(b"".join(output), b"".join(error))


def request_counts(states: Mapping[str, int]) -> dict[str, int]:
    """
    @param states: a batch's lines counted by state
        (L{llmgw.store.base.Store.line_counts}).
    @return: its C{completed} (answered 2xx) and C{failed} (answered
        otherwise, or expired) lines, as the batch's C{request_counts}
        tell them; cancelled lines are in neither.
    """
    return {
        "completed": states.get("done", 0),
        "failed": states.get("failed", 0) + states.get("expired", 0),
    }
