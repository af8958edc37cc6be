"""
What the control plane's tests share: the reconciler on a L{Clock}, with
the agents replaced by a recorder of the commands it sends (the real wire
is in C{test_e2e_control}).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.catalog import Model
from llmgw.control.inventory import Inventory
from llmgw.control.placement import Profile
from llmgw.control.plane import ControlPlane
from llmgw.control.settings import ControlConfig
from llmgw.router.interfaces import Endpoint, Shortfall
from llmgw.wire import agent_pb2 as pb
from llmgw.wire import versions
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


class Agents:
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
        return succeed(pb.CommandResult(ok=True))

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


def make_model(name: str = "m", low: int = 1, high: int = 4, idle: float = 0) -> Model:
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


def register_message(
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
        protocol_version=versions.text(),
    )


class PlaneCase(SynchronousTestCase):
    """
    A control plane on a L{Clock}, its commands recorded.
    """

    def make(
        self,
        *models: Model,
        nodes: tuple[str, ...] = ("n1", "n2"),
        settings: ControlConfig = SETTINGS,
        touched: bool = False,
        leave_timeout: float = 1800.0,
        publish_shortfalls: Callable[[tuple[Shortfall, ...]], None] = lambda s: None,
        held_bound: int | None = None,
    ) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.inventory = Inventory()
        self.agents = Agents()
        self.published: list[list[Endpoint]] = []
        self.in_flight: dict[str, int] = {}
        # Of those, a batch's lines.
        self.lines: dict[str, int] = {}
        self.cuts: list[tuple[str, str]] = []
        self.plane = ControlPlane(
            self.clock,
            self.inventory,
            self.agents,
            models or (make_model(),),
            settings,
            self.published.append,
            outstanding=lambda rid: self.outstanding(rid),
            interactive=lambda rid: self.outstanding(rid) - self.lines.get(rid, 0),
            cut=lambda rid, why: self.cuts.append((rid, why)),
            touched=touched,
            leave_timeout=leave_timeout,
            publish_shortfalls=publish_shortfalls,
            held_bound=held_bound,
        )
        for node in nodes:
            self.register(node)

    def outstanding(self, replica_id: str) -> int:
        """
        @return: the requests in flight to C{replica_id}, as the router
            would count them (L{in_flight}).
        """
        return self.in_flight.get(replica_id, 0)

    def register(self, node_id: str, **kwargs: Any) -> None:
        message = register_message(node_id, **kwargs)
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
            found = self.plane.ledger.shard(start.shard_id)
            if found is not None and found[1].state == "pending":
                self.status(start.shard_id, pb.SHARD_STATE_READY)

    def heartbeat(self, *nodes: str) -> None:
        """
        Each of C{nodes} sends a heartbeat: heard now, and a memory report
        that changes no figure.
        """
        for node in nodes:
            self.inventory.heard(node, self.clock.seconds())
            self.inventory.heartbeat(node, pb.Heartbeat(), self.clock.seconds())

    def endpoints(self) -> list[str]:
        return sorted(e.url for e in self.published[-1]) if self.published else []
