"""
L{llmgw.batches.room.EngineRoom}: the batch lines a model may take beside
its interactive traffic, by its engines' load (docs/batches.md, "Batch
work and interactive traffic"), on a L{Clock} with readings set by hand.
"""

from __future__ import annotations

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.batches.room import LEAST_SAMPLES, WINDOW, EngineRoom
from llmgw.router.interfaces import Endpoint, RequestRecord
from llmgw.router.routing.balancer import Replica
from llmgw.router.routing.gpu_share import Mark
from llmgw.router.routing.load import EngineLoad


class Board:
    """
    Load readings set by hand, fresh unless marked stale.
    """

    def __init__(self) -> None:
        self.readings: dict[str, EngineLoad] = {}
        self.stale_ids: set[str] = set()
        self.blind: set[str] = set()

    def reading(self, replica_id: str) -> EngineLoad | None:
        return self.readings.get(replica_id)

    def stale(self, replica_id: str, now: float) -> bool:
        return replica_id in self.stale_ids or replica_id not in self.readings

    def has_metrics(self, replica_id: str) -> bool | None:
        if replica_id in self.blind:
            return False
        return True if replica_id in self.readings else None


def record(model: str, ttft: float, batch: str | None = None) -> RequestRecord:
    return RequestRecord(
        request_id="r",
        upstream_request_id="r",
        model=model,
        replica="a",
        status=200,
        stream=True,
        prompt_tokens=10,
        completion_tokens=10,
        latency=ttft + 0.01,
        time_to_first_token=ttft,
        batch_id=batch,
    )


class RoomTests(SynchronousTestCase):
    """
    The room is the capacity the engines' readings show, less the
    interactive traffic's recent peak, a reserve, and the lines in flight.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.board = Board()
        # The marks of the lines sent, for Replica.leave.
        self.marks: list[Mark] = []
        self.replicas: dict[str, list[Replica]] = {
            "m": [Replica(Endpoint("a", "http://a", ("m",)))]
        }
        self.room = EngineRoom(
            self.clock, lambda m: self.replicas.get(m, []), self.board, 0.2
        )

    def read(
        self,
        rid: str = "a",
        running: float = 0,
        waiting: float = 0,
        cache: float | None = None,
    ) -> None:
        self.board.readings[rid] = EngineLoad(
            running, waiting, cache, self.clock.seconds()
        )

    def test_kv_cache_capacity(self) -> None:
        """
        The capacity is the sequences that fit in 90 % of the KV cache at
        each running one's use now: 4 running at 10 % is 36; the room
        leaves the 4 interactive ones (their peak), a fifth of them (1) and
        one per replica.
        """
        self.replicas["m"][0].outstanding = 4
        self.read(running=4, cache=0.1)
        self.assertEqual(self.room.room("m"), 36 - 4 - 1 - 1)

    def test_lines_in_flight_count(self) -> None:
        """
        Lines sent and not ended take room; ended ones give it back.  The
        lines the router counts in flight are not taken for interactive
        traffic.
        """
        self.read(running=10, cache=0.25)
        replica = self.replicas["m"][0]
        for _ in range(10):
            self.marks.append(replica.enter(0.0, batch=True))
            self.room.sent("m")
        # 36 capacity, no interactive traffic, 1 reserve, 10 lines.
        self.assertEqual(self.room.room("m"), 36 - 0 - 1 - 10)
        self.room.ended("m")
        replica.leave(0.0, self.marks.pop(), batch=True)
        self.read(running=9, cache=0.225)
        self.assertEqual(self.room.room("m"), 36 - 0 - 1 - 9)
        self.assertEqual(self.room.in_flight("m"), 9)

    def test_queue_means_no_room(self) -> None:
        """
        An engine that queues a request, or whose KV cache is 90 % used,
        gives the model no room: batch lines are the first to wait.
        """
        self.read(running=4, waiting=1, cache=0.1)
        self.assertEqual(self.room.room("m"), 0)
        self.read(running=4, cache=0.95)
        self.assertEqual(self.room.room("m"), 0)

    def test_interactive_peak_kept(self) -> None:
        """
        The interactive traffic's peak over the last L{WINDOW} seconds is
        kept free for it, not only what it has in flight now.
        """
        self.read(running=8, cache=0.2)
        self.replicas["m"][0].outstanding = 8
        self.assertEqual(self.room.room("m"), 36 - 8 - 2 - 1)
        self.clock.advance(1)
        # Idle: its last figure of what its cache holds stands.
        self.read(running=0, cache=0.0)
        self.replicas["m"][0].outstanding = 0
        self.assertEqual(self.room.room("m"), 36 - 8 - 2 - 1)
        self.clock.advance(WINDOW)
        self.read(running=1, cache=0.025)
        self.replicas["m"][0].outstanding = 1
        self.assertEqual(self.room.room("m"), 36 - 1 - 1 - 1)

    def test_lines_are_not_clients(self) -> None:
        """
        The lines the router counts on a replica are no interactive
        traffic: a wave of them ending leaves no peak behind, though the
        engine's reading still shows them running until the next poll.
        """
        replica = self.replicas["m"][0]
        self.read(running=0, cache=0.0)
        self.read(running=20, cache=0.2)
        for _ in range(20):
            self.marks.append(replica.enter(0.0, batch=True))
            self.room.sent("m")
        self.assertEqual(self.room.room("m"), 90 - 0 - 1 - 20)
        for _ in range(20):
            replica.leave(0.0, self.marks.pop(), batch=True)
            self.room.ended("m")
        self.clock.advance(0.05)
        self.assertEqual(self.room.room("m"), 90 - 0 - 1)

    def test_other_routers_requests(self) -> None:
        """
        Requests the engine holds at two readings in a row beyond the
        router's count (a tier's routers') count as interactive traffic,
        the smaller of the two.
        """
        self.read(running=0, cache=0.0)
        self.room.room("m")
        self.clock.advance(1)
        self.read(running=10, cache=0.1)
        self.assertEqual(self.room.room("m"), 90 - 0 - 1)
        self.clock.advance(1)
        self.read(running=12, cache=0.12)
        self.assertEqual(self.room.room("m"), 90 - 10 - 2 - 1)

    def test_slots_learnt_from_a_lasting_queue(self) -> None:
        """
        An engine that queues at two readings in a row runs all it can:
        its running count bounds its capacity from then on, below what its
        KV cache would hold; a queue seen once is not taken for it.
        """
        self.read(running=3, waiting=1, cache=0.03)
        self.assertEqual(self.room.room("m"), 0)
        self.read(running=3, cache=0.03)
        self.assertEqual(self.room.room("m"), 90 - 3 - 1 - 1)
        self.clock.advance(1)
        self.read(running=20, waiting=2, cache=0.2)
        self.room.room("m")
        self.clock.advance(1)
        self.read(running=20, waiting=1, cache=0.2)
        self.room.room("m")
        self.clock.advance(WINDOW + 1)
        self.read(running=0, cache=0.0)
        self.assertEqual(self.room.room("m"), 20 - 0 - 1)

    def test_unknown_capacity_learnt_step_by_step(self) -> None:
        """
        An engine that says no cache use: one line more than it runs,
        until it queues.
        """
        self.read(running=0, cache=None)
        self.assertEqual(self.room.room("m"), 1)
        self.room.sent("m")
        self.read(running=1, cache=None)
        self.assertEqual(self.room.room("m"), 1)
        self.read(running=1, waiting=1, cache=None)
        self.assertEqual(self.room.room("m"), 0)

    def test_stale_reading_gives_no_room(self) -> None:
        """
        A replica whose reading is stale gives the batch nothing.
        """
        self.read(running=1, cache=0.01)
        self.board.stale_ids.add("a")
        self.assertEqual(self.room.room("m"), 0)

    def test_engine_without_metrics(self) -> None:
        """
        A replica whose engine serves no load metrics takes one line while
        the router counts nothing in flight to it.
        """
        self.board.blind.add("a")
        self.assertEqual(self.room.room("m"), 1)
        self.room.sent("m")
        self.replicas["m"][0].outstanding = 1
        self.assertEqual(self.room.room("m"), 0)

    def test_no_replica_one_line_asks_for_the_model(self) -> None:
        """
        A model without a replica gets one line, which asks the control
        plane for it; a second waits.
        """
        self.assertEqual(self.room.room("cold"), 1)
        self.room.sent("cold")
        self.assertEqual(self.room.room("cold"), 0)

    def test_ejected_replica_counts_nothing(self) -> None:
        """
        Every replica ejected: no room (the model is not asked for again).
        """
        self.read(running=1, cache=0.01)
        self.replicas["m"][0].ejected_until = self.clock.seconds() + 5
        self.assertEqual(self.room.room("m"), 0)


class ShareTests(SynchronousTestCase):
    """
    The interactive requests' time to first token beside batch lines is
    judged against theirs without: past the share, the lines in flight
    halve and grow again only after a window without a breach.  Ten
    interactive requests are in flight throughout; the engine's cache
    holds 90 sequences.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.board = Board()
        # The marks of the lines sent, for Replica.leave.
        self.marks: list[Mark] = []
        self.replica = Replica(Endpoint("a", "http://a", ("m",)))
        self.replica.outstanding = 10
        self.room = EngineRoom(self.clock, lambda m: [self.replica], self.board, 0.2)
        self.settle()
        for _ in range(LEAST_SAMPLES):
            self.room.record(record("m", 0.1))
        self.clock.advance(1)

    def settle(self) -> None:
        running = self.replica.outstanding
        self.board.readings["a"] = EngineLoad(
            running, 0, 0.01 * running, self.clock.seconds()
        )

    def send(self, n: int) -> None:
        for _ in range(n):
            self.room.sent("m")
            self.marks.append(self.replica.enter(0.0, batch=True))
        self.settle()

    def end(self, n: int) -> None:
        for _ in range(n):
            self.room.ended("m")
            self.replica.leave(0.0, self.marks.pop(), batch=True)
        self.settle()

    def beside(self, ttft: float) -> None:
        for _ in range(LEAST_SAMPLES):
            self.room.record(record("m", ttft))

    def test_breach_halves_the_lines(self) -> None:
        """
        With 20 lines in flight and interactive requests at 1.5 times
        their time alone, the limit is 10 lines: no room until 10 end.
        """
        self.send(20)
        self.beside(0.15)
        self.assertTrue(self.room.breached("m"))
        self.assertEqual(self.room.room("m"), 0)
        self.end(10)
        self.assertEqual(self.room.room("m"), 0)
        self.end(1)
        self.assertEqual(self.room.room("m"), 1)

    def test_within_share_no_limit(self) -> None:
        """
        At 1.1 times their time alone, nothing is cut: 90, less the 10
        interactive, 2 for their growth, 1 per replica and 20 lines.
        """
        self.send(20)
        self.beside(0.11)
        self.assertFalse(self.room.breached("m"))
        self.assertEqual(self.room.room("m"), 90 - 10 - 2 - 1 - 20)

    def test_limit_grows_back(self) -> None:
        """
        After a window without a breach the limit doubles; past the
        capacity it is lifted.
        """
        self.send(8)
        self.beside(0.2)
        self.assertEqual(self.room.room("m"), 0)
        self.end(8)
        self.assertEqual(self.room.room("m"), 4)
        self.clock.advance(WINDOW)
        self.settle()
        self.assertEqual(self.room.room("m"), 8)
        for _ in range(4):
            self.clock.advance(WINDOW)
            self.settle()
            self.room.room("m")
        self.assertEqual(self.room.room("m"), 90 - 10 - 2 - 1)

    def test_batch_records_not_judged(self) -> None:
        """
        A batch line's own record is not an interactive request's.
        """
        self.send(1)
        for _ in range(LEAST_SAMPLES):
            self.room.record(record("m", 1.0, batch="batch_1"))
        self.assertFalse(self.room.breached("m"))
