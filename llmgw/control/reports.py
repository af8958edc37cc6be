"""
What the agents say (L{llmgw.control.plane}): shard statuses and
registrations, as they arrive between passes, change the records (a
Register's shards are adopted, see L{adoption}) and kick a pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control import adoption, scaling
from llmgw.control.commands import ShardCommands
from llmgw.control.ledger import Ledger
from llmgw.control.phases import agent_phases, observe
from llmgw.control.records import ReplicaRecord, ShardRecord, output_summary
from llmgw.control.runtime import ModelCatalog
from llmgw.control.snapshot import Strays
from llmgw.control.spans import trace_start
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.states import ShardState

SLEEP_REFUSED = "sleep refused: "
"""
How a C{ShardStatus.note} begins when the engine refused sleep mode at
start (L{llmgw.agent.supervisor}).
"""
if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


class AgentReports:
    """
    What the agents say, taken into the records.  The layer above the
    records; it calls nothing above them but the shards' commands (a
    stray is stopped).

    @param clock: the reactor's clock.
    @param catalog: the catalog at run time.
    @param ledger: the records.
    @param commands: stops shards no model claims.
    @param strays: where engines that may run unrecorded are kept.
    @param kick: asks for one more pass.
    @param tracer: the control plane's spans (L{llmgw.control.spans}),
        or L{None}.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        catalog: ModelCatalog,
        ledger: Ledger,
        commands: ShardCommands,
        strays: Strays,
        kick: Callable[[], None],
        tracer: Tracer | None,
    ) -> None:
        self._clock = clock
        self._catalog = catalog
        self._ledger = ledger
        self._commands = commands
        self._strays = strays
        self._kick = kick
        self._tracer = tracer

    def shard_status(self, node_id: str, status: pb.ShardStatus) -> None:
        """
        Record a shard's transition; unknown shards are ignored here (a
        Register lists them all).
        """
        found = self._ledger.shard(status.shard_id)
        if found is None or found[1].node != node_id:
            if (ShardState.from_pb(status.state) or ShardState.PENDING).gone:
                self._strays.gone(node_id, status.shard_id)
                self._ledger.changes.nodes.add(node_id)
            self._late_output(node_id, status)
            return
        replica, shard = found
        state = ShardState.from_pb(status.state) or shard.state
        if shard.state.gone:
            return
        self._settle(replica, shard, state)
        if status.pid:
            shard.pid = status.pid
        if status.output_tail:
            shard.output = tuple(status.output_tail)
        if status.note.startswith(SLEEP_REFUSED):
            # Its agent started it without sleep mode: it is stopped, not
            # put to sleep (L{llmgw.control.sleeping}).
            shard.sleep_refused = status.note[len(SLEEP_REFUSED) :]
        if status.phases and not shard.phases:
            shard.phases = agent_phases(status)
            observe(self._ledger.counts.start_phase_seconds, replica, shard)
            if shard is replica.leader:
                trace_start(self._tracer, replica, self._clock.seconds())
        if state == ShardState.FAILED:
            shard.error = status.error + output_summary(shard.output)
        self._ledger.changes.model(replica.model)
        self._ledger.changes.nodes.add(node_id)
        self._kick()

    def _settle(
        self, replica: ReplicaRecord, shard: ShardRecord, state: ShardState
    ) -> None:
        """
        C{shard} of C{replica} is in C{state} now, as its agent says (a
        status or a Register): the first change after an adoption as
        awake settles what the adoption counted (L{_adopted_checked}).
        """
        if replica.adopt_unsettled and state != shard.state:
            self._adopted_checked(replica, state)
        shard.state = state

    def _adopted_checked(self, replica: ReplicaRecord, state: ShardState) -> None:
        """
        A replica adopted as awake, whose agent has asked its engine: one
        found asleep (its marker said awake; the plane did not put it to
        sleep) no longer counts in its model's C{wanted}, which the
        adoption had raised for the replicas awake: C{wanted} falls to
        those of its other replicas still awake (or staying starting),
        never below C{min_replicas}, never up.  One found ready is as
        adopted.
        """
        replica.adopt_unsettled = False
        if state != ShardState.SLEEPING or replica.sleep_at is not None:
            return
        counts = self._catalog.get(replica.model)
        if counts is None:
            return
        awake = sum(
            1
            for r in self._ledger.replicas.values()
            if r.model == replica.model
            and r is not replica
            and r.draining_since is None
            and not r.dormant
        )
        counts.wanted = max(counts.model.min_replicas, min(counts.wanted, awake))

    def _late_output(self, node_id: str, status: pb.ShardStatus) -> None:
        """
        The output of a shard of a failed replica, sent when its engine
        stopped (one the server gave up waiting for): kept with the
        replica, and its summary added to the model's last error.
        """
        if not status.output_tail:
            return
        for replica in self._ledger.failed.values():
            for shard in replica.shards:
                if shard.id == status.shard_id and shard.node == node_id:
                    if shard.output:
                        return
                    shard.output = tuple(status.output_tail)
                    state = self._catalog.get(replica.model)
                    if state is not None and state.last_error.startswith(
                        f"replica {replica.id}: "
                    ):
                        state.last_error += output_summary(shard.output)
                    self._ledger.changes.model(replica.model)
                    return

    def node_registered(self, node_id: str, register: pb.Register) -> None:
        """
        Adoption (see L{adoption}): shards the catalog still claims become
        (or stay) replicas, the others are stopped; shards recorded on
        this node that it no longer lists are gone.
        """
        listed = {s.shard_id for s in register.shards}
        # Its description (address, GPUs) and its shards change: the models
        # of those (publishing, replacing) and its view (placement).
        self._ledger.changes.nodes.add(node_id)
        self._strays.listed(node_id, listed)
        for replica, shard in list(self._ledger.shards_on(node_id)):
            self._ledger.changes.model(replica.model)
            if shard.id not in listed:
                if not shard.state.gone:
                    shard.state = ShardState.FAILED
                    shard.error = f"not running on {node_id} after its agent registered"
        models = (
            {s.model.name: s.model for s in self._catalog.states()}
            if register.shards
            else {}
        )
        for running in register.shards:
            found = self._ledger.shard(running.shard_id)
            if found is not None and found[1].node == node_id:
                self._relisted(found[0], found[1], running)
                continue
            reason = adoption.claim(
                running,
                models,
                self._shard_node,
                self._ledger.replicas,
                self._ledger.grace.over,
            )
            if reason:
                self.log.info(
                    "stopping shard {shard} on {node}: {reason}",
                    shard=running.shard_id,
                    node=node_id,
                    reason=reason,
                )
                self._commands.stop(node_id, running.shard_id)
                now = self._clock.seconds()
                self._strays.add(node_id, running.shard_id, (), running.port, now)
                continue
            self._adopt(node_id, running)
        # New capacity: models waiting for a place (never settled, see
        # L{llmgw.control.changes}) try again now.
        for name in self._ledger.changes.unsettled:
            waiting = self._catalog.get(name)
            if waiting is not None and waiting.no_fit is not None:
                waiting.retry_at = 0.0
        self._kick()

    def _relisted(
        self, replica: ReplicaRecord, shard: ShardRecord, running: pb.RunningShard
    ) -> None:
        if adoption.reprobed(shard, running):
            return
        state = adoption.relisted(shard, running)
        if state is not None:
            # Its check may have answered while the link was down.
            self._settle(replica, shard, state)
            shard.pid = running.pid or shard.pid
        if replica.stop_sent_at is not None and not adoption.listed_state(running).gone:
            # The stop may have been lost with the old link.
            self._commands.stop(shard.node, shard.id)

    def _shard_node(self, shard_id: str) -> str | None:
        found = self._ledger.shard(shard_id)
        return found[1].node if found is not None else None

    def _adopt(self, node_id: str, running: pb.RunningShard) -> None:
        counts = self._catalog[running.model]
        model = counts.model
        profile = next(p for p in model.profiles if p.name == running.profile)
        replica = self._ledger.replicas.get(running.replica_id)
        if replica is None:
            now = self._clock.seconds()
            replica = adoption.replica_record(running, profile, now)
            self._ledger.record(replica, None)
            if running.state != pb.SHARD_STATE_SLEEPING:
                # One adopted asleep was not wanted awake: it stays asleep.
                live = sum(
                    1
                    for r in self._ledger.replicas.values()
                    if r.model == model.name
                    and r.draining_since is None
                    and not r.dormant
                )
                counts.wanted = scaling.kept_after_adoption(model, counts.wanted, live)
                replica.adopt_unsettled = True
            counts.last_used = counts.busy_at = now
        shard = adoption.shard_record(node_id, running)
        replica.shards.append(shard)
        self._ledger.record(replica, shard)
        self.log.info(
            "adopted shard {shard} of model {model} on {node} (engine pid {pid})",
            shard=shard.id,
            model=model.name,
            node=node_id,
            pid=running.pid,
        )
