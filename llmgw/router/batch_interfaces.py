"""
What the router's Files and Batches routes need of where files and batches
are kept (docs/batches.md): L{FileStore} and L{BatchStore}, with the
records they pass.  The server and every router of a tier give them on the
store (L{llmgw.batches.kept}); the router imports none of that.

A file or a batch belongs to the key that made it: every read names the
key, and another key's reads as unknown (C{key_id} L{None}: a server
without keys, where they are everyone's).

A leaf, as L{llmgw.router.interfaces}: it imports nothing else of llmgw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from twisted.internet.defer import Deferred


@dataclass(frozen=True)
class KeptFile:
    """
    An uploaded file, without its bytes.

    @ivar id: C{"file-..."}.
    @ivar key_id: the key that uploaded it, or L{None} without keys.
    @ivar purpose: C{"batch"}; C{"batch_output"} for a batch's output and
        error files.
    @ivar filename: as the client named it.
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
class KeptBatch:
    """
    A batch of either API, as the store keeps it: the fields of OpenAI's
    batch object (times in POSIX seconds, L{None} until reached), and
    C{total}, C{completed}, C{failed} its C{request_counts}.

    @ivar input_file_id: L{None} for an Anthropic batch (its requests come
        inline).
    @ivar errors: validation errors, OpenAI's C{BatchError} objects.
    @ivar api: C{"openai"} or C{"anthropic"}.
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
class KeptLine:
    """
    One request of a batch.

    @ivar line_no: 1-based: its line in the input file, or its place in an
        Anthropic batch's C{requests}.
    @ivar url: the path it is sent to (C{/v1/chat/completions}...).
    @ivar body: the request body, JSON text.
    @ivar state: C{pending}, C{running}, C{done}, C{failed}, C{cancelled}
        or C{expired}.
    @ivar status_code: its answer's HTTP status, once it ended.
    @ivar result: its answer's body or error, JSON text, once it ended.
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


@dataclass(frozen=True)
class KeptUsage:
    """
    What a batch's lines used so far, from their usage records.

    @ivar requests: lines with a usage record.
    @ivar prompt_tokens: their prompt tokens.
    @ivar completion_tokens: their completion tokens.
    @ivar gpu_seconds: their share of their replicas' GPU time, seconds.
    @ivar cost: that time's price (docs/cost.md).
    """

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    gpu_seconds: float = 0.0
    cost: float = 0.0


class FileStore(Protocol):
    """
    Where uploaded files are kept, bytes and all.
    """

    def add(self, kept: KeptFile, content: bytes) -> Deferred[None]:
        """
        Keep a file; fires when written.
        """

    def get(self, file_id: str, key_id: int | None) -> Deferred[KeptFile | None]:
        """
        @return: fires with the file, or L{None} (unknown, another key's).
        """

    def content(self, file_id: str, key_id: int | None) -> Deferred[bytes | None]:
        """
        @return: fires with its bytes, or L{None} as L{get}.
        """

    def page(
        self,
        key_id: int | None,
        purpose: str | None,
        after: str | None,
        limit: int,
        order: str,
    ) -> Deferred[list[KeptFile]]:
        """
        @param after: a file id to page on (past it in C{order}).
        @param order: C{"asc"} or C{"desc"}, by creation.
        @return: fires with at most C{limit} of the key's files.
        """

    def delete(self, file_id: str, key_id: int | None) -> Deferred[bool]:
        """
        @return: fires with whether the key had that file.
        """


class BatchStore(Protocol):
    """
    Where batches and their lines are kept (the runner, another part of
    the server, runs the lines).
    """

    def add(self, batch: KeptBatch, lines: Sequence[KeptLine]) -> Deferred[None]:
        """
        Keep a batch and its lines, in one transaction.
        """

    def get(self, batch_id: str, key_id: int | None) -> Deferred[KeptBatch | None]:
        """
        @return: fires with the batch, or L{None} (unknown, another key's).
        """

    def page(
        self, key_id: int | None, after: str | None, limit: int, api: str
    ) -> Deferred[list[KeptBatch]]:
        """
        @param after: a batch id: those made before it (newest first).
        @param api: C{"openai"} or C{"anthropic"}: only that API's.
        """

    def update(
        self, batch_id: str, changes: dict[str, Any], statuses: Sequence[str]
    ) -> Deferred[bool]:
        """
        Change fields of a batch while its status is one of C{statuses}.

        @return: fires with whether it changed.
        """

    def cancel_lines(self, batch_id: str) -> Deferred[int]:
        """
        Cancel the batch's pending lines; fires with how many.
        """

    def line_counts(self, batch_id: str) -> Deferred[dict[str, int]]:
        """
        @return: fires with the batch's lines per state (every state).
        """

    def lines(self, batch_id: str) -> Deferred[list[KeptLine]]:
        """
        @return: fires with the batch's lines, by C{line_no}.
        """

    def usage(self, batch: KeptBatch) -> Deferred[KeptUsage]:
        """
        @return: fires with what the batch's lines used so far.
        """

    def delete(self, batch_id: str, key_id: int | None) -> Deferred[bool]:
        """
        Delete a batch and its lines; fires with whether the key had it.
        """


__all__ = [
    "BatchStore",
    "FileStore",
    "KeptBatch",
    "KeptFile",
    "KeptLine",
    "KeptUsage",
]
