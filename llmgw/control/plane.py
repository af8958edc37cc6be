"""
The control plane (DESIGN.md section 3): desired replicas per catalog
model against what the agents run, kept in step by one reconciler loop.

Each pass: node states from their agents' silence; replicas whose shards
failed, whose nodes are lost or that never became ready are dropped (their
other shards stopped) and their model backs off; each model gets placed
what it lacks and drained what it has too many of; draining replicas are
stopped once their requests in flight are done; the ready replicas are
published to the router.

How many replicas a model wants: C{min_replicas}, raised by traffic
(the first request for a model at zero activates it; requests in flight
per ready replica over C{scale_up_in_flight} add one, up to
C{max_replicas}) and lowered again by idleness (C{idle_timeout}).  After
a server restart, what the agents still run is adopted and counts as
wanted, so nothing is started twice or stopped for being unexpected.

Shard statuses and registrations arrive from the agent links between
passes (L{ControlPlane.shard_status}, L{ControlPlane.node_registered}) and
kick a pass.  Nothing here blocks: commands to agents are sent and their
results handled when they come.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.config import ControlConfig
from llmgw.control.agents import NoLink
from llmgw.control.catalog import MAX_COUNT, Model
from llmgw.control.inventory import Inventory, Node
from llmgw.control.loop import Loop
from llmgw.control.placement import (
    Fleet,
    GpuView,
    NodeView,
    NoFit,
    Plan,
    Profile,
    place,
)
from llmgw.router.balancer import Endpoint
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.engines import hub_cache_name
from llmgw.wire.protocol import CommandFailed

_STATE_NAMES = {
    pb.SHARD_STATE_PENDING: "pending",
    pb.SHARD_STATE_STARTING: "starting",
    pb.SHARD_STATE_READY: "ready",
    pb.SHARD_STATE_DRAINING: "draining",
    pb.SHARD_STATE_STOPPED: "stopped",
    pb.SHARD_STATE_FAILED: "failed",
}
_GONE = ("stopped", "failed", "lost")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
SUSPECT_PORT_SECONDS = 600.0
"""
How long a port where a shard could not start is left out of placement on
its node.
"""
STOP_GRACE = 30
"""
Seconds between SIGTERM and SIGKILL when the control plane stops a shard.
"""


class Commands(Protocol):
    """
    How the control plane reaches agents: L{llmgw.control.agents.AgentHub}.
    """

    def send(self, node_id: str, message: pb.ControlMessage) -> Deferred[Any]:
        """
        Send a command to a node's agent.

        @return: fires when the agent answers ok; fails when it refuses, or
            when the node has no link.
        """


@dataclass
class ShardRecord:
    """
    One engine process of a replica, on one node.

    @ivar state: C{pending} (command sent), C{starting}, C{ready},
        C{draining}, C{stopped}, C{failed}, or C{lost} (its node was lost).
    """

    id: str
    node: str
    gpus: tuple[int, ...]
    port: int
    rank: int
    state: str = "pending"
    pid: int = 0
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "node": self.node,
            "gpus": list(self.gpus),
            "port": self.port,
            "rank": self.rank,
            "state": self.state,
            "pid": self.pid,
            "last_error": self.error or None,
        }


@dataclass
class ReplicaRecord:
    """
    One serving copy of a model: one shard per node of its profile.

    @ivar created: reactor seconds when placed (or adopted).
    @ivar draining_since: reactor seconds when draining began, or L{None}.
    """

    id: str
    model: str
    profile: Profile
    shards: list[ShardRecord]
    created: float
    draining_since: float | None = None
    drain_reason: str = ""
    adopted: bool = False
    stop_sent_at: float | None = None

    @property
    def state(self) -> str:
        """
        C{draining}, C{failed} (a shard failed or was lost), C{ready} (all
        shards are), or C{starting}.
        """
        if self.draining_since is not None:
            return "draining"
        if any(s.state in _GONE for s in self.shards):
            return "failed"
        if (
            len(self.shards) == self.profile.nodes
            and all(s.state == "ready" for s in self.shards)
            and self.leader is not None
        ):
            return "ready"
        return "starting"

    @property
    def leader(self) -> ShardRecord | None:
        for shard in self.shards:
            if shard.rank == 0:
                return shard
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model,
            "profile": self.profile.name,
            "engine": self.profile.engine,
            "state": self.state,
            "adopted": self.adopted,
            "shards": [s.to_json() for s in sorted(self.shards, key=lambda s: s.rank)],
        }


@dataclass
class _ModelState:
    """
    What the control plane keeps per catalog model besides its replicas.

    @ivar wanted: replicas asked for by traffic (scale from zero), above
        C{min_replicas}.
    @ivar last_used: reactor seconds of the last request.
    """

    model: Model
    wanted: int = 0
    last_used: float = 0.0
    busy_at: float = 0.0
    failed_at: float = 0.0
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""
    no_fit: NoFit | None = None
    waiters: list[Deferred[None]] = field(default_factory=list)


def _safe(text: str, limit: int = 40) -> str:
    return _UNSAFE.sub("-", text).strip("-._")[:limit] or "model"


class ControlPlane:
    """
    Keeps each catalog model's replicas running.

    @param clock: the reactor's clock.
    @param inventory: the nodes, as their agents describe them.
    @param commands: sends commands to agents.
    @param models: the catalog.
    @param settings: the C{[control]} table.
    @param publish: called with the router's new endpoint list when it
        changes.
    @param static: endpoints from the configuration, always published.
    @param outstanding: requests in flight to a replica id, by the router's
        count; a draining replica is stopped when it reaches 0.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        inventory: Inventory,
        commands: Commands,
        models: Sequence[Model],
        settings: ControlConfig,
        publish: Callable[[list[Endpoint]], None],
        static: Sequence[Endpoint] = (),
        outstanding: Callable[[str], int] = lambda replica_id: 0,
    ) -> None:
        self.clock = clock
        self.inventory = inventory
        self.commands = commands
        self.settings = settings
        self._publish = publish
        self._static = tuple(static)
        self._outstanding = outstanding
        self._models: dict[str, _ModelState] = {m.name: _ModelState(m) for m in models}
        self._names: dict[str, str] = {name: m.name for m in models for name in m.names}
        self.replicas: dict[str, ReplicaRecord] = {}
        self._shards: dict[str, tuple[ReplicaRecord, ShardRecord]] = {}
        self._published: tuple[Endpoint, ...] | None = None
        self._suspect: dict[tuple[str, int], float] = {}
        self._views: dict[str, tuple[Any, NodeView]] = {}
        self._ports = range(settings.port_range[0], settings.port_range[1] + 1)
        self.started = clock.seconds()
        self.grace_over = settings.startup_grace <= 0
        self.loop = Loop(clock, settings.interval, self.reconcile, name="reconciler")

    # The router's side: names, activation, use.

    def resolve(self, name: str) -> str | None:
        """
        @return: the catalog model C{name} names (itself or an alias), or
            L{None}.
        """
        return self._names.get(name)

    def static_endpoints(self) -> tuple[Endpoint, ...]:
        """
        @return: the endpoints from the configuration.
        """
        return self._static

    def names(self) -> list[str]:
        """
        @return: every catalog name and alias, sorted.
        """
        return sorted(self._names)

    def activate(self, name: str) -> Deferred[None]:
        """
        A request for C{name} found no ready replica: ask for one.

        @return: fires when a replica of the model is published; cancel it
            to stop waiting.
        @raise KeyError: C{name} is not in the catalog.
        """
        state = self._models[self._names[name]]
        state.last_used = self.clock.seconds()
        if state.wanted < 1:
            state.wanted = 1
            self.log.info(
                "activating model {model}: a request is waiting", model=state.model.name
            )
        waiter: Deferred[None] = Deferred(
            lambda d: state.waiters.remove(d) if d in state.waiters else None
        )
        state.waiters.append(waiter)
        self.loop.kick()
        return waiter

    def touch(self, name: str) -> None:
        """
        A request for C{name} came: it is not idle.
        """
        model = self._names.get(name)
        if model is not None:
            self._models[model].last_used = self.clock.seconds()

    def why_not(self, name: str) -> str:
        """
        @return: why the model has no ready replica, in a few words fit for
            a client (no node names or addresses), or C{""}.
        """
        model = self._names.get(name)
        state = self._models.get(model) if model is not None else None
        if state is None:
            return ""
        if state.no_fit is not None:
            return "no node has room for it now"
        if state.failures:
            return f"its last {state.failures} starts failed"
        if not any(n.state == "ready" for n in self.inventory.nodes()):
            return "no node is connected"
        return ""

    # What the agents say.

    def shard_status(self, node_id: str, status: pb.ShardStatus) -> None:
        """
        Record a shard's transition; unknown shards are ignored here (a
        Register lists them all).
        """
        found = self._shards.get(status.shard_id)
        if found is None or found[1].node != node_id:
            return
        replica, shard = found
        state = _STATE_NAMES.get(status.state, shard.state)
        if shard.state in _GONE:
            return
        shard.state = state
        if status.pid:
            shard.pid = status.pid
        if state == "failed":
            tail = " | ".join(status.output_tail[-3:])
            shard.error = status.error + (f"; last output: {tail}" if tail else "")
        self.loop.kick()

    def node_registered(self, node_id: str, register: pb.Register) -> None:
        """
        Adoption: shards the catalog still claims become (or stay) replicas,
        the others are stopped; shards recorded on this node that it no
        longer lists are gone.
        """
        listed = {s.shard_id: s for s in register.shards}
        for _, shard in list(self._shards.values()):
            if shard.node == node_id and shard.id not in listed:
                if shard.state not in _GONE:
                    shard.state = "failed"
                    shard.error = f"not running on {node_id} after its agent registered"
        for running in register.shards:
            found = self._shards.get(running.shard_id)
            state = _STATE_NAMES.get(running.state, "starting")
            if found is not None and found[1].node == node_id:
                shard = found[1]
                same_engine = running.pid and running.pid == shard.pid
                if shard.state == "ready" and state == "starting" and same_engine:
                    # A restarted agent probes the engine again; the server
                    # knows it is ready (and the router keeps sending).
                    continue
                if shard.state not in _GONE and state not in _GONE:
                    shard.state = state
                    shard.pid = running.pid or shard.pid
                found_replica = found[0]
                if found_replica.stop_sent_at is not None and state not in _GONE:
                    # The stop may have been lost with the old link.
                    self._stop_shard(node_id, shard.id)
                continue
            reason = self._claim(running)
            if reason:
                self.log.info(
                    "stopping shard {shard} on {node}: {reason}",
                    shard=running.shard_id,
                    node=node_id,
                    reason=reason,
                )
                self._stop_shard(node_id, running.shard_id)
                continue
            self._adopt(node_id, running, state)
        for waiting in self._models.values():
            # New capacity: models waiting for a place try again now.
            if waiting.no_fit is not None:
                waiting.retry_at = 0.0
        self.loop.kick()

    def _claim(self, running: pb.RunningShard) -> str:
        """
        @return: why the catalog does not claim C{running}, or C{""}.
        """
        state = self._models.get(running.model)
        if state is None:
            return f"model {running.model!r} is not in the catalog"
        if not any(p.name == running.profile for p in state.model.profiles):
            return f"model {running.model!r} has no profile {running.profile!r}"
        if running.state in (
            pb.SHARD_STATE_DRAINING,
            pb.SHARD_STATE_STOPPED,
            pb.SHARD_STATE_FAILED,
        ):
            return "it is stopping or failed"
        profile = next(p for p in state.model.profiles if p.name == running.profile)
        if (running.engine, running.source) != (profile.engine, profile.source) and (
            running.engine or running.source
        ):
            # The catalog changed the profile since (another checkpoint):
            # the old engine would serve the old weights under the name.
            return (
                f"profile {profile.name!r} is now {profile.engine} {profile.source!r},"
                f" it runs {running.engine} {running.source!r}"
            )
        if running.rank >= profile.nodes:
            return f"rank {running.rank} in a profile of {profile.nodes} nodes"
        if running.shard_id in self._shards:
            other = self._shards[running.shard_id][1].node
            return f"shard id {running.shard_id!r} is already on node {other}"
        replica = self.replicas.get(running.replica_id)
        if replica is not None:
            if replica.state in ("draining", "failed"):
                return f"its replica {replica.id} is {replica.state}"
            if replica.model != running.model or replica.profile.name != profile.name:
                return f"replica {replica.id} is of another model or profile"
            if any(s.rank == running.rank for s in replica.shards):
                return f"replica {replica.id} has a rank {running.rank} already"
        return ""

    def _adopt(self, node_id: str, running: pb.RunningShard, state: str) -> None:
        model = self._models[running.model].model
        profile = next(p for p in model.profiles if p.name == running.profile)
        replica = self.replicas.get(running.replica_id)
        if replica is None:
            now = self.clock.seconds()
            replica = ReplicaRecord(
                id=running.replica_id,
                model=model.name,
                profile=profile,
                shards=[],
                created=now,
                adopted=True,
            )
            self.replicas[replica.id] = replica
            # What ran before the restart was wanted: kept, and left to the
            # idle and load rules from now on (not drained at the end of
            # the grace as surplus over min_replicas).
            counts = self._models[model.name]
            live = sum(
                1
                for r in self.replicas.values()
                if r.model == model.name and r.draining_since is None
            )
            counts.wanted = min(model.max_replicas, max(counts.wanted, live))
            counts.last_used = counts.busy_at = now
        shard = ShardRecord(
            id=running.shard_id,
            node=node_id,
            gpus=tuple(running.gpu_indices),
            port=running.port,
            rank=running.rank,
            state=state,
            pid=running.pid,
        )
        replica.shards.append(shard)
        self._shards[shard.id] = (replica, shard)
        self.log.info(
            "adopted shard {shard} of model {model} on {node} (engine pid {pid})",
            shard=shard.id,
            model=model.name,
            node=node_id,
            pid=running.pid,
        )

    # The catalog at run time.

    def model(self, name: str) -> Model | None:
        """
        @return: the catalog model named C{name} (not an alias), if any.
        """
        state = self._models.get(name)
        return state.model if state is not None else None

    def add_model(self, model: Model) -> None:
        """
        Add a model to the catalog; its replicas are placed by the next pass.

        @raise ValueError: one of its names is taken.
        """
        static = {name for e in self._static for name in e.models}
        for name in model.names:
            if name in self._names:
                owner = self._names[name]
                what = "model" if owner == name else f"an alias of model {owner!r}"
                raise ValueError(f"name {name!r} is already {what}")
            if name in static:
                raise ValueError(f"name {name!r} is served by a static endpoint")
        self._models[model.name] = _ModelState(model)
        for name in model.names:
            self._names[name] = model.name
        self.loop.kick()

    def remove_model(self, name: str) -> None:
        """
        Remove a model from the catalog: its replicas drain and stop;
        requests waiting for it are let go (they find no replica: 503).

        @raise KeyError: no such model.
        """
        state = self._models.pop(name)
        for alias in state.model.names:
            self._names.pop(alias, None)
        waiters, state.waiters = state.waiters, []
        for waiter in waiters:
            waiter.callback(None)
        self.loop.kick()

    def scale(self, name: str, min_replicas: int, max_replicas: int) -> Model:
        """
        Change a model's replica bounds.

        @raise KeyError: no such model.
        @raise ValueError: bounds out of order.
        """
        state = self._models[name]
        if (
            min_replicas < 0
            or not 1 <= max_replicas <= MAX_COUNT
            or min_replicas > max_replicas
        ):
            raise ValueError(
                f"expected 0 <= min_replicas <= max_replicas, 1 <= max_replicas;"
                f" got {min_replicas} and {max_replicas}"
            )
        before = self.desired(state, self.clock.seconds())
        state.model = replace(
            state.model, min_replicas=min_replicas, max_replicas=max_replicas
        )
        # A lower min lets the model idle down (after idle_timeout); it
        # does not stop replicas in use now.  A lower max does.
        state.wanted = min(max(state.wanted, before), max_replicas)
        now = self.clock.seconds()
        # Idle time counts from the change.
        state.busy_at = max(state.busy_at, now)
        state.last_used = max(state.last_used, now)
        self.loop.kick()
        return state.model

    # Weights.

    def weights_user(self, path: str) -> str | None:
        """
        @return: the catalog model or replica that uses C{path} (its source
            path, a folder holding it, a file or folder inside it, or the
            Hugging Face cache entry C{models--ORG--NAME} of a hub id), or
            L{None}.
        """
        users = [
            (p.source, s.model.name)
            for s in self._models.values()
            for p in s.model.profiles
        ]
        users += [(r.profile.source, r.id) for r in self.replicas.values()]
        path = path.rstrip("/")
        name = path.rsplit("/", 1)[-1]
        for source, user in users:
            source = source.rstrip("/")
            if (
                source == path
                or source.startswith(path + "/")
                or path.startswith(source + "/")
                or name == hub_cache_name(source)
            ):
                return user
        return None

    def unused_weights(self, node: Node) -> list[dict[str, Any]]:
        """
        @return: the node's reported model files that nothing in the
            catalog and no replica uses (see L{weights_user}).
        """
        return [e for e in node.weights if self.weights_user(e["path"]) is None]

    async def collect_weights(self, dry_run: bool) -> list[dict[str, Any]]:
        """
        Delete, through each node's agent, the model files nothing uses.

        @return: per node: the files chosen, and with C{dry_run} off,
            whether the agent removed them or its error.
        """
        results = []
        for node in self.inventory.nodes():
            unused = self.unused_weights(node)
            result: dict[str, Any] = {
                "node": node.id,
                "unused": unused,
                "bytes": sum(e["size_bytes"] for e in unused),
                "removed": False,
                "error": None,
            }
            results.append(result)
            if dry_run or not unused:
                continue
            result.update(
                await self.remove_weights(node.id, [e["path"] for e in unused])
            )
        return results

    async def remove_weights(self, node_id: str, paths: list[str]) -> dict[str, Any]:
        """
        Ask a node's agent to delete C{paths} (it refuses any outside its
        weights directories).

        @return: C{{"removed": bool, "error": str | None}}.
        """
        try:
            await self.commands.send(
                node_id,
                pb.ControlMessage(remove_weights=pb.RemoveWeights(paths=paths)),
            )
        except Exception as e:
            result = getattr(e, "result", None)
            error = result.error if result is not None else str(e) or repr(e)
            self.log.warn(
                "removing weights on {node} refused: {error}", node=node_id, error=error
            )
            return {"removed": False, "error": error}
        self.log.info(
            "removed weights on {node}: {paths}", node=node_id, paths=", ".join(paths)
        )
        return {"removed": True, "error": None}

    # Operator actions.

    def drain_node(self, node_id: str) -> list[str]:
        """
        No new placements on C{node_id}; its replicas drain and are placed
        elsewhere.

        @return: the ids of the replicas now draining.
        @raise KeyError: no such node.
        """
        node = self.inventory.get(node_id)
        if node is None:
            raise KeyError(node_id)
        node.draining = True
        drained = []
        for replica in list(self.replicas.values()):
            if any(s.node == node_id for s in replica.shards):
                if self._drain(replica, f"node {node_id} is draining"):
                    drained.append(replica.id)
        self.loop.kick()
        return drained

    def drain_replica(self, replica_id: str) -> bool:
        """
        Drain one replica (a new one is placed if the model needs it).

        @return: whether it started draining (not already draining).
        @raise KeyError: no such replica.
        """
        replica = self.replicas[replica_id]
        started = self._drain(replica, "an operator asked")
        self.loop.kick()
        return started

    def _drain(self, replica: ReplicaRecord, why: str) -> bool:
        if replica.draining_since is not None:
            return False
        replica.draining_since = self.clock.seconds()
        replica.drain_reason = why
        self.log.info(
            "draining replica {replica} of {model}: {why}",
            replica=replica.id,
            model=replica.model,
            why=why,
        )
        # No new requests from now on.
        self._publish_ready()
        return True

    # The pass.

    def reconcile(self) -> None:
        """
        One pass; see the module's docstring.
        """
        now = self.clock.seconds()
        if not self.grace_over and now - self.started >= self.settings.startup_grace:
            self.grace_over = True
        self._update_nodes(now)
        for replica in list(self.replicas.values()):
            try:
                self._check(replica, now)
            except Exception:
                # One bad record must not stall every model.
                self.log.failure("checking replica {replica}", replica=replica.id)
        by_model: dict[str, list[ReplicaRecord]] = {}
        for replica in self.replicas.values():
            by_model.setdefault(replica.model, []).append(replica)
        snapshot: _Snapshot | None = None
        for state in list(self._models.values()):
            try:
                snapshot = self._scale(
                    state, now, snapshot, by_model.get(state.model.name, [])
                )
            except Exception:
                self.log.failure("scaling model {model}", model=state.model.name)
                snapshot = None
        for replica in list(self.replicas.values()):
            if replica.model not in self._models and replica.draining_since is None:
                self._drain(replica, "its model left the catalog")
            if replica.draining_since is not None:
                self._finish_drain(replica, now)
        self._publish_ready()

    def _update_nodes(self, now: float) -> None:
        settings = self.settings
        for node in self.inventory.nodes():
            silent = now - max(node.heard, self.started)
            if silent >= settings.lost_after:
                state = "lost"
            elif silent >= settings.unreachable_after:
                state = "unreachable"
            else:
                state = "ready"
            if state != node.state:
                log = self.log.warn if state != "ready" else self.log.info
                log(
                    "node {node} is {state} (silent {seconds:.0f}s)",
                    node=node.id,
                    state=state,
                    seconds=silent,
                )
                node.state = state

    def _check(self, replica: ReplicaRecord, now: float) -> None:
        settings = self.settings
        for shard in replica.shards:
            node = self.inventory.get(shard.node)
            if shard.state not in _GONE and (node is None or node.state == "lost"):
                shard.state = "lost"
                shard.error = f"node {shard.node} is lost"
        state = replica.state
        if replica.draining_since is not None:
            if all(s.state in _GONE for s in replica.shards):
                self._forget(replica)
            return
        error = ""
        bad: ShardRecord | None = None
        if state == "failed":
            bad = next(s for s in replica.shards if s.state in _GONE)
            error = f"shard {bad.id} on {bad.node}: {bad.state}: {bad.error}"
        elif state == "starting" and now - replica.created > settings.start_timeout:
            error = f"not ready after {settings.start_timeout:g}s"
        elif state == "ready":
            model = self._models.get(replica.model)
            if model is not None and replica.created >= model.failed_at:
                # Recovered (a replica started after the last failure is
                # ready): the last error is history.
                model.failures = 0
                model.last_error = ""
            return
        if not error:
            return
        self.log.warn(
            "replica {replica} of {model} failed: {error}",
            replica=replica.id,
            model=replica.model,
            error=error,
        )
        model = self._models.get(replica.model)
        if model is not None and bad is not None and bad.state == "lost":
            # The node's fault, not the model's: replaced at once.
            model.last_error = f"replica {replica.id}: {error}"
        elif model is not None:
            model.failures += 1
            model.failed_at = now
            # The exponent is capped: 2 ** 1024 overflows a float.
            backoff = min(
                settings.max_backoff,
                settings.base_backoff * 2 ** min(model.failures - 1, 40),
            )
            model.retry_at = now + backoff
            model.last_error = f"replica {replica.id}: {error}"
        for shard in replica.shards:
            if shard.state not in _GONE:
                self._stop_shard(shard.node, shard.id)
        self._forget(replica)

    def _forget(self, replica: ReplicaRecord) -> None:
        self.replicas.pop(replica.id, None)
        for shard in replica.shards:
            if self._shards.get(shard.id, (None, None))[1] is shard:
                del self._shards[shard.id]

    def desired(
        self,
        state: _ModelState,
        now: float,
        replicas: Sequence[ReplicaRecord] | None = None,
    ) -> int:
        """
        @param replicas: the model's replicas, when the caller has them.
        @return: the replicas C{state}'s model should have now; idle
            models fall back to C{min_replicas}.
        """
        model = state.model
        if state.wanted > model.min_replicas and not state.waiters:
            idle = (
                model.idle_timeout > 0 and now - state.last_used >= model.idle_timeout
            )
            if replicas is None:
                replicas = [r for r in self.replicas.values() if r.model == model.name]
            busy = any(self._outstanding(r.id) for r in replicas)
            if idle and not busy:
                self.log.info(
                    "model {model} idle for {seconds:g}s: scaling down to {count}",
                    model=model.name,
                    seconds=model.idle_timeout,
                    count=model.min_replicas,
                )
                state.wanted = 0
        return min(max(model.min_replicas, state.wanted), model.max_replicas)

    def _follow_load(
        self, state: _ModelState, now: float, replicas: list[ReplicaRecord]
    ) -> None:
        """
        Scale with traffic between C{min_replicas} and C{max_replicas}: one
        replica more while the requests in flight per ready replica are over
        C{[control] scale_up_in_flight} (and none is still starting); one
        fewer after C{idle_timeout} with them under half of it.
        """
        model = state.model
        threshold = self.settings.scale_up_in_flight
        live = [r for r in replicas if r.draining_since is None]
        ready = [r for r in live if r.state == "ready"]
        in_flight = sum(self._outstanding(r.id) for r in live)
        state.wanted = min(state.wanted, model.max_replicas)
        per_replica = in_flight / len(ready) if ready else 0.0
        if per_replica > threshold / 2:
            state.busy_at = now
        current = max(model.min_replicas, state.wanted)
        if (
            per_replica > threshold
            and len(ready) == len(live)
            and len(live) >= current
            and current < model.max_replicas
        ):
            state.wanted = current + 1
            self.log.info(
                "model {model}: {in_flight} requests in flight on {ready} replicas:"
                " scaling up to {count}",
                model=model.name,
                in_flight=in_flight,
                ready=len(ready),
                count=state.wanted,
            )
        elif (
            state.wanted > max(model.min_replicas, 1)
            and model.idle_timeout > 0
            and now - max(state.busy_at, self.started) >= model.idle_timeout
        ):
            state.wanted -= 1
            state.busy_at = now
            self.log.info(
                "model {model}: light load for {seconds:g}s: scaling down to {count}",
                model=model.name,
                seconds=model.idle_timeout,
                count=max(model.min_replicas, state.wanted),
            )

    def _scale(
        self,
        state: _ModelState,
        now: float,
        snapshot: _Snapshot | None,
        replicas: list[ReplicaRecord],
    ) -> _Snapshot | None:
        self._follow_load(state, now, replicas)
        want = self.desired(state, now, replicas)
        live = [r for r in replicas if r.draining_since is None]
        if not self.grace_over:
            return snapshot
        if len(live) > want:
            # Surplus: those not ready go first, then the least loaded, then
            # the newest.
            order = sorted(
                live,
                key=lambda r: (r.state == "ready", self._outstanding(r.id), -r.created),
            )
            for replica in order[: len(live) - want]:
                self._drain(replica, f"{len(live)} replicas, {want} wanted")
            return snapshot
        if len(live) == want:
            state.no_fit = None
            return snapshot
        if now < state.retry_at:
            return snapshot
        if snapshot is None:
            snapshot = _Snapshot(
                self.inventory.nodes(),
                self.replicas.values(),
                self._suspect_ports(now),
                self._views,
            )
        spread = {s.node for r in live for s in r.shards}
        for _ in range(want - len(live)):
            result = place(
                state.model.profiles, snapshot.fleet, self._ports, frozenset(spread)
            )
            if isinstance(result, NoFit):
                if state.no_fit != result:
                    state.last_error = "no place for a replica: " + "; ".join(
                        result.lines()[:3]
                    )
                    self.log.warn(
                        "model {model}: no place for a replica: {why}",
                        model=state.model.name,
                        why="; ".join(result.lines()),
                    )
                state.no_fit = result
                state.retry_at = now + self.settings.base_backoff
                break
            state.no_fit = None
            self._start(state.model, result, now)
            snapshot.take(result)
            spread.update(s.node for s in result.shards)
        return snapshot

    def _start(self, model: Model, plan: Plan, now: float) -> None:
        replica_id = f"{_safe(model.name)}-{secrets.token_hex(4)}"
        profile = plan.profile
        replica = ReplicaRecord(replica_id, model.name, profile, [], now)
        self.replicas[replica_id] = replica
        leader = plan.shards[0]
        leader_node = self.inventory.get(leader.node)
        leader_address = (
            f"{leader_node.address}:{leader.port}" if leader_node is not None else ""
        )
        for shard_plan in plan.shards:
            shard = ShardRecord(
                id=f"{replica_id}-{shard_plan.rank}",
                node=shard_plan.node,
                gpus=shard_plan.gpus,
                port=shard_plan.port,
                rank=shard_plan.rank,
            )
            replica.shards.append(shard)
            self._shards[shard.id] = (replica, shard)
            command = pb.StartShard(
                shard_id=shard.id,
                replica_id=replica_id,
                model=model.name,
                profile=profile.name,
                engine=profile.engine,
                source=profile.source,
                args=profile.args,
                env=dict(profile.env),
                port=shard.port,
                gpu_indices=shard.gpus,
                rank=shard.rank,
                world_size=len(plan.shards),
                leader_address=leader_address,
            )
            d = self.commands.send(shard.node, pb.ControlMessage(start_shard=command))
            d.addErrback(self._start_refused, shard)
        self.log.info(
            "placed replica {replica} of {model} with profile {profile} on {where}",
            replica=replica_id,
            model=model.name,
            profile=profile.name,
            where=", ".join(
                f"{s.node} GPUs {list(s.gpus)} port {s.port}" for s in plan.shards
            ),
        )

    def _suspect_ports(self, now: float) -> dict[str, set[int]]:
        """
        @return: per node, the ports where a shard failed to start lately;
            placement leaves them alone for L{SUSPECT_PORT_SECONDS}.
        """
        ports: dict[str, set[int]] = {}
        for (node, port), since in list(self._suspect.items()):
            if now - since >= SUSPECT_PORT_SECONDS:
                del self._suspect[node, port]
            else:
                ports.setdefault(node, set()).add(port)
        return ports

    def _start_refused(self, reason: Failure, shard: ShardRecord) -> None:
        if shard.state in _GONE:
            return
        if isinstance(reason.value, CommandFailed):
            result = reason.value.result
            if result.code == "port_in_use":
                # Something else holds the port on that node: the next try
                # gets another.
                self._suspect[shard.node, shard.port] = self.clock.seconds()
            shard.error = result.error
        elif reason.check(NoLink):
            # Never sent: nothing runs.
            shard.error = f"not started: {reason.getErrorMessage()}"
        else:
            # The link went down with the command unanswered: the engine may
            # run.  The node's next Register says (listed: kept; not listed:
            # gone), and start_timeout bounds the wait.
            self.log.info(
                "start of shard {shard} on {node} unanswered: {why}; waiting for"
                " the node to register again",
                shard=shard.id,
                node=shard.node,
                why=reason.getErrorMessage(),
            )
            return
        shard.state = "failed"
        self.loop.kick()

    def _stop_shard(self, node_id: str, shard_id: str) -> None:
        d = self.commands.send(
            node_id,
            pb.ControlMessage(
                stop_shard=pb.StopShard(shard_id=shard_id, grace_seconds=STOP_GRACE)
            ),
        )

        def failed(reason: Failure) -> None:
            # A lost node's shards cannot be told; it stops them when its
            # agent registers again and finds them unclaimed.
            if not reason.check(CancelledError):
                self.log.info(
                    "stop of shard {shard} on {node} not done: {why}",
                    shard=shard_id,
                    node=node_id,
                    why=reason.getErrorMessage(),
                )

        d.addErrback(failed)

    def _finish_drain(self, replica: ReplicaRecord, now: float) -> None:
        assert replica.draining_since is not None
        if replica.stop_sent_at is not None:
            if now - replica.stop_sent_at > STOP_GRACE + 10:
                # Not gone after SIGKILL's time: the stop was lost (a link
                # down); again.
                replica.stop_sent_at = now
                for shard in replica.shards:
                    if shard.state not in _GONE:
                        self._stop_shard(shard.node, shard.id)
            return
        in_flight = self._outstanding(replica.id)
        late = now - replica.draining_since >= self.settings.drain_timeout
        if in_flight and not late:
            return
        if in_flight:
            self.log.warn(
                "replica {replica}: {count} requests still in flight after"
                " {seconds:g}s of draining; stopping it",
                replica=replica.id,
                count=in_flight,
                seconds=self.settings.drain_timeout,
            )
        replica.stop_sent_at = now
        for shard in replica.shards:
            if shard.state not in _GONE:
                shard.state = "draining"
                self._stop_shard(shard.node, shard.id)

    def _publish_ready(self) -> None:
        endpoints = list(self._static)
        ready_models: set[str] = set()
        for replica in self.replicas.values():
            if replica.state != "ready":
                continue
            leader = replica.leader
            node = self.inventory.get(leader.node) if leader is not None else None
            state = self._models.get(replica.model)
            if leader is None or node is None or state is None:
                continue
            endpoints.append(
                Endpoint(
                    replica.id,
                    f"http://{_host(node.address)}:{leader.port}",
                    state.model.names,
                )
            )
            ready_models.add(replica.model)
        published = tuple(endpoints)
        if published != self._published:
            self._published = published
            self._publish(endpoints)
        for name in ready_models:
            state = self._models[name]
            waiters, state.waiters = state.waiters, []
            for waiter in waiters:
                waiter.callback(None)

    # Reads for the admin API.

    def models_json(self) -> list[dict[str, Any]]:
        """
        @return: each catalog model with its desired and ready counts.
        """
        now = self.clock.seconds()
        out = []
        for state in self._models.values():
            model = state.model
            replicas = [r for r in self.replicas.values() if r.model == model.name]
            out.append(
                {
                    "name": model.name,
                    "aliases": list(model.aliases),
                    "min_replicas": model.min_replicas,
                    "max_replicas": model.max_replicas,
                    "idle_timeout": model.idle_timeout,
                    "desired": self.desired(state, now),
                    "ready": sum(1 for r in replicas if r.state == "ready"),
                    "replicas": len(replicas),
                    "waiting_requests": len(state.waiters),
                    "failures_in_a_row": state.failures,
                    "retry_in": max(0.0, round(state.retry_at - now, 1)),
                    "last_error": state.last_error or None,
                    "profiles": [p.name for p in model.profiles],
                }
            )
        return out

    def explain(self, name: str) -> dict[str, Any]:
        """
        @return: where a replica of the model would go now, or why it
            cannot go anywhere: one line per profile and node.
        @raise KeyError: not a catalog name.
        """
        model = self._models[self._names[name]].model
        snapshot = _Snapshot(
            self.inventory.nodes(),
            self.replicas.values(),
            self._suspect_ports(self.clock.seconds()),
            self._views,
        )
        result = place(model.profiles, snapshot.fleet, self._ports)
        if isinstance(result, NoFit):
            return {"model": model.name, "fits": False, "reasons": result.lines()}
        return {
            "model": model.name,
            "fits": True,
            "profile": result.profile.name,
            "shards": [
                {"node": s.node, "gpus": list(s.gpus), "port": s.port, "rank": s.rank}
                for s in result.shards
            ],
            "reasons": [],
        }


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


class _Snapshot:
    """
    The inventory as placement sees it during one pass: GPUs and ports
    taken by live shards count as allocated, and each placement made in
    the pass is taken at once so the next one does not reuse it.

    @param cache: node views of earlier passes, reused for nodes where
        nothing placement reads has changed.
    """

    def __init__(
        self,
        nodes: Iterable[Node],
        replicas: Iterable[ReplicaRecord],
        suspect_ports: dict[str, set[int]],
        cache: dict[str, tuple[Any, NodeView]] | None = None,
    ) -> None:
        nodes = list(nodes)
        taken: dict[str, set[int]] = {}
        # Ports are per address: two nodes on one host (two agents, or a
        # test fleet) share its ports.
        address = {node.id: node.address for node in nodes}
        ports: dict[str, set[int]] = {}
        for node_id, suspect in suspect_ports.items():
            ports.setdefault(address.get(node_id, node_id), set()).update(suspect)
        for replica in replicas:
            for shard in replica.shards:
                if shard.state in _GONE:
                    continue
                taken.setdefault(shard.node, set()).update(shard.gpus)
                key = address.get(shard.node, shard.node)
                ports.setdefault(key, set()).add(shard.port)
        if cache is None:
            cache = {}
        views = []
        for node in nodes:
            state = node.state
            if state == "ready" and not node.connected:
                state = "disconnected"
            if state == "ready" and node.draining:
                state = "draining"
            used = frozenset(taken.get(node.id, ()))
            busy = frozenset(ports.get(node.address, ()))
            version = (node.version, state, used, busy)
            hit = cache.get(node.id)
            if hit is not None and hit[0] == version:
                views.append(hit[1])
                continue
            view = NodeView(
                id=node.id,
                state=state,
                fabrics=frozenset(node.fabrics),
                gpus=tuple(
                    GpuView(
                        index=g.index,
                        name=g.name,
                        memory_total_mib=g.memory_total_mib,
                        memory_used_mib=g.memory_used_mib,
                        problems=tuple(g.problems),
                        allocated=g.index in used,
                    )
                    for g in node.gpus
                ),
                ports_in_use=busy,
            )
            cache[node.id] = (version, view)
            views.append(view)
        self.fleet = Fleet(views)
        by_address: dict[str, list[str]] = {}
        for node in nodes:
            by_address.setdefault(node.address, []).append(node.id)
        self._same_address = {
            node.id: [n for n in by_address[node.address] if n != node.id]
            for node in nodes
            if len(by_address[node.address]) > 1
        }

    def take(self, plan: Plan) -> None:
        for shard in plan.shards:
            view = self.fleet.get(shard.node)
            self.fleet.replace(
                replace(
                    view,
                    gpus=tuple(
                        replace(g, allocated=True) if g.index in shard.gpus else g
                        for g in view.gpus
                    ),
                    ports_in_use=view.ports_in_use | {shard.port},
                )
            )
            for other in self._same_address.get(shard.node, ()):
                view = self.fleet.get(other)
                self.fleet.replace(
                    replace(view, ports_in_use=view.ports_in_use | {shard.port})
                )
