"""
Engine adapters as tables (no GPU and no vLLM or SGLang here: the command
lines are checked against each engine's documented flags, not run), and
the placement of gangs: distinct ports on a shared address, a rendezvous
port, and orphans of a lost gang.
"""

from __future__ import annotations

import os
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.engines import Probe, ProfileError, build, engine_url
from llmgw.agent.phases import lists_model as _lists
from llmgw.control.catalog import Model
from llmgw.control.placement import Profile
from llmgw.control.snapshot import ephemeral_overlap
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import PlaneCase, register_message


def _gang(engine: str, rank: int, source: str = "org/m") -> pb.StartShard:
    return pb.StartShard(
        engine=engine,
        source=source,
        model="m",
        port=20001,
        gpu_indices=[0, 1],
        rank=rank,
        world_size=2,
        leader_address="10.0.0.1:20002",
    )


class GangArgvTests(SynchronousTestCase):
    """
    Rank, world size and the rendezvous address, in each engine's form.
    """

    def test_vllm(self) -> None:
        """
        vLLM's multiprocessing multi-node flags (docs/serving/
        parallelism_scaling.md, "Running vLLM with MultiProcessing"): TP
        within a node, PP across nodes; rank 0 serves the API, the others
        run --headless and have no probe.
        """
        leader = build(_gang("vllm", 0), "10.0.0.1")
        self.assertEqual(
            leader.argv,
            ["vllm", "serve", "org/m", "--served-model-name", "m"]
            + ["--host", "10.0.0.1", "--port", "20001"]
            + ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
            + ["--nnodes", "2", "--node-rank", "0"]
            + ["--master-addr", "10.0.0.1", "--master-port", "20002"],
        )
        self.assertEqual(
            leader.probes,
            (
                Probe("http://10.0.0.1:20001/health"),
                Probe("http://10.0.0.1:20001/v1/models", "m"),
            ),
        )
        follower = build(_gang("vllm", 1), "10.0.0.2")
        self.assertEqual(
            follower.argv[-7:],
            ["--node-rank", "1", "--master-addr", "10.0.0.1"]
            + ["--master-port", "20002", "--headless"],
        )
        self.assertEqual(follower.probes, ())

    def test_vllm_profile_parallelism_kept(self) -> None:
        """
        Sizes a profile's args give are not given twice.
        """
        command = _gang("vllm", 0)
        command.args.extend(["--tensor-parallel-size", "4"])
        argv = build(command).argv
        self.assertEqual(argv.count("--tensor-parallel-size"), 1)
        self.assertEqual(argv[-2:], ["--tensor-parallel-size", "4"])

    def test_sglang(self) -> None:
        """
        SGLang's multi-node flags (docs, "Multi-Node Deployment"): --tp-size
        over all the gang's GPUs, --nnodes, --node-rank, --dist-init-addr.
        """
        for rank in (0, 1):
            launch = build(_gang("sglang", rank), "10.0.0.9")
            self.assertEqual(
                launch.argv[launch.argv.index("--tp-size") :],
                ["--tp-size", "4", "--nnodes", "2", "--node-rank", str(rank)]
                + ["--dist-init-addr", "10.0.0.1:20002"],
            )
            self.assertEqual(bool(launch.probes), rank == 0)

    def test_llamacpp_refuses_gangs(self) -> None:
        """
        llama.cpp serves from one node: a gang is refused, named.
        """
        with self.assertRaises(ProfileError) as raised:
            build(_gang("llamacpp", 0, "/m.gguf"))
        self.assertIn("one node", str(raised.exception))

    def test_sim_every_rank_probed(self) -> None:
        """
        Each rank of a simulated gang is a whole simulator, probed on its
        own port.
        """
        launch = build(_gang("sim", 1), "127.0.0.1")
        self.assertEqual(launch.probes[0], Probe("http://127.0.0.1:20001/health"))


class ReadinessTests(SynchronousTestCase):
    """
    Ready means the engine serves the model, per adapter.
    """

    def test_single_node_probes(self) -> None:
        """
        vLLM and SGLang: /health and the model listed; llama-cpp-python:
        the model listed (it lists none while it loads); probes go where
        the engine listens.
        """
        command = pb.StartShard(engine="vllm", source="s", model="m", port=7)
        self.assertEqual(
            [(p.url, p.lists) for p in build(command, "127.0.0.41").probes],
            [
                ("http://127.0.0.41:7/health", ""),
                ("http://127.0.0.41:7/v1/models", "m"),
            ],
        )
        command = pb.StartShard(engine="llamacpp", source="/x.gguf", model="m", port=7)
        old = os.environ["PATH"]
        os.environ["PATH"] = tempfile.mkdtemp()  # no llama-server here
        self.addCleanup(os.environ.__setitem__, "PATH", old)
        self.assertEqual(
            build(command, "::").probes, (Probe("http://[::1]:7/v1/models", "m"),)
        )

    def test_llama_cpp_python_told_its_port_in_its_environment(self) -> None:
        """
        llama-cpp-python's server takes C{HOST} and C{PORT} from its
        environment over its flags: its launch sets both to what the agent
        assigned, so a C{PORT} the agent inherited (C{make run}'s empty
        one, a shell's own) never reaches it; the profile cannot move them
        either.
        """
        command = pb.StartShard(
            engine="llamacpp",
            source="/x.gguf",
            model="m",
            port=7,
            env={"PORT": "8080", "OTHER": "1"},
        )
        old = os.environ["PATH"]
        os.environ["PATH"] = tempfile.mkdtemp()  # no llama-server here
        self.addCleanup(os.environ.__setitem__, "PATH", old)
        launch = build(command, "127.0.0.41")
        self.assertEqual(
            (launch.env["HOST"], launch.env["PORT"], launch.env["OTHER"]),
            ("127.0.0.41", "7", "1"),
        )

    def test_engine_url(self) -> None:
        """
        A wildcard address is reached on loopback; IPv6 in brackets.
        """
        self.assertEqual(engine_url("0.0.0.0", 1), "http://127.0.0.1:1")
        self.assertEqual(engine_url("fd00::5", 1), "http://[fd00::5]:1")
        self.assertEqual(engine_url("127.0.0.41", 1), "http://127.0.0.41:1")

    def test_model_list(self) -> None:
        """
        Only a list naming the model counts.
        """
        self.assertTrue(_lists(b'{"data": [{"id": "x"}, {"id": "m"}]}', "m"))
        for body in (b'{"data": []}', b"[]", b"not json", b'{"data": [1]}'):
            self.assertFalse(_lists(body, "m"), body)


class EphemeralTests(SynchronousTestCase):
    def test_overlap(self) -> None:
        """
        The part of port_range inside the kernel's ephemeral range; Linux's
        default when the file cannot be read.
        """
        path = self.mktemp()
        with open(path, "w") as f:
            f.write("40000\t50000\n")
        self.assertEqual(ephemeral_overlap(range(20000, 21000), path), range(0))
        self.assertEqual(
            ephemeral_overlap(range(49990, 50011), path), range(49990, 50001)
        )
        self.assertEqual(
            ephemeral_overlap(range(60990, 61010), path + ".missing"),
            range(60990, 61000),
        )


def _gang_model() -> Model:
    return Model(
        name="g",
        aliases=(),
        min_replicas=1,
        max_replicas=1,
        idle_timeout=0,
        profiles=(
            Profile(
                name="two",
                engine="sim",
                source="s",
                gpus=1,
                gpu_memory_gb=10,
                nodes=2,
                fabric="ib",
            ),
        ),
    )


class GangPlacementTests(PlaneCase):
    def _register_pair(self, address: str = "10.0.0.7") -> None:
        for node in ("n1", "n2"):
            message = register_message(node)
            message.address = address
            message.fabrics.append("ib")
            self.inventory.register(message, 0.0, self.clock.seconds())
            self.plane.node_registered(node, message)

    def test_same_address_distinct_ports(self) -> None:
        """
        Two agents on one address: the gang's ranks get distinct ports,
        and the rendezvous (leader_address) a third on the leader's
        address.
        """
        self.make(_gang_model(), nodes=())
        self._register_pair()
        self.plane.reconcile()
        starts = [s for _, s in self.agents.starts()]
        self.assertEqual([s.rank for s in starts], [0, 1])
        self.assertEqual([s.port for s in starts], [20000, 20001])
        self.assertEqual({s.leader_address for s in starts}, {"10.0.0.7:20002"})

    def test_orphan_follower_stopped(self) -> None:
        """
        A lost node's agent comes back with rank 1 of a gang now gone: it
        is stopped, not adopted as a replica, and a new gang is placed.
        """
        self.make(_gang_model(), nodes=())
        self._register_pair()
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        (old,) = self.plane.replicas
        follower = self.agents.starts()[1][1]
        # n2 falls silent until lost; n1 keeps beating.
        for _ in range(7):
            self.clock.advance(10)
            self.heartbeat("n1")
            self.plane.reconcile()
        self.assertNotIn(old, self.plane.replicas)
        # The leader, told to stop, holds its GPU until it is gone.
        leader = self.agents.starts()[0][1]
        self.assertIn(leader.shard_id, self.agents.stops())
        self.status(leader.shard_id, pb.SHARD_STATE_STOPPED, node="n1")
        running = pb.RunningShard(
            shard_id=follower.shard_id,
            replica_id=old,
            model="g",
            profile="two",
            state=pb.SHARD_STATE_READY,
            port=follower.port,
            gpu_indices=[0],
            rank=1,
            world_size=2,
            pid=99,
            engine="sim",
            source="s",
        )
        message = register_message("n2", shards=(running,))
        message.address = "10.0.0.7"
        message.fabrics.append("ib")
        self.inventory.register(message, 0.0, self.clock.seconds())
        self.plane.node_registered("n2", message)
        self.plane.reconcile()
        self.assertIn(follower.shard_id, self.agents.stops())
        self.assertNotIn(old, self.plane.replicas)
        (new,) = self.plane.replicas.values()
        self.assertEqual(len(new.shards), 2)


class StrayTests(PlaneCase):
    """
    Issue 14, case 7: what a forgotten engine holds is not given to a new
    shard, and a start refused for it is not charged to the model.
    """

    def test_stray_holds_its_port(self) -> None:
        """
        A node registers running an engine no replica claims: it is
        stopped, and its port stays out of placement until it is reported
        stopped; its GPU is the agent's to refuse (gpus_in_use), which is
        not charged and tried again at once.
        """
        self.make(nodes=())
        stray = pb.RunningShard(
            shard_id="gone-0",
            replica_id="gone",
            model="not-in-the-catalog",
            profile="p",
            state=pb.SHARD_STATE_READY,
            port=20000,
            gpu_indices=[0],
            pid=77,
        )
        self.agents.refuse["n1"] = "gpus_in_use"
        self.register("n1", gpus=2, shards=(stray,))
        self.plane.reconcile()
        self.assertEqual(self.agents.stops(), ["gone-0"])
        self.status("gone-0", pb.SHARD_STATE_STOPPED, node="n1")
        del self.agents.refuse["n1"]
        self.plane.reconcile()
        # First on the stray's GPU (refused, and left alone since), then
        # on the other GPU and the port the stray no longer holds.
        self.assertEqual(
            [(list(s.gpu_indices), s.port) for _, s in self.agents.starts()],
            [([0], 20001), ([1], 20000)],
        )
        self.assertEqual(self.plane.catalog["m"].failures, 0)

    def test_gpus_in_use_not_charged(self) -> None:
        """
        The agent refuses a start for GPUs an engine of its own holds: the
        model is not charged, and the start is tried again in the next
        pass.
        """
        self.make(nodes=())
        self.register("n1", gpus=2)
        self.agents.refuse["n1"] = "gpus_in_use"
        self.plane.reconcile()
        del self.agents.refuse["n1"]
        self.plane.reconcile()
        self.assertEqual(
            [list(s.gpu_indices) for _, s in self.agents.starts()], [[0], [1]]
        )
        self.assertEqual(self.plane.catalog["m"].failures, 0)

    def test_dropped_replica_holds_until_gone(self) -> None:
        """
        A replica dropped (not ready by start_timeout) has its shard told
        to stop; its GPU is not given to a new shard until it is reported
        stopped.
        """
        self.make(nodes=())
        self.register("n1")
        self.plane.reconcile()
        ((_, first),) = self.agents.starts()
        for _ in range(13):
            self.clock.advance(10)
            self.heartbeat("n1")
            self.plane.reconcile()
        self.assertEqual(self.agents.stops(), [first.shard_id])
        # Past the backoff: still held.
        self.clock.advance(10)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 1)
        self.status(first.shard_id, pb.SHARD_STATE_STOPPED, node="n1")
        self.clock.advance(10)
        self.heartbeat("n1")
        self.plane.reconcile()
        self.assertEqual(len(self.agents.starts()), 2)
