"""
How a batch moves through OpenAI's statuses once its lines run (the
runner, L{llmgw.batches.runner}, asks at each of its passes): its
C{request_counts} kept up to date, its lines past the completion window
C{expired}, a cancelled batch's pending lines cancelled, and, once no line
is pending or running, its output and error files written
(L{llmgw.batches.results}) and its last status set:

  - C{in_progress} -> C{finalizing} -> C{completed};
  - C{in_progress} past C{expires_at} -> C{expired} (its unanswered lines
    C{expired}, in the error file as OpenAI's C{batch_expired});
  - C{cancelling} -> C{cancelled} once its lines in flight ended.

Each step is one conditional write (L{llmgw.store.base.Store.update_batch}
with the statuses it may come from), so that a cancel racing the end loses
cleanly, and a server that died while C{finalizing} takes it up again: the
files' ids are made from the batch's, found written the second time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from twisted.logger import Logger

from llmgw.batches import results
from llmgw.store.base import Store
from llmgw.store.batches import BatchRow, FileRow

EXPIRE_CHUNK = 1000
"""
Pending lines of an expired batch ended per pass, at most.
"""


class BatchEnds:
    """
    A batch's status, counts and files, from its lines.

    @param store: the batches and their lines.
    @param wall_clock: POSIX seconds, the batches' times.
    """

    log = Logger()

    def __init__(self, store: Store, wall_clock: Callable[[], float]) -> None:
        self._store = store
        self._wall_clock = wall_clock

    async def counts(self, batch: BatchRow) -> dict[str, int]:
        """
        Read a batch's lines by state, and write its C{request_counts}
        when they changed.

        @return: its lines by state.
        """
        states = await self._store.line_counts(batch.id)
        counts = results.request_counts(states)
        if (counts["completed"], counts["failed"]) != (batch.completed, batch.failed):
            await self._store.update_batch(batch.id, counts)
        return states

    def expired(self, batch: BatchRow) -> bool:
        """
        @return: whether C{batch} is past its completion window.
        """
        return batch.expires_at is not None and self._wall_clock() >= batch.expires_at

    async def expire_pending(self, batch: BatchRow, owner: str) -> int:
        """
        End up to L{EXPIRE_CHUNK} of an expired batch's pending lines as
        C{expired}: claimed by C{owner}, then ended, so that a line another
        claimer took meanwhile is not touched.

        @return: the lines ended.
        """
        lines = await self._store.claim_lines(batch.id, owner, EXPIRE_CHUNK)
        now = self._wall_clock()
        for line in lines:
            await self._store.finish_line(
                batch.id, line.line_no, owner, "expired", None, None, now
            )
        return len(lines)

    async def cancel_pending(self, batch: BatchRow) -> None:
        """
        Cancel a cancelling batch's pending lines (those sent back to
        pending since the cancel too).
        """
        await self._store.cancel_lines(batch.id)

    async def finish(self, batch: BatchRow, states: dict[str, int]) -> None:
        """
        The batch has no line pending nor running: write its files and its
        last status (C{completed}, C{expired} or C{cancelled}).
        """
        came_from: tuple[str, ...] = ("in_progress", "finalizing")
        if batch.status == "cancelling":
            last, came_from = "cancelled", ("cancelling",)
        elif batch.status in ("in_progress", "finalizing") and self.expired(batch):
            last = "expired"
        else:
            last = "completed"
            if batch.status == "in_progress":
                moved = await self._store.update_batch(
                    batch.id,
                    {"status": "finalizing", "finalizing_at": self._wall_clock()},
                    ("in_progress",),
                )
                if not moved:
                    return  # Cancelled meanwhile: the next pass sees it.
        changes: dict[str, object] = {**results.request_counts(states)}
        if batch.api == "openai":
            changes.update(await self._files(batch))
        changes.update({"status": last, f"{last}_at": self._wall_clock()})
        if await self._store.update_batch(batch.id, changes, came_from):
            self.log.info(
                "batch {batch} {status}: {done} done, {failed} failed",
                batch=batch.id,
                status=last,
                done=states.get("done", 0),
                failed=states.get("failed", 0) + states.get("expired", 0),
            )

    async def _files(self, batch: BatchRow) -> dict[str, object]:
        """
        Write a batch's output and error files (those with a line), owned
        by its key; each only once.

        @return: C{output_file_id} and C{error_file_id} for the batch.
        """
        lines = await self._store.batch_lines(batch.id)
        made = results.files(lines)
        ids: dict[str, object] = {"output_file_id": None, "error_file_id": None}
        for which, content in (("output", made.output), ("error", made.error)):
            if not content:
                continue
            file_id = results.file_id(batch.id, which)
            if await self._store.get_file(file_id, batch.key_id) is None:
                row = FileRow(
                    file_id,
                    batch.key_id,
                    "batch_output",
                    f"{batch.id}_{which}.jsonl",
                    len(content),
                    math.floor(self._wall_clock()),
                )
                await self._store.add_file(row, content)
            ids[f"{which}_file_id"] = file_id
        return ids
