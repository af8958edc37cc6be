"""
The batches' runner: a service of the server that runs only while it leads
(L{llmgw.server.standby}), sending each batch line through the server's own
client API (L{llmgw.batches.dispatch}) and keeping every line's progress in
the store, so that nothing is lost and nothing ends twice:

  - at each start (so on taking the lead) it takes a new random owner id
    and puts every line left C{running} by another owner back to pending
    (L{llmgw.store.base.Store.requeue_lines}): a line in flight when a
    server died runs again;
  - it claims lines (pending -> running under its owner, atomically), asks
    the L{BatchRoom} of their model before sending each, and ends each with
    its answer only while it still owns it
    (L{llmgw.store.base.Store.finish_line}): a stale runner's answer is
    dropped, and a line ends once;
  - a line answered 429 or 503 (no room, the key's rate, no replica) or
    never answered (the connection failed: the server is stopping) goes
    back to pending with a back-off; any other answer is the line's, 2xx
    done, else failed.  A 429 holds back the line's key (its rate, its
    budget: another key's lines of the same model go on), its lines
    claimed and not sent put back to pending so that they keep no other
    batch from being claimed; a 503 or no answer holds back the line's
    model (no replica, no room: every key's lines of it wait);
  - a line run twice is billed once: its llmgw request id is its own,
    C{BATCH-LINE}, the usage table's key, and the attempts sent again keep
    no usage row (L{llmgw.router.interfaces.BATCH_RUN_AGAIN}); a line is
    ended only once its usage row is written (C{usage_written}), so that
    a crash between the two runs it again, its second row dropped, rather
    than end it unbilled.

Its passes (every C{interval}, and sooner when lines end) move each active
batch along (L{llmgw.batches.ends}).  Passes never overlap; one that fails
is logged and the next goes on.
"""

from __future__ import annotations

import json
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from llmgw.batches.dispatch import LineSender, NotSent
from llmgw.batches.ends import BatchEnds
from llmgw.batches.pauses import Pauses
from llmgw.router.edge.site import BatchLineId
from llmgw.router.interfaces import BATCH_RUN_AGAIN, BatchRoom
from llmgw.store.base import Store
from llmgw.store.batches import BatchLine, BatchRow


@dataclass(frozen=True)
class RunnerSettings:
    """
    @ivar concurrency: lines in flight at most, over every batch and model.
    @ivar interval: seconds between passes while no line ends.
    @ivar backoff: seconds a key's lines wait after a 429, a model's after
        a 503 (or its C{Retry-After}), doubled at each one more, up to
        C{max_backoff}.
    @ivar stop_timeout: seconds a stop waits for the lines in flight.
    """

    concurrency: int = 64
    interval: float = 1.0
    backoff: float = 1.0
    max_backoff: float = 30.0
    stop_timeout: float = 30.0


class Runner(Service):
    """
    Runs the lines of every active batch.

    @param clock: the reactor's clock.
    @param store: the batches and their lines.
    @param sender: sends one line to the client API.
    @param room: how many lines of a model may be in flight now.
    @param resolve: the catalog model a line's model name names (an alias
        its model), or L{None} for a name the catalog does not know: the
        room is asked by catalog name.
    @param ends: moves the batches' statuses, counts and files.
    @param usage_written: writes the usage records buffered now; fires
        once written (or the write failed: they stay buffered).
    @param settings: its bounds and timings.
    @ivar owner: its owner id since its last start (random per start).
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        store: Store,
        sender: LineSender,
        room: BatchRoom,
        resolve: Callable[[str], str | None],
        ends: BatchEnds,
        usage_written: Callable[[], Deferred[None]],
        settings: RunnerSettings,
    ) -> None:
        self._clock = clock
        self._store = store
        self._sender = sender
        self._room = room
        self._resolve = resolve
        self._ends = ends
        self._usage_written = usage_written
        self._settings = settings
        self.owner = ""
        self._fresh = False
        self._timer: IDelayedCall | None = None
        self._pass: Deferred[None] | None = None
        self._again = False
        self._waiting: dict[str, deque[tuple[BatchRow, BatchLine]]] = {}
        self._sending: dict[tuple[str, int], Deferred[None]] = {}
        self._models: Pauses[str] = Pauses(
            clock, settings.backoff, settings.max_backoff
        )
        self._keys: Pauses[int | None] = Pauses(
            clock, settings.backoff, settings.max_backoff
        )
        self._unreleased: list[tuple[str, int]] = []

    # The service and its passes

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self.owner = "runner-" + secrets.token_hex(8)
        self._fresh = True
        self._schedule(0)

    def stopService(self) -> Deferred[None]:
        """
        Stop claiming and sending; the lines claimed and not sent go back
        to pending; fires once the lines in flight ended (or after
        C{stop_timeout}: those left run again at the next start).
        """
        if not self.running:
            return succeed(None)
        super().stopService()  # type: ignore[no-untyped-call]
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        return Deferred.fromCoroutine(self._stop())

    async def _stop(self) -> None:
        if self._pass is not None:
            await _settled(self._pass)
        waiting = [line for queue in self._waiting.values() for line in queue]
        self._waiting.clear()
        for batch, line in waiting:
            await self._release(batch.id, line.line_no)
        if self._sending:
            self.log.info(
                "batch runner: waiting for {count} lines in flight",
                count=len(self._sending),
            )
            flying = DeferredList(list(self._sending.values()), consumeErrors=True)
            await _within(self._clock, flying, self._settings.stop_timeout)

    def kick(self) -> None:
        """
        Ask for a pass soon (right after the one running, if one is).
        """
        if not self.running:
            return
        if self._pass is not None:
            self._again = True
        elif self._timer is not None and self._timer.active():
            self._timer.reset(0)
        else:
            self._schedule(0)

    def _schedule(self, delay: float) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = self._clock.callLater(delay, self._run_pass)

    def _run_pass(self) -> None:
        self._timer = None
        self._again = False
        # Set before the pass starts: a kick from within it (one that ends
        # without waiting) is one more pass, not a timer the end replaces.
        passing: Deferred[None] = Deferred()
        self._pass = passing
        Deferred.fromCoroutine(self._one_pass()).chainDeferred(passing)
        passing.addBoth(self._passed)

    def _passed(self, _: object) -> None:
        self._pass = None
        if not self.running:
            return
        delay = 0 if self._again else self._settings.interval
        # A paused model's or key's lines go as soon as its pause ends.
        self._schedule(min([delay, *self._models.ends(), *self._keys.ends()]))

    async def _one_pass(self) -> None:
        try:
            if self._fresh:
                moved = await self._store.requeue_lines(self.owner)
                self._fresh = False
                self.log.info(
                    "batch runner {owner} started; {count} lines left running"
                    " before it put back to pending",
                    owner=self.owner,
                    count=moved,
                )
            for batch_id, line_no in self._take_unreleased():
                await self._release(batch_id, line_no)
            for batch in await self._store.active_batches():
                try:
                    await self._tend(batch)
                except Exception:
                    # One batch's trouble does not hold the others back.
                    self.log.failure("batch runner: batch {batch}", batch=batch.id)
        except Exception:
            self.log.failure("batch runner: pass failed; next pass as usual")
        self._send_waiting()

    # One batch

    async def _tend(self, batch: BatchRow) -> None:
        """
        One pass over one active batch: its counts, its expiry or cancel,
        its end once no line is left, else more of its lines claimed.
        """
        if batch.status == "validating":
            # Being made (the Batches API's), unless its maker died.
            if await self._ends.adopt(batch):
                self.kick()
            return
        if batch.status == "cancelling":
            await self._ends.cancel_pending(batch)
            await self._end_waiting(batch.id, "cancelled")
        expired = batch.status == "in_progress" and self._ends.expired(batch)
        if expired:
            await self._end_waiting(batch.id, "expired")
            await self._ends.expire_pending(batch, self.owner)
        states = await self._ends.counts(batch)
        if states.get("pending", 0) == 0 and states.get("running", 0) == 0:
            await self._ends.finish(batch, states)
        elif (
            batch.status == "in_progress"
            and not expired
            and states["pending"]
            and not self._keys.paused(batch.key_id)
        ):
            await self._claim(batch)

    async def _claim(self, batch: BatchRow) -> None:
        """
        Claim as many of C{batch}'s lines as may wait beside those in
        flight (as many again as C{concurrency}), into each model's queue.
        """
        free = 2 * self._settings.concurrency - len(self._sending) - self._queued()
        if free <= 0:
            return
        for line in await self._store.claim_lines(batch.id, self.owner, free):
            model = self._resolve(line.model) or line.model
            self._waiting.setdefault(model, deque()).append((batch, line))

    async def _end_waiting(self, batch_id: str, state: str) -> None:
        """
        End the lines of C{batch_id} claimed and not sent (cancelled, or
        expired): taken out of the queues first, so that no line ending
        meanwhile sends one of them.
        """
        ending = []
        for model, queue in list(self._waiting.items()):
            kept = deque(item for item in queue if item[0].id != batch_id)
            ending += [line for batch, line in queue if batch.id == batch_id]
            if kept:
                self._waiting[model] = kept
            else:
                del self._waiting[model]
        for line in ending:
            await self._store.finish_line(
                batch_id, line.line_no, self.owner, state, None, None
            )

    def _queued(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    # Lines

    def _send_waiting(self) -> None:
        """
        Send the claimed lines each model has room for now, within
        C{concurrency}.
        """
        if not self.running:
            return
        limit = self._settings.concurrency
        for model, queue in list(self._waiting.items()):
            if self._models.paused(model):
                continue
            room = self._room.room(model)
            held: deque[tuple[BatchRow, BatchLine]] = deque()
            while queue and room > 0 and len(self._sending) < limit:
                batch, line = queue.popleft()
                if self._keys.paused(batch.key_id):
                    held.append((batch, line))
                    continue
                room -= 1
                self._room.sent(model)
                key = (batch.id, line.line_no)
                sending = Deferred.fromCoroutine(self._run(batch, line, model))
                self._sending[key] = sending
                sending.addBoth(self._ended, key)
            queue.extendleft(reversed(held))
            if not queue:
                del self._waiting[model]

    def _ended(self, _: object, key: tuple[str, int]) -> None:
        self._sending.pop(key, None)
        self._send_waiting()
        if self._queued() < self._settings.concurrency:
            self.kick()

    async def _run(self, batch: BatchRow, line: BatchLine, model: str) -> None:
        """
        Send one line and end it with its answer, or put it back to
        pending (L{BATCH_RUN_AGAIN}, or no answer).

        @param model: its catalog model, the room's name for it.
        """
        ident = BatchLineId(batch.id, line.line_no, batch.key_id)
        try:
            try:
                answer = await self._sender.send(ident, line.url, line.body.encode())
            finally:
                self._room.ended(model)
        except NotSent as e:
            self.log.debug("line {line} not sent: {why}", line=ident, why=e)
            self._models.pause(model, None)
            await self._release(batch.id, line.line_no)
            return
        except Exception:
            self.log.failure("batch {batch}: line {line}", batch=batch.id, line=line)
            await self._release(batch.id, line.line_no)
            return
        if answer.status == 429:
            # The key's rate or budget, or the model's waiting room full:
            # this key's lines wait; another key's may go.
            self._keys.pause(batch.key_id, answer.retry_after)
            await self._release(batch.id, line.line_no)
            await self._put_back(batch.key_id)
            return
        if answer.status in BATCH_RUN_AGAIN:
            self._models.pause(model, answer.retry_after)
            await self._release(batch.id, line.line_no)
            return
        self._models.answered(model)
        self._keys.answered(batch.key_id)
        state = "done" if 200 <= answer.status < 300 else "failed"
        try:
            await self._usage_written()
            await self._store.finish_line(
                batch.id,
                line.line_no,
                self.owner,
                state,
                answer.status,
                _result(answer.body),
            )
        except Exception:
            self.log.failure("batch {batch}: ending line {no}", batch=batch.id, no=line)
            self._unreleased.append((batch.id, line.line_no))

    async def _put_back(self, key_id: int | None) -> None:
        """
        Put the lines of C{key_id} claimed and not sent back to pending:
        held back, they would fill the queues and keep other keys' batches
        from being claimed.
        """
        lines = []
        for model, queue in list(self._waiting.items()):
            kept = deque(item for item in queue if item[0].key_id != key_id)
            lines += [
                (batch.id, line.line_no)
                for batch, line in queue
                if batch.key_id == key_id
            ]
            if kept:
                self._waiting[model] = kept
            else:
                del self._waiting[model]
        for batch_id, line_no in lines:
            await self._release(batch_id, line_no)

    async def _release(self, batch_id: str, line_no: int) -> None:
        try:
            await self._store.release_line(batch_id, line_no, self.owner)
        except Exception:
            # Tried again at the next pass; at worst the next start's
            # requeue puts it back.
            self._unreleased.append((batch_id, line_no))

    def _take_unreleased(self) -> list[tuple[str, int]]:
        taken, self._unreleased = self._unreleased, []
        return taken


def _result(body: bytes) -> str:
    """
    @return: an answer's body as the line's result, JSON text: the body
        itself when it is JSON, else an error object quoting it.
    """
    text = body.decode("utf-8", "replace")
    try:
        json.loads(text)
    except ValueError:
        return json.dumps(
            {"error": {"message": text[:2000], "type": "api_error", "code": None}}
        )
    return text


async def _settled(d: Deferred[None]) -> None:
    waited: Deferred[None] = Deferred()
    d.addBoth(lambda _: waited.callback(None))
    await waited


async def _within(clock: IReactorTime, d: Deferred[Any], seconds: float) -> None:
    """
    Wait for C{d}, at most C{seconds}; C{d} is not cancelled.
    """
    waited: Deferred[None] = Deferred()

    def late() -> None:
        if not waited.called:
            waited.callback(None)

    timer = clock.callLater(seconds, late)

    def fired(_: object) -> None:
        if timer.active():
            timer.cancel()
        if not waited.called:
            waited.callback(None)

    d.addBoth(fired)
    await waited
