"""
The control plane's reconciler: placement, failures, node silence, drains
and the catalog at run time (see L{tests.plane_support}).
"""

from __future__ import annotations

from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock

from llmgw.control.catalog import Model
from llmgw.control.inventory import Inventory
from llmgw.control.placement import Profile
from llmgw.control.plane import ControlPlane
from llmgw.control.views import explain, models_json
from llmgw.router.interfaces import Endpoint
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import (
    SETTINGS,
    Agents,
    PlaneCase,
    make_model,
    register_message,
)


class ReconcileTests(PlaneCase):
    def test_one_replica_per_node_and_published_once(self) -> None:
        """
        min_replicas = 2 on two nodes of one GPU: one replica on each, each
        told its port and GPU; once ready both are published, and a pass
        with nothing changed publishes nothing.
        """
        self.make(make_model(low=2))
        self.plane.reconcile()
        starts = self.agents.starts()
        self.assertEqual(sorted(node for node, _ in starts), ["n1", "n2"])
        self.assertEqual([list(s.gpu_indices) for _, s in starts], [[0], [0]])
        self.assertEqual({s.port for _, s in starts}, {20000})
        self.assertEqual({s.model for _, s in starts}, {"m"})
        self.assertEqual(self.endpoints(), [])
        self.ready_all()
        self.plane.reconcile()
        self.assertEqual(
            self.endpoints(), ["http://10.0.0.1:20000", "http://10.0.0.2:20000"]
        )
        self.assertEqual(self.published[-1][0].models, ("m", "m-alias"))
        count = len(self.published)
        self.plane.reconcile()
        self.plane.reconcile()
        self.assertEqual(len(self.published), count)
        self.assertEqual(len(self.agents.starts()), 2)

    def test_failed_replica_replaced_after_exponential_backoff(self) -> None:
        """
        A shard that fails takes its replica with it; the next is placed
        after base_backoff, the one after that after twice as long.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        first = self.agents.starts()[0][1].shard_id
        self.status(first, pb.SHARD_STATE_FAILED)
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)
        self.assertIn("boom", models_json(self.plane)[0]["last_error"])
        self.clock.advance(4.9)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)
        self.clock.advance(0.2)
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 2)
        second = self.agents.starts()[1][1].shard_id
        self.status(second, pb.SHARD_STATE_FAILED)
        self.plane.reconcile()
        self.clock.advance(9.9)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 2)
        self.clock.advance(0.2)
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 3)
        # Ready again: the backoff starts over, the last error is history.
        self.ready_all()
        self.plane.reconcile()
        self.assertEqual(models_json(self.plane)[0]["failures_in_a_row"], 0)
        self.assertIsNone(models_json(self.plane)[0]["last_error"])

    def test_refused_start_is_a_failure(self) -> None:
        """
        An agent refusing StartShard fails the replica like an engine exit.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.agents.refuse["n1"] = ""
        self.plane.reconcile()
        self.plane.reconcile()
        self.assertEqual(self.plane.replicas, {})
        self.assertIn("n1 refuses", models_json(self.plane)[0]["last_error"])
        # Not a port conflict: the next try uses the same port.
        self.clock.advance(6)
        self.heartbeat("n1")
        self.plane.reconcile()
        ports = [s.port for _, s in self.agents.starts()]
        self.assertEqual(ports, [20000, 20000])

    def test_nodes_sharing_an_address_share_ports(self) -> None:
        """
        Two agents on one host: their engines get different ports.
        """
        self.make(make_model(low=2), nodes=())
        for node in ("n1", "n2"):
            message = register_message(node, gpus=2)
            message.address = "10.9.9.9"
            self.inventory.register(message, 0.0, self.clock.seconds())
            self.plane.node_registered(node, message)
        self.plane.reconcile()
        starts = self.agents.starts()
        self.assertEqual(sorted(n for n, _ in starts), ["n1", "n2"])
        self.assertEqual(sorted(s.port for _, s in starts), [20000, 20001])
        # And in a later pass, from the records.
        self.plane.scale("m", 3, 4)
        self.plane.reconcile()
        self.assertEqual(self.agents.starts()[-1][1].port, 20002)

    def test_port_in_use_avoided(self) -> None:
        """
        A start refused for its port: the next try on that node uses
        another port, in the next pass (a port taken is not the model's
        failure: no backoff, none counted).
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.agents.refuse["n1"] = "port_in_use"
        self.plane.reconcile()
        del self.agents.refuse["n1"]
        self.plane.reconcile()
        self.assertEqual([s.port for _, s in self.agents.starts()], [20000, 20001])
        self.assertEqual(self.plane.catalog["m"].failures, 0)

    def test_link_lost_during_start(self) -> None:
        """
        The link drops with StartShard unanswered: the shard is not counted
        failed (its engine may run); the node's next Register settles it.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.agents.hold = True
        self.plane.reconcile()
        (start,) = self.agents.starts()
        self.agents.unanswered[0].errback(ConnectionLost())
        self.plane.reconcile()
        replica = self.plane.replicas[start[1].replica_id]
        self.assertEqual(replica.shards[0].state, "pending")
        running = pb.RunningShard(
            shard_id=start[1].shard_id,
            replica_id=start[1].replica_id,
            model="m",
            profile="one",
            state=pb.SHARD_STATE_READY,
            port=start[1].port,
            gpu_indices=[0],
            pid=9,
        )
        self.register("n1", shards=(running,))
        self.plane.reconcile()
        self.assertEqual(replica.state, "ready")
        self.assertEqual(models_json(self.plane)[0]["failures_in_a_row"], 0)
        self.assertEqual(self.agents.stops(), [])

    def test_many_failures(self) -> None:
        """
        A model failing 1100 times in a row (two passes each): the backoff stays at
        max_backoff (2 ** 1024 would overflow a float and stall every
        pass).
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.agents.refuse["n1"] = ""
        for _ in range(2200):
            self.plane.reconcile()
            self.clock.advance(41)
            self.heartbeat("n1")
        model = models_json(self.plane)[0]
        self.assertGreater(model["failures_in_a_row"], 1030)
        self.assertLessEqual(model["retry_in"], 40)
        # Still retried every max_backoff.
        self.assertGreater(len(self.agents.starts()), 1030)

    def test_not_ready_in_time(self) -> None:
        """
        A replica still starting after start_timeout is stopped and retried.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        shard = self.agents.starts()[0][1].shard_id
        self.status(shard, pb.SHARD_STATE_STARTING)
        self.clock.advance(121)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [shard])
        self.assertIn("not ready after 120s", models_json(self.plane)[0]["last_error"])

    def test_node_silence(self) -> None:
        """
        A silent node turns unreachable (no new placements, its replica
        still published), then lost: its replica goes to the other node.
        """
        self.make(make_model(low=1))
        self.plane.reconcile()
        node, start = self.agents.starts()[0]
        other = "n2" if node == "n1" else "n1"
        self.ready_all()
        self.plane.reconcile()
        self.clock.advance(16)
        self.heartbeat(other)
        self.plane.reconcile()
        self.assertEqual(self.inventory.get(node).state, "unreachable")  # type: ignore[union-attr]
        self.assertEqual(len(self.endpoints()), 1)
        self.assertEqual(len(self.agents.starts()), 1)
        self.clock.advance(45)
        self.heartbeat(other)
        self.plane.reconcile()
        self.assertEqual(self.inventory.get(node).state, "lost")  # type: ignore[union-attr]
        self.assertEqual(self.agents.starts()[-1][0], other)
        self.assertEqual(self.endpoints(), [])
        lines = explain(self.plane, "m")["reasons"]
        self.assertIn(f"profile one: {node}: lost", lines)


class DrainTests(PlaneCase):
    def test_drain_node(self) -> None:
        """
        Draining a node places a replacement on the other node first: its
        replica serves until the replacement is ready, is unpublished
        then, and its engine stops once nothing is in flight (or after
        drain_timeout).
        """
        self.make(make_model(low=1))
        self.plane.reconcile()
        node, start = self.agents.starts()[0]
        other = "n2" if node == "n1" else "n1"
        self.ready_all()
        self.plane.reconcile()
        replica = start.replica_id
        serving = self.endpoints()
        self.in_flight[replica] = 1
        self.assertEqual(self.plane.drain_node(node), [replica])
        self.assertEqual(self.endpoints(), serving)
        self.plane.reconcile()
        self.assertEqual(self.agents.starts()[-1][0], other)
        self.assertEqual(self.endpoints(), serving)
        self.ready_all()
        self.plane.reconcile()
        self.assertEqual(self.endpoints(), [f"http://10.0.0.{other[-1]}:20000"])
        self.assertEqual(self.agents.stops(), [])
        self.clock.advance(31)
        self.heartbeat("n1", "n2")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [start.shard_id])
        self.assertIn(
            f"{node}: draining", "\n".join(explain(self.plane, "m")["reasons"])
        )

    def test_forced_drain_node(self) -> None:
        """
        A forced drain is the drain of old: the node's replica is
        unpublished at once, one is placed on the other node, and the
        engine stops once nothing is in flight (or after drain_timeout).
        """
        self.make(make_model(low=1))
        self.plane.reconcile()
        node, start = self.agents.starts()[0]
        other = "n2" if node == "n1" else "n1"
        self.ready_all()
        self.plane.reconcile()
        replica = start.replica_id
        self.in_flight[replica] = 1
        self.assertEqual(self.plane.drain_node(node, force=True), [replica])
        self.assertEqual(self.endpoints(), [])
        self.plane.reconcile()
        self.assertEqual(self.agents.starts()[-1][0], other)
        self.assertEqual(self.agents.stops(), [])
        self.clock.advance(31)
        self.heartbeat("n1", "n2")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [start.shard_id])
        self.assertIn(
            f"{node}: draining", "\n".join(explain(self.plane, "m")["reasons"])
        )

    def test_no_fit_explained(self) -> None:
        """
        A model too big for every node: no command, the explanation names
        each node and is kept for the API.
        """
        big = Model(
            "big",
            (),
            1,
            1,
            0,
            (Profile("x4", "sim", "s", gpus=4, gpu_memory_gb=10),),
        )
        self.make(big)
        self.plane.reconcile()
        self.assertEqual(self.agents.starts(), [])
        self.assertEqual(
            explain(self.plane, "big")["reasons"],
            [
                "profile x4: n1: has 1 GPUs, needs 4",
                "profile x4: n2: has 1 GPUs, needs 4",
            ],
        )

    def test_undrain_node(self) -> None:
        """
        A node taken back is placed on again; one never drained, or not
        known, is refused.
        """
        self.make(make_model(low=1), nodes=("n1",))
        self.plane.drain_node("n1")
        self.plane.reconcile()
        self.assertEqual(self.agents.starts(), [])
        self.assertIn("n1: draining", "\n".join(explain(self.plane, "m")["reasons"]))
        self.plane.undrain_node("n1")
        self.assertFalse(self.inventory.get("n1").draining)  # type: ignore[union-attr]
        self.assertTrue(explain(self.plane, "m")["fits"])
        self.clock.advance(6)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual([n for n, _ in self.agents.starts()], ["n1"])
        self.assertRaises(KeyError, self.plane.undrain_node, "n9")
        self.assertRaises(KeyError, self.plane.drain_node, "n9")


class RuntimeCatalogTests(PlaneCase):
    def test_names_taken(self) -> None:
        """
        A model added at run time may not take a catalog name or alias, nor
        a name a static endpoint serves (it would take its traffic).
        """
        self.clock = Clock()
        self.inventory = Inventory()
        self.agents = Agents()
        plane = ControlPlane(
            self.clock,
            self.inventory,
            self.agents,
            (make_model(),),
            SETTINGS,
            lambda endpoints: None,
            static=[Endpoint("e", "http://127.0.0.1:1", ("fixed",))],
        )
        from dataclasses import replace

        for clash in (
            make_model(name="m"),
            replace(make_model(name="other"), aliases=("m-alias",)),
            replace(make_model(name="other"), aliases=("fixed",)),
            make_model(name="fixed"),
        ):
            with self.assertRaises(ValueError):
                plane.catalog.add(clash)
        plane.catalog.add(make_model(name="new"))
        self.assertEqual(plane.catalog.resolve("new-alias"), "new")


class PartsBuiltOnceTests(PlaneCase):
    """
    The plane's parts were handed its settings, ports and tracer when it
    built them: what it shows of them cannot be changed afterwards, where
    a change would reach the plane but not its parts.
    """

    def test_read_only(self) -> None:
        self.make()
        for name in ("settings", "ports", "replicas", "grace_over", "started"):
            with self.assertRaises(AttributeError, msg=name):
                setattr(self.plane, name, None)
        self.assertFalse(hasattr(self.plane, "tracer"))
