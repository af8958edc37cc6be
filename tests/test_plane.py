"""
The control plane's reconciler on a L{Clock}, with the agents replaced by
a recorder of the commands it sends (the real wire is in
C{test_e2e_control}).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionLost
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.config import ControlConfig
from llmgw.control.catalog import Model
from llmgw.control.inventory import Inventory
from llmgw.control.placement import Profile
from llmgw.control.plane import ControlPlane
from llmgw.router.balancer import Endpoint
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.protocol import CommandFailed

SETTINGS = ControlConfig(
    unreachable_after=15,
    lost_after=60,
    base_backoff=5.0,
    max_backoff=40.0,
    port_range=(20000, 20009),
    start_timeout=120,
    startup_grace=0,
    drain_timeout=30,
    interval=1,
)


class _Agents:
    """
    Records commands; answers ok at once unless told to refuse a node.
    """

    def __init__(self) -> None:
        self.sent: list[tuple[str, pb.ControlMessage]] = []
        # node -> the refusal's error code
        self.refuse: dict[str, str] = {}
        self.unanswered: list[Deferred[Any]] = []
        self.hold = False

    def send(self, node_id: str, message: pb.ControlMessage) -> Deferred[Any]:
        self.sent.append((node_id, message))
        if node_id in self.refuse:
            result = pb.CommandResult(
                ok=False, error=f"{node_id} refuses", code=self.refuse[node_id]
            )
            return fail(CommandFailed(result))
        if self.hold:
            waiting: Deferred[Any] = Deferred()
            self.unanswered.append(waiting)
            return waiting
        return succeed(None)

    def starts(self) -> list[tuple[str, pb.StartShard]]:
        return [
            (node, m.start_shard)
            for node, m in self.sent
            if m.WhichOneof("kind") == "start_shard"
        ]

    def stops(self) -> list[str]:
        return [
            m.stop_shard.shard_id
            for _, m in self.sent
            if m.WhichOneof("kind") == "stop_shard"
        ]


def _model(name: str = "m", low: int = 1, high: int = 4, idle: float = 0) -> Model:
    return Model(
        name=name,
        aliases=(f"{name}-alias",),
        min_replicas=low,
        max_replicas=high,
        idle_timeout=idle,
        profiles=(
            Profile(name="one", engine="sim", source="s", gpus=1, gpu_memory_gb=10),
        ),
    )


def _register(
    node_id: str, gpus: int = 1, shards: tuple[pb.RunningShard, ...] = ()
) -> pb.Register:
    return pb.Register(
        node_id=node_id,
        address="10.0.0." + node_id[-1],
        gpus=[
            pb.Gpu(index=i, name="H100", memory_total_mib=80 * 1024)
            for i in range(gpus)
        ],
        shards=shards,
    )


class _Plane(SynchronousTestCase):
    def make(
        self,
        *models: Model,
        nodes: tuple[str, ...] = ("n1", "n2"),
        settings: ControlConfig = SETTINGS,
    ) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.inventory = Inventory()
        self.agents = _Agents()
        self.published: list[list[Endpoint]] = []
        self.in_flight: dict[str, int] = {}
        self.plane = ControlPlane(
            self.clock,
            self.inventory,
            self.agents,
            models or (_model(),),
            settings,
            self.published.append,
            outstanding=lambda rid: self.in_flight.get(rid, 0),
        )
        for node in nodes:
            self.register(node)

    def register(self, node_id: str, **kwargs: Any) -> None:
        message = _register(node_id, **kwargs)
        self.inventory.register(message, 0.0, self.clock.seconds())
        self.plane.node_registered(node_id, message)

    def status(self, shard_id: str, state: int, node: str | None = None) -> None:
        if node is None:
            node = next(n for n, s in self.agents.starts() if s.shard_id == shard_id)
        message = pb.ShardStatus(shard_id=shard_id, error="boom", pid=4242)
        message.state = state  # type: ignore[assignment]
        self.plane.shard_status(node, message)

    def ready_all(self) -> None:
        for _, start in self.agents.starts():
            found = self.plane._shards.get(start.shard_id)
            if found is not None and found[1].state == "pending":
                self.status(start.shard_id, pb.SHARD_STATE_READY)

    def heartbeat(self, *nodes: str) -> None:
        for node in nodes:
            self.inventory.heard(node, self.clock.seconds())

    def endpoints(self) -> list[str]:
        return sorted(e.url for e in self.published[-1]) if self.published else []


class ReconcileTests(_Plane):
    def test_one_replica_per_node_and_published_once(self) -> None:
        """
        min_replicas = 2 on two nodes of one GPU: one replica on each, each
        told its port and GPU; once ready both are published, and a pass
        with nothing changed publishes nothing.
        """
        self.make(_model(low=2))
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
        self.make(_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        first = self.agents.starts()[0][1].shard_id
        self.status(first, pb.SHARD_STATE_FAILED)
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)
        self.assertIn("boom", self.plane.models_json()[0]["last_error"])
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
        self.assertEqual(self.plane.models_json()[0]["failures_in_a_row"], 0)
        self.assertIsNone(self.plane.models_json()[0]["last_error"])

    def test_refused_start_is_a_failure(self) -> None:
        """
        An agent refusing StartShard fails the replica like an engine exit.
        """
        self.make(_model(low=1), nodes=("n1",))
        self.agents.refuse["n1"] = ""
        self.plane.reconcile()
        self.plane.reconcile()
        self.assertEqual(self.plane.replicas, {})
        self.assertIn("n1 refuses", self.plane.models_json()[0]["last_error"])
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
        self.make(_model(low=2), nodes=())
        for node in ("n1", "n2"):
            message = _register(node, gpus=2)
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
        another port.
        """
        self.make(_model(low=1), nodes=("n1",))
        self.agents.refuse["n1"] = "port_in_use"
        self.plane.reconcile()
        self.plane.reconcile()
        self.clock.advance(6)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual([s.port for _, s in self.agents.starts()], [20000, 20001])

    def test_link_lost_during_start(self) -> None:
        """
        The link drops with StartShard unanswered: the shard is not counted
        failed (its engine may run); the node's next Register settles it.
        """
        self.make(_model(low=1), nodes=("n1",))
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
        self.assertEqual(self.plane.models_json()[0]["failures_in_a_row"], 0)
        self.assertEqual(self.agents.stops(), [])

    def test_many_failures(self) -> None:
        """
        A model failing 1100 times in a row (two passes each): the backoff stays at
        max_backoff (2 ** 1024 would overflow a float and stall every
        pass).
        """
        self.make(_model(low=1), nodes=("n1",))
        self.agents.refuse["n1"] = ""
        for _ in range(2200):
            self.plane.reconcile()
            self.clock.advance(41)
            self.heartbeat("n1")
        model = self.plane.models_json()[0]
        self.assertGreater(model["failures_in_a_row"], 1030)
        self.assertLessEqual(model["retry_in"], 40)
        # Still retried every max_backoff.
        self.assertGreater(len(self.agents.starts()), 1030)

    def test_not_ready_in_time(self) -> None:
        """
        A replica still starting after start_timeout is stopped and retried.
        """
        self.make(_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        shard = self.agents.starts()[0][1].shard_id
        self.status(shard, pb.SHARD_STATE_STARTING)
        self.clock.advance(121)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [shard])
        self.assertIn("not ready after 120s", self.plane.models_json()[0]["last_error"])

    def test_node_silence(self) -> None:
        """
        A silent node turns unreachable (no new placements, its replica
        still published), then lost: its replica goes to the other node.
        """
        self.make(_model(low=1))
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
        lines = self.plane.explain("m")["reasons"]
        self.assertIn(f"profile one: {node}: lost", lines)


class AdoptionTests(_Plane):
    def _running(self, shard: str, model: str = "m", **kw: Any) -> pb.RunningShard:
        return pb.RunningShard(
            shard_id=shard,
            replica_id=shard.rsplit("-", 1)[0],
            model=model,
            profile=kw.pop("profile", "one"),
            state=pb.SHARD_STATE_READY,
            port=20000,
            gpu_indices=[0],
            pid=kw.pop("pid", 77),
            **kw,
        )

    def test_adopt_claimed_stop_unclaimed(self) -> None:
        """
        After a server restart, the shards a Register lists that the catalog
        claims are adopted with their pids and nothing new is placed; a
        shard of a model no longer in the catalog is stopped.
        """
        self.make(_model(low=1), nodes=())
        self.register(
            "n1",
            shards=(self._running("m-aaaa-0"), self._running("gone-bbbb-0", "gone")),
        )
        self.plane.reconcile()
        self.assertEqual(self.agents.starts(), [])
        self.assertEqual(self.agents.stops(), ["gone-bbbb-0"])
        replica = self.plane.replicas["m-aaaa"]
        self.assertTrue(replica.adopted)
        self.assertEqual(replica.shards[0].pid, 77)
        self.assertEqual(self.endpoints(), ["http://10.0.0.1:20000"])

    def test_empty_list_means_gone(self) -> None:
        """
        A node registering again without a shard it ran: that replica is
        gone and is placed again.
        """
        self.make(_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.register("n1")
        self.plane.reconcile()
        self.assertIn("not running on n1", self.plane.models_json()[0]["last_error"])
        self.clock.advance(6)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 2)

    def test_grace_holds_placement(self) -> None:
        """
        During startup_grace nothing is placed, so agents still
        reconnecting do not get duplicates of what they run.
        """
        from dataclasses import replace

        self.make(_model(low=1), settings=replace(SETTINGS, startup_grace=10))
        self.plane.reconcile()
        self.assertEqual(self.agents.starts(), [])
        self.clock.advance(10)
        self.heartbeat("n1", "n2")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)

    def test_changed_profile_not_adopted(self) -> None:
        """
        An engine started from another source than the catalog's profile
        now names (the catalog changed during a restart) is stopped and a
        new replica placed; one without the fields (an older agent) is
        adopted.
        """
        self.make(_model(low=1), nodes=())
        old = self._running("m-aaaa-0")
        old.engine, old.source = "sim", "old-checkpoint"
        self.register("n1", shards=(old,))
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), ["m-aaaa-0"])
        self.assertEqual(len(self.agents.starts()), 1)
        self.make(_model(low=1), nodes=())
        self.register("n1", shards=(self._running("m-bbbb-0"),))
        self.plane.reconcile()
        self.assertEqual((self.agents.stops(), self.agents.starts()), ([], []))

    def test_foreign_shard_refused(self) -> None:
        """
        A node listing a shard id recorded on another node, or a rank its
        profile does not have, gets it stopped; the real one is untouched.
        """
        self.make(_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (node, start) = self.agents.starts()[0]
        # n1's shard id, under a replica of its own.
        stolen = self._running(start.shard_id)
        stolen.replica_id = "m-elsewhere"
        bad_rank = self._running("m-cccc-1", rank=1)
        self.register("n2", shards=(stolen, bad_rank))
        self.plane.reconcile()
        self.assertEqual(
            sorted(self.agents.stops()), sorted([start.shard_id, "m-cccc-1"])
        )
        self.assertEqual(
            [n for n, m in self.agents.sent if m.WhichOneof("kind") == "stop_shard"],
            ["n2", "n2"],
        )
        replica = self.plane.replicas[start.replica_id]
        self.assertEqual([(s.node, s.state) for s in replica.shards], [("n1", "ready")])
        self.assertEqual(len(self.endpoints()), 1)

    def test_surplus_after_adoption_drained(self) -> None:
        """
        Two adopted replicas of a model with max_replicas = 1: the one not
        ready goes.
        """
        self.make(_model(low=1, high=1), nodes=())
        starting = self._running("m-bbbb-0")
        starting.state = pb.SHARD_STATE_STARTING
        self.register("n1", shards=(self._running("m-aaaa-0"),))
        self.register("n2", shards=(starting,))
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), ["m-bbbb-0"])
        self.assertEqual(self.agents.starts(), [])


class ActivationTests(_Plane):
    def test_scale_from_zero_and_back(self) -> None:
        """
        min_replicas = 0: nothing runs until activate(); its Deferred fires
        when the replica is ready; idle for idle_timeout with nothing in
        flight, the replica is drained and stopped.
        """
        self.make(_model(low=0, idle=60), nodes=("n1",))
        self.plane.reconcile()
        self.assertEqual(self.agents.starts(), [])
        waiting = self.plane.activate("m-alias")
        self.assertNoResult(waiting)
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)
        self.ready_all()
        self.plane.reconcile()
        self.successResultOf(waiting)
        replica = next(iter(self.plane.replicas))
        self.clock.advance(30)
        self.heartbeat("n1")
        self.plane.touch("m")
        self.clock.advance(59)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [])
        self.in_flight[replica] = 1
        self.clock.advance(2)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [])
        self.in_flight[replica] = 0
        self.plane.reconcile()
        self.assertEqual(self.endpoints(), [])
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [replica + "-0"])

    def test_scale_with_load(self) -> None:
        """
        More requests in flight per ready replica than scale_up_in_flight
        (8): one replica more, up to max_replicas, not while one is
        starting; light load for idle_timeout: one fewer, down to
        min_replicas.
        """
        self.make(_model(low=1, high=2, idle=60))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (first,) = self.plane.replicas
        self.in_flight[first] = 8
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)
        self.in_flight[first] = 9
        self.plane.reconcile()
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 2)
        self.ready_all()
        self.in_flight[first] = 40
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 2)  # max_replicas
        self.assertEqual(len(self.endpoints()), 2)
        self.in_flight[first] = 0
        self.clock.advance(59)
        self.heartbeat("n1", "n2")
        self.plane.touch("m")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [])
        self.clock.advance(2)
        self.heartbeat("n1", "n2")
        self.plane.touch("m")
        self.plane.reconcile()
        self.assertEqual(len(self.endpoints()), 1)
        self.plane.reconcile()
        self.assertEqual(len(self.agents.stops()), 1)

    def test_unknown_model(self) -> None:
        """
        Names outside the catalog start nothing.
        """
        self.make()
        self.assertIsNone(self.plane.resolve("other"))
        self.assertRaises(KeyError, self.plane.activate, "other")

    def test_cancel_waiting(self) -> None:
        """
        A cancelled wait (client gone, timeout) leaves no waiter behind.
        """
        self.make(_model(low=0), nodes=())
        waiting = self.plane.activate("m")
        waiting.cancel()
        self.failureResultOf(waiting)
        self.assertEqual(self.plane.models_json()[0]["waiting_requests"], 0)


class DrainTests(_Plane):
    def test_drain_node(self) -> None:
        """
        Draining a node unpublishes its replica at once, places one on the
        other node, and stops the engine once nothing is in flight (or
        after drain_timeout).
        """
        self.make(_model(low=1))
        self.plane.reconcile()
        node, start = self.agents.starts()[0]
        other = "n2" if node == "n1" else "n1"
        self.ready_all()
        self.plane.reconcile()
        replica = start.replica_id
        self.in_flight[replica] = 1
        self.assertEqual(self.plane.drain_node(node), [replica])
        self.assertEqual(self.endpoints(), [])
        self.plane.reconcile()
        self.assertEqual(self.agents.starts()[-1][0], other)
        self.assertEqual(self.agents.stops(), [])
        self.clock.advance(31)
        self.heartbeat("n1", "n2")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [start.shard_id])
        self.assertIn(
            f"{node}: draining", "\n".join(self.plane.explain("m")["reasons"])
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
            self.plane.explain("big")["reasons"],
            [
                "profile x4: n1: has 1 GPUs, needs 4",
                "profile x4: n2: has 1 GPUs, needs 4",
            ],
        )


class RuntimeCatalogTests(_Plane):
    def test_names_taken(self) -> None:
        """
        A model added at run time may not take a catalog name or alias, nor
        a name a static endpoint serves (it would take its traffic).
        """
        self.clock = Clock()
        self.inventory = Inventory()
        self.agents = _Agents()
        plane = ControlPlane(
            self.clock,
            self.inventory,
            self.agents,
            (_model(),),
            SETTINGS,
            lambda endpoints: None,
            static=[Endpoint("e", "http://127.0.0.1:1", ("fixed",))],
        )
        from dataclasses import replace

        for clash in (
            _model(name="m"),
            replace(_model(name="other"), aliases=("m-alias",)),
            replace(_model(name="other"), aliases=("fixed",)),
            _model(name="fixed"),
        ):
            with self.assertRaises(ValueError):
                plane.add_model(clash)
        plane.add_model(_model(name="new"))
        self.assertEqual(plane.resolve("new-alias"), "new")


class SecondReviewTests(_Plane):
    """
    Cases a second adversarial review found.
    """

    def _running(self, shard: str) -> pb.RunningShard:
        return pb.RunningShard(
            shard_id=shard,
            replica_id=shard.rsplit("-", 1)[0],
            model="m",
            profile="one",
            state=pb.SHARD_STATE_READY,
            port=20000,
            gpu_indices=[0],
            pid=5,
        )

    def test_adopted_above_min_kept(self) -> None:
        """
        After a restart, a replica adopted above min_replicas (it ran
        because of traffic) is not drained at the end of the grace.
        """
        from dataclasses import replace

        self.make(
            _model(low=0, idle=600),
            nodes=(),
            settings=replace(SETTINGS, startup_grace=5),
        )
        self.register("n1", shards=(self._running("m-aaaa-0"),))
        self.plane.reconcile()
        self.clock.advance(6)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [])
        self.assertEqual(len(self.endpoints()), 1)

    def test_lower_min_does_not_stop_at_once(self) -> None:
        """
        Scaling min_replicas down lets the model idle down later; the
        replica in use is not drained now.
        """
        self.make(_model(low=1, idle=60), nodes=("n1",))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.plane.scale("m", 0, 4)
        self.plane.reconcile()
        self.assertEqual(len(self.endpoints()), 1)
        self.clock.advance(61)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.plane.reconcile()
        self.assertEqual(len(self.agents.stops()), 1)

    def test_lost_stop_sent_again(self) -> None:
        """
        A drain whose StopShard could not be delivered sends it again.
        """
        self.make(_model(low=1), nodes=("n1",))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (replica,) = self.plane.replicas
        self.agents.refuse["n1"] = ""
        self.plane.drain_replica(replica)
        self.plane.reconcile()
        self.assertEqual(len(self.agents.stops()), 1)
        del self.agents.refuse["n1"]
        self.clock.advance(41)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.stops()), 2)

    def test_backoff_holds_beside_a_ready_replica(self) -> None:
        """
        A second replica that keeps failing is retried with a growing
        backoff even while the first is ready.
        """
        self.make(_model(low=2), nodes=("n1", "n2"))
        self.plane.reconcile()
        first, second = self.agents.starts()
        self.status(first[1].shard_id, pb.SHARD_STATE_READY)
        self.agents.refuse[second[0]] = ""
        self.status(second[1].shard_id, pb.SHARD_STATE_FAILED)
        for _ in range(60):
            self.clock.advance(1)
            self.heartbeat("n1", "n2")
            self.plane.reconcile()
        # 5 s, 10 s, 20 s, then 40 s: at most 4 more tries in a minute.
        self.assertLessEqual(len(self.agents.starts()), 2 + 4)

    def test_least_loaded_drained_first(self) -> None:
        """
        Scaling down drains the replica with the fewest requests in
        flight.
        """
        self.make(_model(low=1), nodes=("n1", "n2"))
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (busy,) = self.plane.replicas
        self.clock.advance(5)
        self.heartbeat("n1", "n2")
        self.plane.scale("m", 2, 2)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (idle,) = set(self.plane.replicas) - {busy}
        # The oldest carries the load.
        self.in_flight[busy] = 3
        self.plane.scale("m", 1, 1)
        self.plane.reconcile()
        draining = [r.id for r in self.plane.replicas.values() if r.draining_since]
        self.assertEqual(draining, [idle])
