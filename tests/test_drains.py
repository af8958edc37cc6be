"""
Drains that keep models up, drains refused, engines stopped on purpose and
the models below their min_replicas published for the router
(L{llmgw.control.drains}, L{llmgw.control.publishing}); the real wire and
processes are in C{tests.test_e2e_drains}.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock

from llmgw.control.catalog import Model
from llmgw.control.drains import DrainRefused
from llmgw.control.inventory import Inventory
from llmgw.control.plane import ControlPlane
from llmgw.control.views import explain, replicas_json
from llmgw.router.interfaces import Shortfall
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import SETTINGS, Agents, PlaneCase, make_model


class _Case(PlaneCase):
    def one_ready(self, low: int = 1, nodes: tuple[str, ...] = ("n1", "n2")) -> str:
        """
        @return: the id of the model's one ready replica.
        """
        self.make(make_model(low=low), nodes=nodes)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (replica,) = self.plane.replicas
        return replica

    def node_of(self, replica: str) -> str:
        return self.plane.replicas[replica].shards[0].node


class RefusedTests(_Case):
    def test_only_node_refused(self) -> None:
        """
        Draining the only node that can hold a min_replicas = 1 model is
        refused, naming the model, and changes nothing; forced, the
        replica drains at once.
        """
        replica = self.one_ready(nodes=("n1",))
        serving = self.endpoints()
        with self.assertRaises(DrainRefused) as raised:
            self.plane.drain_node("n1")
        self.assertEqual(raised.exception.models, ["m"])
        self.assertEqual(
            str(raised.exception),
            "draining node n1 would leave model 'm' with 0 of its min_replicas 1:"
            " no room elsewhere for a replacement",
        )
        self.assertFalse(self.inventory.get("n1").draining)  # type: ignore[union-attr]
        self.assertEqual(self.inventory.drained, set())
        self.plane.reconcile()
        self.assertEqual(self.endpoints(), serving)
        self.assertIsNone(self.plane.replicas[replica].draining_since)

        self.assertEqual(self.plane.drain_node("n1", force=True), [replica])
        self.assertEqual(self.endpoints(), [])
        self.assertTrue(self.inventory.get("n1").draining)  # type: ignore[union-attr]

    def test_replica_drain_refused(self) -> None:
        """
        The drain of a model's only replica, with no room for another, is
        refused unless forced.
        """
        replica = self.one_ready(nodes=("n1",))
        with self.assertRaises(DrainRefused) as raised:
            self.plane.drain_replica(replica)
        self.assertEqual(raised.exception.models, ["m"])
        self.assertIsNone(self.plane.replicas[replica].leaving_since)
        self.assertTrue(self.plane.drain_replica(replica, force=True))
        self.assertEqual(self.endpoints(), [])

    def test_min_kept_without_room(self) -> None:
        """
        A model that keeps its min_replicas elsewhere is not a reason to
        refuse: with no room for a replacement, the node's replica drains
        at once.
        """
        self.make(make_model(low=2), nodes=("n1", "n2"))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.plane.scale("m", 1, 2)
        on_n1 = next(r for r in self.plane.replicas if self.node_of(r) == "n1")
        self.assertEqual(self.plane.drain_node("n1"), [on_n1])
        self.assertIsNotNone(self.plane.replicas[on_n1].draining_since)
        self.assertEqual(self.endpoints(), ["http://10.0.0.2:20000"])

    def test_two_replicas_one_place(self) -> None:
        """
        Two replicas leaving a node, one place elsewhere: the check counts
        one replacement, not two.
        """
        self.make(make_model(low=2), nodes=())
        self.register("n1", gpus=2)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.assertEqual({self.node_of(r) for r in self.plane.replicas}, {"n1"})
        self.register("n2", gpus=1)
        with self.assertRaises(DrainRefused) as raised:
            self.plane.drain_node("n1")
        self.assertIn("with 1 of its min_replicas 2", str(raised.exception))


class ReplacedFirstTests(_Case):
    def test_only_replica_replaced_first(self) -> None:
        """
        A replica drain of a model's only replica starts its replacement
        first: the model has a published replica at every pass.
        """
        replica = self.one_ready()
        node = self.node_of(replica)
        self.assertTrue(self.plane.drain_replica(replica))
        self.assertFalse(self.plane.drain_replica(replica))
        (shown,) = replicas_json(self.plane)
        self.assertEqual(
            (shown["state"], shown["leaving"]), ("ready", "an operator asked")
        )
        for _ in range(3):
            self.plane.reconcile()
            self.assertEqual(len(self.endpoints()), 1)
        (start,) = [s for _, s in self.agents.starts() if s.replica_id != replica]
        self.assertNotEqual(self.node_of(start.replica_id), node)
        self.ready_all()
        self.plane.reconcile()
        self.assertEqual(
            self.endpoints(),
            [f"http://10.0.0.{self.node_of(start.replica_id)[-1]}:20000"],
        )
        self.assertIsNotNone(self.plane.replicas[replica].draining_since)
        self.assertEqual(
            self.plane.replicas[replica].drain_reason,
            "an operator asked; its replacement is ready",
        )

    def test_failed_replacement_keeps_the_old(self) -> None:
        """
        A replacement that fails is retried after the backoff; the old
        replica serves meanwhile and drains once one is ready.
        """
        replica = self.one_ready()
        node = self.node_of(replica)
        self.plane.drain_node(node)
        self.plane.reconcile()
        _, first = self.agents.starts()[-1]
        self.status(first.shard_id, pb.SHARD_STATE_FAILED)
        self.plane.reconcile()
        self.assertEqual(len(self.endpoints()), 1)
        self.assertIsNone(self.plane.replicas[replica].draining_since)
        self.clock.advance(6)
        self.heartbeat("n1", "n2")
        self.plane.reconcile()
        _, second = self.agents.starts()[-1]
        self.assertNotEqual(second.shard_id, first.shard_id)
        self.assertEqual(len(self.endpoints()), 1)
        self.ready_all()
        self.plane.reconcile()
        self.assertIsNotNone(self.plane.replicas[replica].draining_since)
        self.assertEqual(len(self.endpoints()), 1)
        self.assertNotIn(node, str(self.plane.replicas[second.replica_id].shards))

    def test_held_when_room_goes(self) -> None:
        """
        A drain checked with room for a replacement, whose room is gone by
        the pass (the other node lost): the replica is held, serving, while
        its model is below min_replicas.
        """
        replica = self.one_ready()
        node = self.node_of(replica)
        other = "n2" if node == "n1" else "n1"
        self.plane.drain_node(node)
        self.plane.stop_engines([other])
        self.plane.reconcile()
        self.assertEqual(len(self.endpoints()), 1)
        self.assertIsNone(self.plane.replicas[replica].draining_since)
        self.assertIn(
            f"{other}: engines stopped",
            "\n".join(explain(self.plane, "m")["reasons"]),
        )
        self.plane.start_engines([other])
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.assertIsNotNone(self.plane.replicas[replica].draining_since)

    def test_undrain_keeps_the_replica(self) -> None:
        """
        A node taken back before the replacement is ready: its replica
        stays, and the surplus one goes.
        """
        replica = self.one_ready()
        node = self.node_of(replica)
        self.plane.drain_node(node)
        self.plane.reconcile()
        self.plane.undrain_node(node)
        self.plane.reconcile()
        self.assertIsNone(self.plane.replicas[replica].leaving_since)
        self.assertIsNone(self.plane.replicas[replica].draining_since)
        self.assertEqual(
            [r.id for r in self.plane.replicas.values() if r.draining_since is None],
            [replica],
        )

    def test_undrain_keeps_a_replica_drain(self) -> None:
        """
        A replica drained by its id stays leaving when its node is
        undrained: the undrain takes back only the node's own drain.
        """
        replica = self.one_ready()
        self.plane.drain_replica(replica)
        self.plane.undrain_node(self.node_of(replica))
        self.assertIsNotNone(self.plane.replicas[replica].leaving_since)

    def test_adopted_on_drained_node_replaced_first(self) -> None:
        """
        A node drained before this start registers with an engine: its
        replica serves until a replacement elsewhere is ready.
        """
        self.clock = Clock()
        self.clock.advance(1000)
        self.inventory = Inventory(drained=["n1"])
        self.agents = Agents()
        self.published = []
        self.plane = ControlPlane(
            self.clock,
            self.inventory,
            self.agents,
            (make_model(low=1),),
            SETTINGS,
            self.published.append,
        )
        self.register("n2")
        self.register(
            "n1",
            shards=(
                pb.RunningShard(
                    shard_id="m-aaaa-0",
                    replica_id="m-aaaa",
                    model="m",
                    profile="one",
                    state=pb.SHARD_STATE_READY,
                    port=20000,
                    gpu_indices=[0],
                    pid=77,
                ),
            ),
        )
        self.plane.reconcile()
        self.assertEqual(self.endpoints(), ["http://10.0.0.1:20000"])
        self.assertEqual([n for n, _ in self.agents.starts()], ["n2"])
        self.ready_all()
        self.plane.reconcile()
        self.assertEqual(self.endpoints(), ["http://10.0.0.2:20000"])
        self.assertEqual(
            self.plane.replicas["m-aaaa"].drain_reason,
            "node n1 is draining; its replacement is ready",
        )


class StopEnginesTests(_Case):
    def test_stop_and_start(self) -> None:
        """
        Stopping a node's engines drains its replicas at once (never
        refused), places nothing there, and keeps no drain; started again,
        the node is placed on.
        """
        replica = self.one_ready(nodes=("n1",))
        self.assertEqual(self.plane.stop_engines(["n1"]), [replica])
        self.assertEqual(self.endpoints(), [])
        self.plane.reconcile()
        self.assertEqual(
            self.agents.stops(), [self.plane.replicas[replica].shards[0].id]
        )
        self.assertEqual(self.inventory.drained, set())
        self.assertFalse(self.inventory.get("n1").draining)  # type: ignore[union-attr]
        self.status(self.agents.stops()[0], pb.SHARD_STATE_STOPPED, "n1")
        self.clock.advance(60)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)
        self.assertIn(
            "n1: engines stopped", "\n".join(explain(self.plane, "m")["reasons"])
        )
        # Its agent registers again: still stopped.
        self.register("n1")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)
        self.plane.start_engines(["n1"])
        self.clock.advance(6)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 2)
        self.assertRaises(KeyError, self.plane.stop_engines, ["n1", "n9"])
        self.assertFalse(self.inventory.get("n1").engines_stopped)  # type: ignore[union-attr]

    def test_adopted_on_stopped_node_stopped(self) -> None:
        """
        A node whose engines were stopped registers listing one (the stop
        was lost with its link): it is drained and stopped, not published.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.plane.stop_engines(["n1"])
        running = pb.RunningShard(
            shard_id="m-aaaa-0",
            replica_id="m-aaaa",
            model="m",
            profile="one",
            state=pb.SHARD_STATE_READY,
            port=20000,
            gpu_indices=[0],
            pid=77,
        )
        self.register("n1", shards=(running,))
        self.plane.reconcile()
        self.assertEqual(self.endpoints(), [])
        self.assertEqual(self.agents.stops(), ["m-aaaa-0"])


class ShortfallTests(_Case):
    def make(self, *models: Model, **kwargs: Any) -> None:
        self.shortfalls: list[tuple[Shortfall, ...]] = []
        super().make(*models, publish_shortfalls=self.shortfalls.append, **kwargs)

    def test_below_min_published(self) -> None:
        """
        The models with fewer published replicas than min_replicas are
        published beside the endpoints, and again when that changes (a
        drain forced, a scale); a min_replicas = 0 model is never short.
        """
        self.make(make_model(low=1), make_model("z", low=0), nodes=("n1",))
        self.plane.reconcile()
        self.assertEqual(self.shortfalls, [(Shortfall("m", 0, 1),)])
        self.ready_all()
        self.plane.reconcile()
        self.assertEqual(self.shortfalls[-1], ())
        (replica,) = self.plane.replicas
        self.plane.drain_replica(replica, force=True)
        self.assertEqual(self.shortfalls[-1], (Shortfall("m", 0, 1),))
        self.plane.scale("m", 0, 4)
        self.plane.reconcile()
        self.assertEqual(self.shortfalls[-1], ())
        self.plane.scale("m", 2, 4)
        self.plane.reconcile()
        self.assertEqual(self.shortfalls[-1], (Shortfall("m", 0, 2),))
        count = len(self.shortfalls)
        self.plane.reconcile()
        self.assertEqual(len(self.shortfalls), count)
