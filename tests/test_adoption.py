"""
Adoption, table-driven: each case is a shard a Register lists and what
the server holds, and the expected answer (L{llmgw.control.adoption});
with the records' and shard states' rules it rests on.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control import adoption
from llmgw.control.placement import Profile
from llmgw.control.records import ReplicaRecord, ReplicaState, ShardRecord
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.states import ShardState
from tests.plane_support import make_model

MODEL = make_model()
PROFILE = MODEL.profiles[0]
MODELS = {"m": MODEL}


def running(shard: str = "m-aaaa-0", **kwargs: Any) -> pb.RunningShard:
    fields: dict[str, Any] = {
        "shard_id": shard,
        "replica_id": shard.rsplit("-", 1)[0],
        "model": "m",
        "profile": "one",
        "state": pb.SHARD_STATE_READY,
        "port": 20000,
        "gpu_indices": [0],
        "pid": 7,
    }
    fields.update(kwargs)
    return pb.RunningShard(**fields)


def shard(id: str = "m-aaaa-0", state: ShardState = ShardState.READY) -> ShardRecord:
    return ShardRecord(id, "n1", (0,), 20000, int(id[-1]), state, pid=7)


def record(id: str = "m-aaaa", *shards: ShardRecord, **kwargs: Any) -> ReplicaRecord:
    return ReplicaRecord(id, "m", PROFILE, list(shards), 0.0, **kwargs)


class ClaimTests(SynchronousTestCase):
    def test_table(self) -> None:
        """
        A listed shard is claimed unless its model or profile left the
        catalog, it is stopping, the profile now runs something else, its
        rank is out of the profile, its id is on another node, or its
        replica cannot take it.
        """
        gang = replace(MODEL, profiles=(replace(PROFILE, nodes=2),))
        draining = record("m-dddd", shard("m-dddd-1"), draining_since=1.0)
        other = replace(record("m-oooo", shard("m-oooo-1")), model="x")
        half = record("m-hhhh", shard("m-hhhh-0"))
        for name, listed, models, elsewhere, expected in [
            ("claimed", running(), MODELS, {}, ""),
            ("older agent", running(engine="", source=""), MODELS, {}, ""),
            (
                "not in catalog",
                running(model="gone"),
                MODELS,
                {},
                "model 'gone' is not in the catalog",
            ),
            (
                "no profile",
                running(profile="two"),
                MODELS,
                {},
                "model 'm' has no profile 'two'",
            ),
            (
                "stopping",
                running(state=pb.SHARD_STATE_DRAINING),
                MODELS,
                {},
                "it is stopping or failed",
            ),
            (
                "failed",
                running(state=pb.SHARD_STATE_FAILED),
                MODELS,
                {},
                "it is stopping or failed",
            ),
            (
                "other source",
                running(engine="sim", source="old"),
                MODELS,
                {},
                "profile 'one' is now sim 's', it runs sim 'old'",
            ),
            (
                "rank",
                running("m-aaaa-1", rank=1),
                MODELS,
                {},
                "rank 1 in a profile of 1 nodes",
            ),
            (
                "elsewhere",
                running(),
                MODELS,
                {"m-aaaa-0": "n2"},
                "shard id 'm-aaaa-0' is already on node n2",
            ),
            (
                "replica draining",
                running("m-dddd-0"),
                {"m": gang},
                {},
                "its replica m-dddd is draining",
            ),
            (
                "replica of another model",
                running("m-oooo-0"),
                {"m": gang},
                {},
                "replica m-oooo is of another model or profile",
            ),
            (
                "rank taken",
                running("m-hhhh-0"),
                {"m": gang},
                {},
                "replica m-hhhh has a rank 0 already",
            ),
            ("gang's second", running("m-hhhh-1", rank=1), {"m": gang}, {}, ""),
        ]:
            replicas = {r.id: r for r in (draining, other, half)}
            got = adoption.claim(listed, models, elsewhere.get, replicas)
            self.assertEqual(got, expected, name)


class RelistedTests(SynchronousTestCase):
    def test_table(self) -> None:
        """
        A shard the server holds, listed again: a ready engine (same pid)
        a restarted agent probes again stays ready; otherwise the listed
        state is taken, unless either side is gone.
        """
        starting = pb.SHARD_STATE_STARTING
        for name, held, listed, reprobed, expected in [
            ("probed again", ShardState.READY, running(state=starting), True, None),
            (
                "another engine",
                ShardState.READY,
                running(state=starting, pid=8),
                False,
                ShardState.STARTING,
            ),
            (
                "no pid",
                ShardState.READY,
                running(state=starting, pid=0),
                False,
                ShardState.STARTING,
            ),
            ("now ready", ShardState.PENDING, running(), False, ShardState.READY),
            ("held gone", ShardState.FAILED, running(), False, None),
            (
                "listed gone",
                ShardState.READY,
                running(state=pb.SHARD_STATE_STOPPED),
                False,
                None,
            ),
            (
                "unknown state",
                ShardState.PENDING,
                running(state=pb.SHARD_STATE_UNSPECIFIED),
                False,
                ShardState.STARTING,
            ),
        ]:
            held_shard = shard(state=held)
            self.assertEqual(adoption.reprobed(held_shard, listed), reprobed, name)
            if not reprobed:
                self.assertEqual(adoption.relisted(held_shard, listed), expected, name)


class StateTests(SynchronousTestCase):
    def test_shard_states_on_the_wire(self) -> None:
        """
        Every protobuf state has a name and back; lost has none; the JSON
        shows the lower-case name.
        """
        for value in pb.ShardState.values():
            state = ShardState.from_pb(value)
            if value == pb.SHARD_STATE_UNSPECIFIED:
                self.assertIsNone(state)
                continue
            assert state is not None
            self.assertEqual(state.to_pb(), value)
            self.assertEqual(
                state, pb.ShardState.Name(value).removeprefix("SHARD_STATE_").lower()
            )
        self.assertIsNone(ShardState.from_pb(99))
        self.assertRaises(ValueError, ShardState.LOST.to_pb)
        gone = {s for s in ShardState if s.gone}
        self.assertEqual(gone, {"stopped", "failed", "lost"})

    def test_replica_state_and_fault(self) -> None:
        """
        A replica is draining once asked, failed with a shard gone (lost:
        its node's fault), ready with all its shards, else starting, and
        at fault when starting past start_timeout.
        """
        for name, shards, kwargs, now, state, fault in [
            ("ready", [ShardState.READY], {}, 500.0, ReplicaState.READY, ("", False)),
            ("starting", [ShardState.STARTING], {}, 120.0, "starting", ("", False)),
            (
                "late",
                [ShardState.PENDING],
                {},
                120.5,
                ReplicaState.STARTING,
                ("not ready after 120s", False),
            ),
            (
                "failed",
                [ShardState.FAILED],
                {},
                0.0,
                ReplicaState.FAILED,
                ("shard m-aaaa-0 on n1: failed: ", False),
            ),
            (
                "lost",
                [ShardState.LOST],
                {},
                0.0,
                ReplicaState.FAILED,
                ("shard m-aaaa-0 on n1: lost: ", True),
            ),
            (
                "draining",
                [ShardState.FAILED],
                {"draining_since": 1.0},
                0.0,
                ReplicaState.DRAINING,
                ("", False),
            ),
        ]:
            replica = record("m-aaaa", *(shard(state=s) for s in shards), **kwargs)
            self.assertEqual(replica.state, state, name)
            self.assertEqual(replica.fault(now, 120.0), fault, name)
        gang = replace(
            record("m-gggg", shard("m-gggg-1")),
            profile=Profile("two", "sim", "s", gpus=1, nodes=2),
        )
        self.assertEqual(gang.state, ReplicaState.STARTING)
        self.assertIsNone(gang.leader)
