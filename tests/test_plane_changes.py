"""
The reconciler's pass costs what changed (issue 12 item 6): it looks at
the models and nodes events named, or that may change by themselves, and
its placement snapshot is kept from pass to pass (L{llmgw.control.changes},
L{llmgw.control.snapshot.LiveSnapshot}); what it does is what a pass over
everything does.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace
from typing import Any

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.drains import DrainRefused
from llmgw.control.inventory import Inventory
from llmgw.control.placement import Profile
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import SETTINGS, PlaneCase, make_model, register_message


class SettledTests(PlaneCase):
    def test_settled_models_not_read(self) -> None:
        """
        With every model settled (ready, as many replicas as wanted,
        nothing in flight), a pass reads no replica's requests in flight:
        it does not look at them.
        """
        self.make(make_model("a"), make_model("b"), touched=True)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.plane.reconcile()
        asked: list[str] = []

        def outstanding(replica_id: str) -> int:
            asked.append(replica_id)
            return 0

        self.outstanding = outstanding  # type: ignore[method-assign]
        self.clock.advance(1)
        self.heartbeat("n1", "n2")
        self.plane.reconcile()
        self.assertEqual(asked, [])

    def test_touch_looks_again(self) -> None:
        """
        The router touches a model at each request: the next pass reads
        its load, and scales it up when over C{scale_up_in_flight}.
        """
        self.make(make_model("a", low=1, high=2), touched=True)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.plane.reconcile()
        (replica,) = self.plane.replicas
        self.in_flight[replica] = 20
        self.plane.reconcile()
        # Not told: a settled model is not looked at.
        self.assertEqual(len(self.agents.starts()), 1)
        self.plane.catalog.touch("a")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 2)

    def test_silent_node_found(self) -> None:
        """
        A node that goes silent is found lost (and its replica replaced)
        though nothing names it: by when it was last heard.
        """
        self.make(make_model("a"), touched=True)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        ((first, _),) = self.agents.starts()
        for _ in range(7):
            self.clock.advance(10)
            self.heartbeat("n1" if first == "n2" else "n2")
            self.plane.reconcile()
        self.assertEqual(self.inventory.get(first).state, "lost")  # type: ignore[union-attr]
        self.assertEqual(len(self.agents.starts()), 2)
        self.assertNotEqual(self.agents.starts()[1][0], first)

    def test_new_node_placed_at_once(self) -> None:
        """
        A model that found no place tries again as soon as a node
        registers (not after its backoff), though the registration does
        not name it.
        """
        two = replace(
            make_model("a"),
            profiles=(Profile(name="x2", engine="sim", source="s", gpus=2),),
        )
        self.make(two, nodes=("n1",), touched=True)
        self.plane.reconcile()
        self.plane.reconcile()
        self.assertEqual(self.agents.starts(), [])
        self.register("n2", gpus=2)
        self.plane.reconcile()
        self.assertEqual([n for n, _ in self.agents.starts()], ["n2"])


class HeardOrderTests(SynchronousTestCase):
    def test_heard_by(self) -> None:
        """
        L{Inventory.heard_by} finds the nodes last heard at or before an
        instant, in and out of order.
        """
        inventory = Inventory()
        for i, heard in enumerate((5.0, 7.0, 9.0)):
            inventory.register(register_message(f"n{i}"), 0.0, heard)
        self.assertEqual([n.id for n in inventory.heard_by(7.0)], ["n0", "n1"])
        inventory.heard("n0", 10.0)
        self.assertEqual([n.id for n in inventory.heard_by(9.0)], ["n1", "n2"])
        inventory.register(register_message("n3"), 0.0, 1.0)
        self.assertEqual([n.id for n in inventory.heard_by(1.0)], ["n3"])
        # Out of order: still right.
        inventory.heard("n1", 8.0)
        self.assertEqual(
            sorted(n.id for n in inventory.heard_by(9.0)), ["n1", "n2", "n3"]
        )


_ID = re.compile(r"[0-9a-f]{8}")


class _Twin(PlaneCase):
    """
    One of two planes given the same events.
    """

    def runTest(self) -> None:
        pass

    def commands(self) -> list[tuple[Any, ...]]:
        index = {s.shard_id: i for i, (_, s) in enumerate(self.agents.starts())}
        out: list[tuple[Any, ...]] = []
        for node, message in self.agents.sent:
            kind = message.WhichOneof("kind")
            if kind == "start_shard":
                start = message.start_shard
                out.append(
                    (node, kind, start.model, tuple(start.gpu_indices), start.port)
                )
            elif kind == "stop_shard":
                out.append((node, kind, index.get(message.stop_shard.shard_id)))
            else:
                out.append((node, kind))
        return out

    def seen(self) -> tuple[Any, ...]:
        published = [
            [(e.url, e.models) for e in endpoints] for endpoints in self.published
        ]
        states = [
            (
                s.model.name,
                s.wanted,
                s.failures,
                s.retry_at,
                s.no_fit,
                len(s.waiters),
                _ID.sub("ID", s.last_error),
            )
            for s in self.plane.catalog.states()
        ]
        nodes = [(n.id, n.state) for n in self.inventory.nodes()]
        replicas = [
            (r.model, r.state, [(s.node, s.gpus, s.port, s.state) for s in r.shards])
            for r in self.plane.replicas.values()
        ]
        cuts = [(_ID.sub("ID", r), why) for r, why in self.cuts]
        return (self.commands(), published, states, nodes, replicas, cuts)


class SameAsEverythingTests(SynchronousTestCase):
    def test_random_events(self) -> None:
        """
        Under a random run of events (statuses, silence, heartbeats,
        drains, scaling, activations, load, time), a plane whose passes
        look at what changed sends the same commands, publishes the same
        endpoints and keeps the same states as one whose every pass looks
        at everything; and its kept snapshot is the one a new snapshot
        would be, after every pass.
        """
        for seed in range(12):
            self._scenario(seed)

    def _scenario(self, seed: int) -> None:
        models = (
            make_model("a", low=1, high=3, idle=30),
            make_model("b", low=0, high=2, idle=60),
            make_model("c", low=2, high=2),
            replace(
                make_model("g", low=1, high=1),
                profiles=(
                    Profile(name="gang", engine="sim", source="s", gpus=1, nodes=2),
                ),
            ),
        )
        nodes = ("n1", "n2", "n3", "m1")
        twins = [_Twin(), _Twin()]
        for twin in twins:
            twin.make(*models, nodes=nodes, settings=SETTINGS, touched=True)
            for node in nodes:
                twin.register(node, gpus=2)
        rng = random.Random(seed)
        silent: set[str] = set()
        waiting: list[Deferred[None]] = []
        for step in range(250):
            event = rng.randrange(10)
            pick = rng.random()
            for twin in twins:
                plane = twin.plane
                starts = twin.agents.starts()
                replicas = list(plane.replicas)
                if event == 0:
                    twin.clock.advance(5 if pick < 0.5 else 20)
                elif event == 1 and starts:
                    node, start = starts[int(pick * len(starts))]
                    state = (
                        pb.SHARD_STATE_READY if pick < 0.8 else pb.SHARD_STATE_FAILED
                    )
                    twin.status(start.shard_id, state, node)
                elif event == 2 and replicas and pick < 0.3:
                    replica = replicas[int(pick / 0.3 * len(replicas))]
                    try:
                        plane.drain_replica(replica, force=pick < 0.1)
                    except DrainRefused:
                        pass
                elif event == 3 and replicas:
                    replica = replicas[int(pick * len(replicas))]
                    twin.in_flight[replica] = int(pick * 30) % 12
                    plane.catalog.touch(plane.replicas[replica].model)
                elif event == 4 and pick < 0.2:
                    plane.scale("a", 1, 1 + int(pick * 10))
                elif event == 5 and pick < 0.2:
                    waiting.append(plane.catalog.activate("b"))
                elif event == 6 and pick < 0.1:
                    node = nodes[int(pick * 10 * len(nodes))]
                    if twin is twins[0]:
                        silent ^= {node}
                elif event == 7 and pick < 0.05:
                    try:
                        plane.drain_node("n3", force=pick < 0.02)
                    except DrainRefused:
                        pass
                elif event == 7 and pick < 0.08:
                    plane.stop_engines(["m1"])
                elif event == 7 and pick < 0.11:
                    plane.start_engines(["m1"])
                elif event == 8 and pick < 0.1:
                    plane.undrain_node("n3")
                elif event == 9 and pick < 0.05:
                    node = nodes[int(pick * 20 * len(nodes))]
                    twin.register(node, gpus=2)
                elif event == 9 and pick < 0.1:
                    # Its agent registers again, listing what it runs.
                    node = nodes[int((pick - 0.05) * 20 * len(nodes))]
                    running = tuple(
                        pb.RunningShard(
                            shard_id=shard.id,
                            replica_id=replica.id,
                            model=replica.model,
                            profile=replica.profile.name,
                            state=pb.SHARD_STATE_READY,
                            port=shard.port,
                            gpu_indices=shard.gpus,
                            rank=shard.rank,
                            world_size=replica.profile.nodes,
                            pid=4242,
                            engine=replica.profile.engine,
                            source=replica.profile.source,
                        )
                        for replica, shard in plane.ledger.shards()
                        if shard.node == node and not shard.state.gone
                    )
                    twin.register(node, gpus=2, shards=running)
                elif event == 9 and pick > 0.9:
                    # Starts refused for a while: a port or GPUs taken.
                    node = nodes[int((pick - 0.9) * 10 * len(nodes))]
                    code = "port_in_use" if pick > 0.95 else "gpus_in_use"
                    if twin.agents.refuse.pop(node, None) is None:
                        twin.agents.refuse[node] = code
            for twin in twins:
                twin.clock.advance(1)
                twin.heartbeat(*(n for n in nodes if n not in silent))
            twins[1].plane.ledger.changes.all()
            for twin in twins:
                twin.plane.reconcile()
            if twins[0].plane.grace_over:
                live = twins[0].plane.live_snapshot()
                fresh = twins[0].plane.snapshot()
                self.assertEqual(live.fleet.nodes(), fresh.fleet.nodes(), (seed, step))
            self.assertEqual(twins[0].seen(), twins[1].seen(), (seed, step))
        for d in waiting:
            d.addErrback(lambda _: None)
            d.cancel()
