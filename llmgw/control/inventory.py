"""
The inventory: what agents report of their nodes (their messages:
C{proto/llmgw/v1/agent.proto}; the states: docs/architecture.md, "Wire
protocol").
"""

from __future__ import annotations

import datetime
import itertools
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from llmgw.wire import agent_pb2 as pb
from llmgw.wire import versions
from llmgw.wire.states import ShardState


class NodeState(StrEnum):
    """
    A node's state, by how long its agent has been silent.
    """

    READY = "ready"
    UNREACHABLE = "unreachable"
    LOST = "lost"

    @classmethod
    def of_silence(cls, silent: float, unreachable: float, lost: float) -> NodeState:
        """
        @param silent: seconds since the node's agent was last heard.
        @param unreachable: C{[control] unreachable_after}, seconds.
        @param lost: C{[control] lost_after}, seconds.
        @return: the node's state after that silence.
        """
        if silent >= lost:
            return cls.LOST
        if silent >= unreachable:
            return cls.UNREACHABLE
        return cls.READY


@dataclass
class GpuInfo:
    """
    One GPU of a node.  Memory in MiB.

    @ivar foreign_used_mib: what processes llmgw does not manage hold on
        it (from the heartbeats): placement may not use it.
    @ivar processes: NVML's processes on it, from the last heartbeat:
        C{{"pid", "used_mib", "managed", "name"}}.
    """

    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int
    problems: list[str] = field(default_factory=list)
    simulated: bool = False
    foreign_used_mib: int = 0
    processes: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Node:
    """
    A node as its agent last described it.

    @ivar state: C{"ready"}, C{"unreachable"} or C{"lost"}, by how long
        its agent has been silent (set by the control plane's passes).
    @ivar last_seen: POSIX seconds of the last message from its agent.
    @ivar heard: the same instant on the reactor's clock, seconds.
    @ivar reports: heartbeats (memory reports) received from it so far.
    @ivar draining: an operator asked for its replicas to move away.
    @ivar engines_stopped: an operator stopped its engines on purpose
        (L{llmgw.control.drains}): nothing is placed on it until they are
        started again or the server restarts; not kept in the store.
    @ivar connected: whether its agent's link is up now; losing a link is
        not losing a node.
    @ivar sleep_memory_bytes: host memory its agent lets sleeping engines
        hold (C{[agent] sleep_memory}, C{Register.sleep_memory_bytes}),
        bytes; 0: nothing may sleep on it.
    @ivar protocol: the protocol version its agent speaks
        (C{Register.protocol_version}): what an older agent lacks
        (L{versions.FEATURES}) is never asked of it.
    """

    id: str
    address: str
    agent_version: str
    labels: dict[str, str]
    fabrics: list[str]
    cpus: int
    memory_bytes: int
    gpus: list[GpuInfo]
    last_seen: float
    state: NodeState = NodeState.READY
    connected: bool = True
    shards: list[dict[str, Any]] = field(default_factory=list)
    heard: float = 0.0
    reports: int = 0
    draining: bool = False
    engines_stopped: bool = False
    # Model files in the agent's weights directories, from its last
    # report: path, size_bytes, last_used (POSIX seconds).
    weights: list[dict[str, Any]] = field(default_factory=list)
    weights_at: float | None = None
    # How many entries the agent found, and whether the list above leaves
    # some out (one frame's worth, or MAX_WEIGHTS_FILES).
    weights_total: int = 0
    weights_truncated: bool = False
    # Changes whenever what placement reads of the node changes.
    version: int = 0
    sleep_memory_bytes: int = 0
    protocol: tuple[int, int] = versions.PROTOCOL

    def to_json(self) -> dict[str, Any]:
        """
        @return: the node as C{GET /api/v1/nodes} shows it.
        """
        return {
            "id": self.id,
            "state": self.state,
            "draining": self.draining,
            "engines_stopped": self.engines_stopped,
            "connected": self.connected,
            "address": self.address,
            "agent_version": self.agent_version,
            "labels": self.labels,
            "fabrics": self.fabrics,
            "cpus": self.cpus,
            "memory_bytes": self.memory_bytes,
            "sleep_memory_bytes": self.sleep_memory_bytes,
            "gpus": [
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "name": g.name,
                    "memory_total_mib": g.memory_total_mib,
                    "memory_used_mib": g.memory_used_mib,
                    "problems": g.problems,
                    "simulated": g.simulated,
                    "foreign_used_mib": g.foreign_used_mib,
                    "processes": g.processes,
                }
                for g in self.gpus
            ],
            "shards": self.shards,
            "last_seen": datetime.datetime.fromtimestamp(
                self.last_seen, datetime.UTC
            ).isoformat(),
        }


MAX_WEIGHTS_FILES = 10_000
"""
Model files kept per node's report.
"""

MAX_PROBLEMS = 32
"""
Problems kept per GPU; more are dropped.
"""

MAX_PROCESSES = 64
"""
NVML processes kept per GPU (the last heartbeat's); more are dropped.
"""


class Inventory:
    """
    Nodes by id, updated from Register and Heartbeat.

    @ivar touched: ids of the nodes whose description changed (what
        placement reads, their link) or that were heard while not ready;
        the control plane empties it each pass.
    @ivar drained: ids of the nodes an operator drained, known or not
        yet (read from the store at start): one registering is draining
        at once.
    @ivar stopped: ids of the nodes whose engines an operator stopped
        since this start (in memory only): one registering again has them
        stopped still.
    """

    def __init__(self, drained: Iterable[str] = ()) -> None:
        """
        @param drained: the nodes drained before this start (the store's).
        """
        self._nodes: dict[str, Node] = {}
        self.drained: set[str] = set(drained)
        self.stopped: set[str] = set()
        self._versions = itertools.count(1)
        self.touched: set[str] = set()
        # Node ids, the least recently heard first; L{None} when a heard
        # instant came out of order, until heard_by sorts them again.
        self._by_heard: OrderedDict[str, None] | None = OrderedDict()

    def take_touched(self) -> set[str]:
        """
        @return: the ids of the nodes whose description changed since the
            last call (L{touched}), which starts empty again.
        """
        touched, self.touched = self.touched, set()
        return touched

    def relearn_drained(self, drained: Iterable[str]) -> None:
        """
        The drained nodes are C{drained}, as the store says now (a
        standby taking the lead reads what the old leader drained).
        """
        self.drained = set(drained)

    def register(self, message: pb.Register, now: float, heard: float = 0.0) -> Node:
        """
        Replace what is known of C{message.node_id} with C{message}; a node
        being drained stays so.

        @param now: POSIX seconds.
        @param heard: the reactor's clock, seconds.
        """
        old = self._nodes.get(message.node_id)
        node = Node(
            id=message.node_id,
            address=message.address,
            agent_version=message.agent_version,
            labels=dict(message.labels),
            fabrics=list(message.fabrics),
            cpus=message.cpus,
            memory_bytes=message.memory_bytes,
            sleep_memory_bytes=message.sleep_memory_bytes,
            protocol=versions.peer_version(message.protocol_version),
            gpus=[
                GpuInfo(
                    index=g.index,
                    uuid=g.uuid,
                    name=g.name,
                    memory_total_mib=g.memory_total_mib,
                    memory_used_mib=g.memory_used_mib,
                    problems=list(g.problems),
                    simulated=g.simulated,
                )
                for g in {g.index: g for g in message.gpus}.values()
            ],
            last_seen=now,
            heard=heard,
            reports=old.reports if old is not None else 0,
            draining=old.draining
            if old is not None
            else message.node_id in self.drained,
            engines_stopped=message.node_id in self.stopped,
            weights=old.weights if old is not None else [],
            weights_at=old.weights_at if old is not None else None,
            weights_total=old.weights_total if old is not None else 0,
            weights_truncated=old.weights_truncated if old is not None else False,
            version=next(self._versions),
            shards=[
                {
                    "id": shard.shard_id,
                    "model": shard.model,
                    "state": ShardState.from_pb(shard.state) or "unspecified",
                    "port": shard.port,
                    "pid": shard.pid,
                }
                for shard in message.shards
            ],
        )
        self._nodes[node.id] = node
        self.touched.add(node.id)
        self._order(node)
        return node

    def heartbeat(self, node_id: str, message: pb.Heartbeat, now: float) -> None:
        """
        Record GPU memory used and new problems.
        """
        node = self._nodes.get(node_id)
        if node is None:
            return
        node.last_seen = now
        node.reports += 1
        by_index = {g.index: g for g in node.gpus}
        for usage in message.gpus[: len(by_index)]:
            gpu = by_index.get(usage.index)
            if gpu is None:
                continue
            foreign = min(usage.foreign_used_mib, gpu.memory_total_mib)
            if (gpu.memory_used_mib, gpu.foreign_used_mib) != (
                usage.memory_used_mib,
                foreign,
            ):
                gpu.memory_used_mib = usage.memory_used_mib
                gpu.foreign_used_mib = foreign
                node.version = next(self._versions)
                self.touched.add(node_id)
            gpu.processes = [
                {
                    "pid": p.pid,
                    "used_mib": p.used_mib,
                    "managed": p.managed,
                    "name": p.name[:64],
                }
                for p in usage.processes[:MAX_PROCESSES]
            ]
            # Bounded: an agent's report must not grow the server's memory
            # or its time per heartbeat without limit.
            known = set(gpu.problems)
            for problem in usage.new_problems[:MAX_PROBLEMS]:
                if len(gpu.problems) >= MAX_PROBLEMS:
                    break
                problem = problem[:200]
                if problem not in known:
                    known.add(problem)
                    gpu.problems.append(problem)
                    node.version = next(self._versions)
                    self.touched.add(node_id)

    def heard(self, node_id: str, heard: float) -> None:
        """
        A message came from the node's agent at C{heard}, reactor seconds.
        """
        node = self._nodes.get(node_id)
        if node is not None:
            node.heard = heard
            self._order(node)
            if node.state != NodeState.READY:
                self.touched.add(node_id)

    def _order(self, node: Node) -> None:
        order = self._by_heard
        if order is None:
            return
        order.pop(node.id, None)
        if not order or node.heard >= self._nodes[next(reversed(order))].heard:
            order[node.id] = None
        elif node.heard <= self._nodes[next(iter(order))].heard:
            order[node.id] = None
            order.move_to_end(node.id, last=False)
        else:
            # Out of order (the wall clock stepped back): sorted again by
            # the next heard_by.
            self._by_heard = None

    def heard_by(self, instant: float) -> list[Node]:
        """
        @param instant: reactor seconds.
        @return: the nodes last heard at or before C{instant} (L{heard}
            and L{register} keep them in order; a node's C{heard} set
            otherwise is not seen here).
        """
        if self._by_heard is None:
            # Put in order again (a clock stepped back): once.
            self._by_heard = OrderedDict(
                (n.id, None)
                for n in sorted(self._nodes.values(), key=lambda n: n.heard)
            )
        found = []
        for node_id in self._by_heard:
            node = self._nodes[node_id]
            if node.heard > instant:
                break
            found.append(node)
        return found

    def weights(self, node_id: str, report: pb.WeightsReport, now: float) -> None:
        """
        Keep a node's report of its model files (the first
        L{MAX_WEIGHTS_FILES}), with the total the agent found and whether
        the list kept is truncated (by the agent, to fit a frame, or here).
        """
        node = self._nodes.get(node_id)
        if node is None:
            return
        node.weights = [
            {
                "path": f.path[:4096],
                "size_bytes": f.size_bytes,
                "last_used": f.last_used_unix,
            }
            for f in report.files[:MAX_WEIGHTS_FILES]
        ]
        node.weights_total = max(report.total, len(report.files))
        node.weights_truncated = report.truncated or len(node.weights) < len(
            report.files
        )
        node.weights_at = now

    def get(self, node_id: str) -> Node | None:
        """
        @return: the node, or L{None} if no agent registered it.
        """
        return self._nodes.get(node_id)

    def link_lost(self, node_id: str) -> None:
        """
        The node's agent link went down.
        """
        node = self._nodes.get(node_id)
        if node is not None:
            node.connected = False
            self.touched.add(node_id)

    def nodes(self) -> list[Node]:
        """
        @return: every node, by id.
        """
        return [self._nodes[k] for k in sorted(self._nodes)]
