"""
The batches' runner (L{llmgw.batches.runner}) on a L{Clock}, with a store
and a sender in memory: its back-off when a model has no room, its end of
a batch, and its stop.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.batches.dispatch import Answer
from llmgw.batches.ends import BatchEnds
from llmgw.batches.fixed_room import FixedRoom
from llmgw.batches.runner import Runner, RunnerSettings
from llmgw.router.edge.site import BatchLineId
from llmgw.store.batches import LINE_STATES, BatchLine, BatchRow, FileRow


class MemoryStore:
    """
    One batch and its lines, as the store's batch methods keep them.
    """

    def __init__(self, count: int) -> None:
        self.batch = BatchRow(
            "batch_x", 7, "k", "/v1/chat/completions", "file-in", "24h",
            "in_progress", 0.0, expires_at=86400.0, total=count,
        )  # fmt: skip
        self.lines = {
            n: BatchLine("batch_x", n, f"c{n}", "m", "/v1/chat/completions", "{}")
            for n in range(1, count + 1)
        }
        self.files: dict[str, bytes] = {}

    def requeue_lines(self, owner: str) -> Deferred[int]:
        return succeed(0)

    def active_batches(self) -> Deferred[list[BatchRow]]:
        over = self.batch.status in ("completed", "cancelled", "expired")
        return succeed([] if over else [self.batch])

    def line_counts(self, batch_id: str) -> Deferred[dict[str, int]]:
        counts = dict.fromkeys(LINE_STATES, 0)
        for line in self.lines.values():
            counts[line.state] += 1
        return succeed(counts)

    def update_batch(
        self, batch_id: str, changes: dict[str, Any], statuses: Any = None
    ) -> Deferred[bool]:
        if statuses is not None and self.batch.status not in statuses:
            return succeed(False)
        self.batch = replace(self.batch, **changes)
        return succeed(True)

    def claim_lines(self, batch_id: str, owner: str, limit: int) -> Deferred[Any]:
        taken = [n for n, line in sorted(self.lines.items()) if line.state == "pending"]
        for n in taken[:limit]:
            line = self.lines[n]
            self.lines[n] = replace(
                line, state="running", owner=owner, attempts=line.attempts + 1
            )
        return succeed([self.lines[n] for n in taken[:limit]])

    def release_line(self, batch_id: str, line_no: int, owner: str) -> Deferred[bool]:
        line = self.lines[line_no]
        if line.state != "running" or line.owner != owner:
            return succeed(False)
        self.lines[line_no] = replace(line, state="pending")
        return succeed(True)

    def finish_line(
        self, batch_id: str, line_no: int, owner: str, state: str,
        status_code: int | None, result: str | None, when: float | None = None,
    ) -> Deferred[bool]:  # fmt: skip
        line = self.lines[line_no]
        if line.state != "running" or line.owner != owner:
            return succeed(False)
        self.lines[line_no] = replace(
            line, state=state, status_code=status_code, result=result
        )
        return succeed(True)

    def batch_lines(self, batch_id: str) -> Deferred[list[BatchLine]]:
        return succeed([self.lines[n] for n in sorted(self.lines)])

    def get_file(self, file_id: str, key_id: int | None) -> Deferred[Any]:
        return succeed(None)

    def add_file(self, row: FileRow, content: bytes) -> Deferred[None]:
        self.files[row.id] = content
        return succeed(None)


class HeldSender:
    """
    Holds every line sent until the test answers it.
    """

    def __init__(self) -> None:
        self.sent: list[tuple[BatchLineId, Deferred[Answer]]] = []

    def send(self, line: BatchLineId, url: str, body: bytes) -> Deferred[Answer]:
        answer: Deferred[Answer] = Deferred()
        self.sent.append((line, answer))
        return answer

    def answer_all(self, status: int) -> None:
        sent, self.sent = self.sent, []
        for _, answer in sent:
            answer.callback(Answer(status, b'{"ok": true}'))


class RunnerTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.store = MemoryStore(3)
        self.sender = HeldSender()
        store: Any = self.store
        sender: Any = self.sender
        self.runner = Runner(
            self.clock,
            store,
            sender,
            FixedRoom(lambda model: 1, 8),
            lambda name: name,
            BatchEnds(store, self.clock.seconds),
            lambda: succeed(None),
            RunnerSettings(interval=1.0, backoff=1.0, max_backoff=30.0),
        )
        self.runner.startService()
        self.addCleanup(self._stopped)

    def _stopped(self) -> None:
        self.successResultOf(self.runner.stopService())
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_burst_of_refusals_one_backoff(self) -> None:
        """
        Lines refused together (503) pause their model once: they go back
        to pending and are sent again a second later, then two seconds
        after the next refusal; answered, the batch completes with its
        output file.
        """
        self.clock.advance(0)
        self.assertEqual(len(self.sender.sent), 3)
        self.sender.answer_all(503)
        states = {line.state for line in self.store.lines.values()}
        self.assertEqual(states, {"pending"})
        self.clock.advance(0)
        self.clock.advance(0.9)
        self.assertEqual(self.sender.sent, [])
        self.clock.advance(0.2)
        self.assertEqual(len(self.sender.sent), 3)
        self.sender.answer_all(503)
        self.clock.advance(0)
        self.clock.advance(1.5)
        self.assertEqual(self.sender.sent, [])
        self.clock.advance(1.0)
        self.assertEqual(len(self.sender.sent), 3)
        self.sender.answer_all(200)
        self.clock.advance(0)
        self.assertEqual(self.store.batch.status, "completed")
        self.assertEqual(self.store.batch.completed, 3)
        self.assertEqual([line.attempts for line in self.store.lines.values()], [3] * 3)
        (output,) = self.store.files.values()
        self.assertEqual(len(output.splitlines()), 3)

    def test_stop_puts_claimed_lines_back(self) -> None:
        """
        A stop puts the lines claimed and not sent back to pending, and
        waits for those in flight.
        """
        self.store.lines = {
            n: replace(self.store.lines[1], line_no=n, custom_id=f"c{n}")
            for n in range(1, 21)
        }
        self.clock.advance(0)
        self.assertEqual(len(self.sender.sent), 8)
        stopping = self.runner.stopService()
        self.assertNoResult(stopping)
        states = [line.state for line in self.store.lines.values()]
        self.assertEqual((states.count("running"), states.count("pending")), (8, 12))
        self.sender.answer_all(200)
        self.successResultOf(stopping)
        states = [line.state for line in self.store.lines.values()]
        self.assertEqual((states.count("done"), states.count("pending")), (8, 12))
