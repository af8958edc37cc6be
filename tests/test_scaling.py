"""
Scaling policy, table-driven: each case is a model's state, the time and
the counts, and the expected decision (L{llmgw.control.scaling}).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control import scaling
from llmgw.control.inventory import NodeState
from llmgw.control.placement import Profile
from llmgw.control.records import ReplicaRecord, ShardRecord
from llmgw.control.scaling import LoadStep, ModelState
from llmgw.wire.states import ShardState
from tests.plane_support import SETTINGS, make_model

PROFILE = Profile(name="one", engine="sim", source="s", gpus=1, gpu_memory_gb=10)


def state(
    low: int = 1, high: int = 4, idle: float = 60, **kwargs: object
) -> ModelState:
    return ModelState(make_model(low=low, high=high, idle=idle), **kwargs)  # type: ignore[arg-type]


def replica(id: str, shard: ShardState, created: float = 0.0) -> ReplicaRecord:
    return ReplicaRecord(
        id, "m", PROFILE, [ShardRecord(f"{id}-0", "n1", (0,), 1, 0, shard)], created
    )


class BoundsTests(SynchronousTestCase):
    def test_bounded(self) -> None:
        """
        The wanted count is kept within min_replicas and max_replicas.
        """
        for low, high, wanted, expected in [
            (0, 4, 0, 0),
            (1, 4, 0, 1),
            (1, 4, 3, 3),
            (1, 4, 9, 4),
            (2, 2, 1, 2),
        ]:
            model = make_model(low=low, high=high)
            self.assertEqual(
                scaling.bounded(model, wanted), expected, (low, high, wanted)
            )

    def test_gone_idle(self) -> None:
        """
        Idle: above min, nobody waiting, nothing in flight, no request for
        idle_timeout; idle_timeout 0 never idles.
        """
        waiting = [Deferred[None]()]
        cases: list[tuple[dict[str, Any], float, bool, bool]] = [
            ({"wanted": 1, "last_used": 0.0}, 60.0, False, True),
            ({"wanted": 1, "last_used": 0.0}, 59.9, False, False),
            ({"wanted": 1, "last_used": 0.0}, 60.0, True, False),
            ({"wanted": 0, "last_used": 0.0}, 600.0, False, False),
            ({"wanted": 1, "waiters": waiting}, 600.0, False, False),
            ({"wanted": 1, "idle": 0}, 600.0, False, False),
            ({"wanted": 2, "low": 2}, 600.0, False, False),
        ]
        for kwargs, now, busy, expected in cases:
            low = kwargs.pop("low", 0)
            idle = kwargs.pop("idle", 60)
            model_state = state(low=low, idle=idle, **kwargs)
            self.assertEqual(
                scaling.gone_idle(model_state, now, busy), expected, (kwargs, now)
            )


class FollowLoadTests(SynchronousTestCase):
    def test_table(self) -> None:
        """
        Threshold 8 requests per ready replica: over it (all live ready,
        not above the wanted count) one more, up to max; over half of it
        the model is busy; light load for idle_timeout since the last
        busy moment (or the start) one fewer, not below min or 1.
        """
        cases: list[
            tuple[str, dict[str, Any], float, tuple[int, int, int], LoadStep]
        ] = [
            ("over", {"wanted": 1}, 100.0, (1, 1, 9), LoadStep(2, 100.0, +1)),
            ("at threshold", {"wanted": 1}, 100.0, (1, 1, 8), LoadStep(1, 100.0, 0)),
            ("one starting", {"wanted": 2}, 100.0, (2, 1, 40), LoadStep(2, 100.0, 0)),
            ("at max", {"wanted": 4}, 100.0, (4, 4, 99), LoadStep(4, 100.0, 0)),
            ("under half", {"wanted": 2}, 50.0, (2, 2, 7), LoadStep(2, 0.0, 0)),
            ("over half", {"wanted": 2}, 100.0, (2, 2, 9), LoadStep(2, 100.0, 0)),
            ("light long", {"wanted": 2}, 160.0, (2, 2, 0), LoadStep(1, 160.0, -1)),
            (
                "light since busy",
                {"wanted": 2, "busy_at": 120.0},
                160.0,
                (2, 2, 0),
                LoadStep(2, 120.0, 0),
            ),
            ("at min", {"wanted": 1}, 999.0, (1, 1, 0), LoadStep(1, 0.0, 0)),
            ("above max", {"wanted": 9}, 50.0, (4, 4, 0), LoadStep(4, 0.0, 0)),
            ("no replica", {"wanted": 1}, 100.0, (0, 0, 5), LoadStep(1, 0.0, 0)),
        ]
        for name, kwargs, now, counts, expected in cases:
            live, ready, in_flight = counts
            step = scaling.follow_load(
                state(**kwargs),
                now,
                0.0,
                8.0,
                live,
                ready,
                in_flight,
            )
            self.assertEqual(step, expected, name)

    def test_not_light_before_running_idle_timeout(self) -> None:
        """
        Just after the control plane started, light load scales nothing
        down: the time counts from the start.
        """
        step = scaling.follow_load(state(wanted=2), 100.0, 50.0, 8.0, 2, 2, 0)
        self.assertEqual(step, LoadStep(2, 0.0, 0))


class SurplusTests(SynchronousTestCase):
    def test_order(self) -> None:
        """
        Too many replicas: those not ready go first, then the least loaded,
        then the newest; none when not over.
        """
        a = replica("a", ShardState.READY, created=1.0)
        b = replica("b", ShardState.READY, created=2.0)
        c = replica("c", ShardState.STARTING, created=0.0)
        load = {"a": 3, "b": 3, "c": 9}
        for live, want, expected in [
            ([a, b, c], 3, []),
            ([a, b, c], 2, ["c"]),
            ([a, b, c], 1, ["c", "b"]),
            ([a, b], 1, ["b"]),
            ([a, b], 0, ["b", "a"]),
        ]:
            chosen = scaling.surplus(live, want, lambda r: load[r])
            self.assertEqual([r.id for r in chosen], expected, (want, len(live)))
        load["a"] = 0
        self.assertEqual(
            [r.id for r in scaling.surplus([a, b], 1, lambda r: load[r])], ["a"]
        )


class FailureTests(SynchronousTestCase):
    def test_backoff(self) -> None:
        """
        base_backoff doubled per failure after the first, at most
        max_backoff; a thousand failures do not overflow.
        """
        for failures, expected in [
            (1, 5.0),
            (2, 10.0),
            (3, 20.0),
            (4, 40.0),
            (5, 40.0),
        ]:
            self.assertEqual(scaling.backoff(5.0, 40.0, failures), expected)
        self.assertEqual(scaling.backoff(5.0, 40.0, 1100), 40.0)

    def test_failed_and_recovered(self) -> None:
        """
        A failure counts and sets the retry time; a lost node's does not
        count; a replica ready after the last failure clears them, an
        older one does not.
        """
        model = state()
        scaling.failed(model, 100.0, "boom", False, SETTINGS)
        scaling.failed(model, 110.0, "boom again", False, SETTINGS)
        self.assertEqual(
            (model.failures, model.failed_at, model.retry_at, model.last_error),
            (2, 110.0, 120.0, "boom again"),
        )
        scaling.failed(model, 115.0, "node lost", True, SETTINGS)
        self.assertEqual((model.failures, model.retry_at), (2, 120.0))
        self.assertEqual(model.last_error, "node lost")
        scaling.recovered(model, 109.0)
        self.assertEqual(model.failures, 2)
        scaling.recovered(model, 110.0)
        self.assertEqual((model.failures, model.last_error), (0, ""))

    def test_kept_after_adoption(self) -> None:
        """
        What ran before a restart is wanted, up to max_replicas.
        """
        model = make_model(low=0, high=2)
        for wanted, live, expected in [(0, 1, 1), (2, 1, 2), (0, 3, 2)]:
            self.assertEqual(scaling.kept_after_adoption(model, wanted, live), expected)


class NodeStateTests(SynchronousTestCase):
    def test_of_silence(self) -> None:
        """
        Silent for unreachable_after: unreachable; for lost_after: lost.
        """
        for silent, expected in [
            (0.0, NodeState.READY),
            (14.9, NodeState.READY),
            (15.0, NodeState.UNREACHABLE),
            (59.9, NodeState.UNREACHABLE),
            (60.0, NodeState.LOST),
        ]:
            got = NodeState.of_silence(
                silent, SETTINGS.unreachable_after, SETTINGS.lost_after
            )
            self.assertEqual(got, expected, silent)
