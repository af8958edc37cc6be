"""
What the control plane does to one replica, and what it does with the
answers (docs/architecture.md, "The control plane's layers"): start it,
drain it and stop it, put it to sleep, wake it, forget it.  The layer
above the records (L{llmgw.control.ledger}) and the publisher
(L{llmgw.control.publishing}); it calls nothing above it: making room,
bringing models up, the operator's drains and the agents' reports all end
here.

A drain: the replica unpublished at once, and stopped once the router
counts no request in flight to it, or after C{[control] drain_timeout} (or
its own, longer patience), when what is still in flight is cut.

A sleep (docs/catalog.md, "Sleep"): the replica unpublished at once and
told to sleep once its last request ends (bounded by the router's
C{total_timeout}, as a scale-down is).  One whose sleep or wake fails is
stopped, and its model placed anew, but for a wake refused because
another engine still holds its GPUs (it sleeps on, L{ReplicaActions.woken}).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from twisted.internet.defer import gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control.catalog import Model
from llmgw.control.commands import STOP_GRACE, ShardCommands
from llmgw.control.inventory import Inventory
from llmgw.control.ledger import Ledger
from llmgw.control.placement import Plan
from llmgw.control.publishing import Publisher, host
from llmgw.control.records import ReplicaRecord
from llmgw.control.runtime import ModelCatalog
from llmgw.control.scaling import backoff
from llmgw.control.settings import ControlConfig
from llmgw.control.sleeping import WAKE_REFUSALS, SleepRoom
from llmgw.control.spans import trace_drain
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.engines import SLEEP_LEVELS
from llmgw.wire.states import ShardState

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


class ReplicaActions:
    """
    Starts, drains, stops, sleeps and wakes replicas.

    @param clock: the reactor's clock.
    @param settings: the C{[control]} table.
    @param inventory: the nodes (a gang's rendezvous address).
    @param catalog: the catalog at run time (which models are pinned).
    @param ledger: the records.
    @param publisher: told which replicas changed.
    @param commands: sends the shards' commands.
    @param room: whether a replica may sleep.
    @param kick: asks for one more pass.
    @param outstanding: requests in flight to a replica id, by the
        router's count.
    @param cut: ends the router's requests in flight to a replica id now,
        with a reason.
    @param leave_timeout: seconds a replica leaving by scale-down,
        eviction or sleep waits for its requests in flight to end.
    @param tracer: the control plane's spans, or L{None}.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        settings: ControlConfig,
        inventory: Inventory,
        catalog: ModelCatalog,
        ledger: Ledger,
        publisher: Publisher,
        commands: ShardCommands,
        room: SleepRoom,
        kick: Callable[[], None],
        outstanding: Callable[[str], int],
        cut: Callable[[str, str], object],
        leave_timeout: float,
        tracer: Tracer | None,
    ) -> None:
        self._clock = clock
        self._settings = settings
        self._inventory = inventory
        self._catalog = catalog
        self._ledger = ledger
        self._publisher = publisher
        self._commands = commands
        self._room = room
        self._kick = kick
        self._outstanding = outstanding
        self._cut = cut
        self.leave_timeout = leave_timeout
        self._tracer = tracer

    # Starting and forgetting.

    def start(self, model: Model, plan: Plan, now: float) -> ReplicaRecord:
        """
        Start a replica of C{model} as C{plan} says, and record it.

        @param now: reactor seconds.
        @return: the new replica, its shards C{pending}.
        """
        leader = plan.shards[0]
        node = self._inventory.get(leader.node)
        port = plan.rendezvous_port or leader.port
        address = f"{host(node.address)}:{port}" if node is not None else ""
        replica = self._commands.start(model.name, plan, now, address)
        self._ledger.counts.started(model.name)
        self._ledger.record(replica, None)
        for shard in replica.shards:
            self._ledger.record(replica, shard)
        return replica

    def forget(self, replica: ReplicaRecord, why: str = "it stopped") -> None:
        """
        C{replica} is gone: what is still in flight to it is cut with
        C{why}, and it leaves the records and the router's list.
        """
        if self._outstanding(replica.id):
            # Its engine is gone or going: what is in flight to it ends
            # now, not at the router's idle deadline.
            self._cut(replica.id, why)
        self._ledger.forget(replica)
        self._publisher.republish(replica.id)

    # The drain.

    def drain(self, replica: ReplicaRecord, why: str, patience: float = 0.0) -> bool:
        """
        Unpublish C{replica} now and stop it once nothing is in flight to
        it (L{finish_drain}).

        @param patience: seconds its requests in flight may take, when
            more than C{[control] drain_timeout} (a scale-down or an
            eviction waits up to the router's C{total_timeout} rather than
            cut a stream).
        @return: whether it started draining (was not already).
        """
        if replica.draining_since is not None:
            return False
        replica.draining_since = self._clock.seconds()
        replica.drain_reason = why
        replica.drain_patience = patience
        self._ledger.changes.model(replica.model)
        self._publisher.republish(replica.id)
        self.log.info(
            "draining replica {replica} of {model}: {why}",
            replica=replica.id,
            model=replica.model,
            why=why,
        )
        # No new requests from now on.
        self._publisher.publish_ready()
        return True

    def finish_drain(self, replica: ReplicaRecord, now: float) -> None:
        """
        C{replica} is draining: once nothing is in flight to it (or its
        drain ran out of time, when what is left is cut) its shards are
        told to stop, and told again if they are not gone after a stop's
        time.
        """
        assert replica.draining_since is not None
        if replica.stop_sent_at is not None:
            if now - replica.stop_sent_at > STOP_GRACE + 10:
                # Not gone after SIGKILL's time: the stop was lost (a link
                # down); again.
                replica.stop_sent_at = now
                for shard in replica.shards:
                    if not shard.state.gone:
                        self._commands.stop(shard.node, shard.id)
            return
        in_flight = self._outstanding(replica.id)
        timeout = max(self._settings.drain_timeout, replica.drain_patience)
        late = now - replica.draining_since >= timeout
        if in_flight and not late:
            return
        if in_flight:
            self.log.warn(
                "replica {replica}: {count} requests still in flight after"
                " {seconds:g}s of draining; stopping it",
                replica=replica.id,
                count=in_flight,
                seconds=timeout,
            )
            # Its engine may never close them (a lost node sends no FIN).
            self._cut(replica.id, f"its drain ran out of time ({timeout:g}s)")
        trace_drain(self._tracer, replica, now, in_flight)
        replica.stop_sent_at = now
        for shard in replica.shards:
            if not shard.state.gone:
                shard.state = ShardState.DRAINING
                self._commands.stop(shard.node, shard.id)

    # Going to sleep.

    def retire(self, replica: ReplicaRecord, why: str, reason: str) -> bool:
        """
        Take C{replica} out of service without cutting a stream: put to
        sleep when it may (L{SleepRoom.why_not_sleep}), else drained.

        @param reason: the swap reason counted when it sleeps
            (C{"slept"}, C{"idle_sleep"}).
        @return: whether it sleeps.
        """
        not_sleep = self._room.why_not_sleep(replica)
        if not_sleep is not None and "sleep_memory" in not_sleep:
            not_sleep = self._make_sleep_room(replica)
        if not_sleep is None:
            self.sleep(replica, why, reason)
            return True
        if replica.profile.sleep != "off":
            self.log.info(
                "replica {replica} of {model} cannot sleep ({because}): stopping it",
                replica=replica.id,
                model=replica.model,
                because=not_sleep,
            )
        self.drain(replica, why, self.leave_timeout)
        return False

    def _make_sleep_room(self, replica: ReplicaRecord) -> str | None:
        """
        Stop the least recently resident replicas asleep on C{replica}'s
        nodes until their C{sleep_memory} has room for it, when stopping
        them all would make it.

        @return: L{None} once C{replica} may sleep, or why not (nothing
            stopped then).
        """
        nodes = {s.node for s in replica.shards}
        others = sorted(
            (
                r
                for _, replicas in self._ledger.by_model()
                for r in replicas
                if r is not replica
                and r.asleep
                and {s.node for s in r.shards} & nodes
                and not self._pinned(r.model)
            ),
            key=lambda r: (self._priority(r.model), r.resident_since),
        )
        need = replica.profile.sleep_host_memory_gb
        held = self._room.sleeping_host()
        for node_id in nodes:
            budget = self._room.budget_gb(node_id)
            freeable = sum(
                r.profile.sleep_host_memory_gb
                for r in others
                if any(s.node == node_id for s in r.shards)
            )
            if held.get(node_id, 0.0) - freeable + need > budget + 1e-9:
                return f"node {node_id}'s sleep_memory ({budget:.1f} GB) is too small"
        for other in others:
            if self._room.why_not_sleep(replica) is None:
                break
            self.drain(other, f"asleep longest: sleep_memory for {replica.id}")
        return self._room.why_not_sleep(replica)

    def _pinned(self, name: str) -> bool:
        state = self._catalog.get(name)
        return state is not None and state.model.pinned

    def _priority(self, name: str) -> int:
        state = self._catalog.get(name)
        return state.model.priority if state is not None else 0

    def sleep(self, replica: ReplicaRecord, why: str, reason: str) -> None:
        """
        Put C{replica} to sleep: unpublished now, its shards told to sleep
        once its last request ends (L{finish_sleep}).

        @param reason: the swap reason counted (L{PlaneCounts.swapped}).
        """
        replica.sleep_at = self._clock.seconds()
        replica.sleep_sent_at = None
        replica.sleep_reason = why
        self._ledger.counts.swapped(replica.model, reason)
        self.log.info(
            "putting replica {replica} of {model} to sleep ({sleep}): {why}",
            replica=replica.id,
            model=replica.model,
            sleep=replica.profile.sleep,
            why=why,
        )
        self._ledger.changes.model(replica.model)
        self._publisher.republish(replica.id)
        self._publisher.publish_ready()

    def finish_sleep(self, replica: ReplicaRecord, now: float) -> None:
        """
        C{replica} was put to sleep: once nothing is in flight to it (or
        the router's C{total_timeout} passed, when what is left is cut),
        its shards are told to sleep.
        """
        if replica.sleep_at is None or replica.sleep_sent_at is not None:
            return
        in_flight = self._outstanding(replica.id)
        late = now - replica.sleep_at >= self.leave_timeout
        if in_flight and not late:
            return
        if in_flight:
            self.log.warn(
                "replica {replica}: {count} requests still in flight after"
                " {seconds:g}s; putting it to sleep",
                replica=replica.id,
                count=in_flight,
                seconds=self.leave_timeout,
            )
            self._cut(replica.id, f"it went to sleep after {self.leave_timeout:g}s")
        replica.sleep_sent_at = now
        level = SLEEP_LEVELS[replica.profile.sleep]
        sent = [
            self._commands.sleep(shard.node, shard.id, level, shard)
            for shard in replica.shards
        ]
        gatherResults(sent).addCallback(self._slept, replica)

    def _slept(self, results: list[pb.CommandResult], replica: ReplicaRecord) -> None:
        if self._ledger.replicas.get(replica.id) is not replica or not replica.dormant:
            return
        failed = next((r for r in results if not r.ok), None)
        if failed is not None:
            replica.sleep_at = None
            self._stop_failed(replica, "go to sleep", failed)
        elif replica.sleep_sent_at is not None:
            replica.asleep_at = self._clock.seconds()
            seconds = replica.asleep_at - replica.sleep_sent_at
            self._ledger.counts.observed("sleep", replica.model, seconds)
        self._ledger.changes.model(replica.model)
        self._kick()

    def _stop_failed(
        self, replica: ReplicaRecord, what: str, failed: pb.CommandResult
    ) -> None:
        """
        C{replica} did not C{what} (C{"go to sleep"}, C{"wake"}): one
        warning with its agent's answer, and it is stopped.
        """
        self.log.warn(
            "replica {replica} of {model} did not {what} ({code}: {error});"
            " stopping it",
            replica=replica.id,
            model=replica.model,
            what=what,
            code=failed.code or "error",
            error=failed.error,
        )
        self.drain(replica, f"it did not {what}", self.leave_timeout)

    # Waking.

    def wake(self, replica: ReplicaRecord, now: float, why: str) -> None:
        """
        Wake C{replica}: C{waking} until every shard's engine answered,
        then published (ready) or, if a wake failed, stopped.
        """
        replica.wake_at = now
        replica.wake_refused_until = 0.0
        replica.sleep_at = None
        replica.sleep_sent_at = None
        replica.asleep_at = None
        replica.sleep_reason = ""
        replica.resident_since = now
        self.log.info(
            "waking replica {replica} of {model}: {why}",
            replica=replica.id,
            model=replica.model,
            why=why,
        )
        sent = [self._commands.wake(s.node, s.id, s) for s in replica.shards]
        gatherResults(sent).addCallback(self._woken, replica)
        self._ledger.changes.model(replica.model)

    def _woken(self, results: list[pb.CommandResult], replica: ReplicaRecord) -> None:
        if (
            self._ledger.replicas.get(replica.id) is not replica
            or replica.wake_at is None
        ):
            return
        failures = [r for r in results if not r.ok]
        woke_at, replica.wake_at = replica.wake_at, None
        if (
            failures
            and replica.asleep
            and {r.code for r in failures} == {"gpus_in_use"}
            and replica.wake_refusals < WAKE_REFUSALS
        ):
            self._sleeps_on(replica, failures[0].error)
        elif failures:
            self._stop_failed(replica, "wake", failures[0])
        else:
            replica.wake_refusals = 0
            seconds = self._clock.seconds() - woke_at
            self._ledger.counts.observed("wake", replica.model, seconds)
            self._publisher.republish(replica.id)
        self._ledger.changes.model(replica.model)
        self._kick()

    def _sleeps_on(self, replica: ReplicaRecord, error: str) -> None:
        """
        C{replica}'s wake was refused for C{gpus_in_use} (another engine
        still holds its GPUs on the node: a fact for placement, not the
        replica's failure) and every shard still sleeps: it stays asleep,
        and is not woken again for a backoff that doubles with each such
        refusal in a row (C{base_backoff} to C{max_backoff}).  Meanwhile its
        model may wake another sleeper, or start a replica where placement
        puts it elsewhere (not on the GPUs refused, which look free to it).
        After L{WAKE_REFUSALS} in a row, a refusal stops it as any failed
        wake does.
        """
        now = self._clock.seconds()
        replica.sleep_at = replica.sleep_sent_at = replica.asleep_at = now
        replica.sleep_reason = "its wake was refused: " + error
        replica.wake_refusals += 1
        wait = backoff(
            self._settings.base_backoff,
            self._settings.max_backoff,
            replica.wake_refusals,
        )
        replica.wake_refused_until = now + wait
        self.log.info(
            "replica {replica} of {model} not woken ({error}); it sleeps on, not"
            " woken for {wait:g}s",
            replica=replica.id,
            model=replica.model,
            error=error,
            wait=wait,
        )
