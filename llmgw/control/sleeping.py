"""
Sleep as a state of a replica (L{llmgw.control.plane}; docs/catalog.md,
"Sleep"): a replica of a model whose profile says C{sleep} goes to sleep
instead of stopping when its model scales down or it is evicted, and is
woken, rather than a replica cold-started, when its model is wanted
again and its GPUs have room.

A replica put to sleep is unpublished at once and told to sleep once its
last request ends (bounded by the router's C{total_timeout}, as a
scale-down is); asleep, its GPUs are free for placement but for what its
engine keeps (its agent reports the memory), and its host memory counts
against its node's C{sleep_memory} (C{Register.sleep_memory_bytes}).  A
replica that may not sleep (its engine refused sleep mode at start, the
node's budget is full) is stopped instead; one whose sleep or wake fails
is stopped, and its model placed anew, but for a wake refused because
another engine still holds its GPUs (it sleeps on).

Part of L{llmgw.control.plane.ControlPlane}, kept apart by job.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from statistics import mean
from typing import TYPE_CHECKING

from twisted.internet.defer import gatherResults
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control.catalog import Model
from llmgw.control.changes import Changes
from llmgw.control.commands import ShardCommands
from llmgw.control.inventory import Inventory, NodeState
from llmgw.control.loop import Loop
from llmgw.control.placement import Fleet, Plan, ShardPlan, place
from llmgw.control.records import PlaneCounts, ReplicaRecord, ReplicaState
from llmgw.control.runtime import ModelCatalog
from llmgw.control.scaling import ModelState, backoff
from llmgw.control.settings import ControlConfig
from llmgw.control.snapshot import Snapshot
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.engines import SLEEP_LEVELS

GB = 1024**3


class Sleeping:
    """
    The sleep half of L{llmgw.control.plane.ControlPlane}, which provides
    the attributes declared here.
    """

    log: Logger
    clock: IReactorTime
    inventory: Inventory
    settings: ControlConfig
    catalog: ModelCatalog
    counts: PlaneCounts
    replicas: dict[str, ReplicaRecord]
    ports: range
    leave_timeout: float
    loop: Loop
    _by_model: dict[str, dict[str, ReplicaRecord]]
    _outstanding: Callable[[str], int]
    _cut: Callable[[str, str], object]
    _commands: ShardCommands
    _changes: Changes

    def _republish(self, replica_id: str) -> None:
        raise NotImplementedError()

    def _publish_ready(self) -> None:
        raise NotImplementedError()

    def _drain(self, replica: ReplicaRecord, why: str, patience: float = 0.0) -> bool:
        raise NotImplementedError()

    if TYPE_CHECKING:
        # Provided by the classes after this one in the plane's bases.
        def _fleet_for(self, name: str, snapshot: Snapshot) -> Fleet: ...

        def _live_snapshot(self) -> Snapshot: ...

        def _swap_done(self, name: str, placed: bool) -> None: ...

        def _swap_waits(self, name: str, now: float) -> bool: ...

        def _evict_for_wake(
            self,
            state: ModelState,
            now: float,
            snapshot: Snapshot,
            sleeper: ReplicaRecord,
            idle_only: bool = False,
        ) -> bool: ...

        def _place_missing(
            self,
            state: ModelState,
            now: float,
            snapshot: Snapshot | None,
            live: list[ReplicaRecord],
            want: int,
        ) -> Snapshot: ...

    # Whether, and why not.

    def why_not_sleep(
        self, replica: ReplicaRecord, host: Mapping[str, float] | None = None
    ) -> str | None:
        """
        @param host: L{_sleeping_host} now, when the caller has it (asking
            of many replicas at once: one pass over the replicas).
        @return: why C{replica} may not be put to sleep now, in words, or
            L{None} when it may: its profile says C{sleep}, it is ready,
            its engine did not refuse sleep mode, and each of its nodes'
            C{sleep_memory} has room for what it would hold there.
        """
        profile = replica.profile
        if profile.sleep == "off":
            return f'profile {profile.name} of {replica.model} has sleep = "off"'
        refused = next((s.sleep_refused for s in replica.shards if s.sleep_refused), "")
        if refused:
            return f"its engine refused sleep mode ({refused})"
        if replica.state != ReplicaState.READY:
            return f"it is {replica.state}"
        need = profile.sleep_host_memory_gb
        if host is None:
            host = self._sleeping_host()
        for node_id in {s.node for s in replica.shards}:
            budget = self._sleep_budget_gb(node_id)
            held = host.get(node_id, 0.0)
            if held + need > budget + 1e-9:
                return (
                    f"node {node_id}'s sleep_memory ({budget:.1f} GB) holds"
                    f" {held:.1f} GB of sleeping replicas; {need:.1f} GB more"
                    " does not fit"
                )
        return None

    def _sleep_budget_gb(self, node_id: str) -> float:
        """
        @return: GB of host memory node C{node_id}'s sleeping engines may
            hold (its C{sleep_memory}); 0 for a node not known.
        """
        node = self.inventory.get(node_id)
        return (node.sleep_memory_bytes if node is not None else 0) / GB

    def _sleeping_host(self) -> dict[str, float]:
        """
        @return: per node, GB of host memory its dormant replicas hold (or
            will, once asleep); nodes with none are left out.
        """
        held: dict[str, float] = {}
        for replicas in self._by_model.values():
            for replica in replicas.values():
                if replica.dormant:
                    for node_id in {s.node for s in replica.shards}:
                        gb = replica.profile.sleep_host_memory_gb
                        held[node_id] = held.get(node_id, 0.0) + gb
        return held

    # Going to sleep.

    def _retire(self, replica: ReplicaRecord, why: str, reason: str) -> bool:
        """
        Take C{replica} out of service without cutting a stream: put to
        sleep when it may (L{why_not_sleep}), else drained.

        @param reason: the swap reason counted when it sleeps
            (C{"slept"}, C{"idle_sleep"}).
        @return: whether it sleeps.
        """
        not_sleep = self.why_not_sleep(replica)
        if not_sleep is not None and "sleep_memory" in not_sleep:
            not_sleep = self._make_sleep_room(replica)
        if not_sleep is None:
            self._sleep(replica, why, reason)
            return True
        if replica.profile.sleep != "off":
            self.log.info(
                "replica {replica} of {model} cannot sleep ({because}): stopping it",
                replica=replica.id,
                model=replica.model,
                because=not_sleep,
            )
        self._drain(replica, why, self.leave_timeout)
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
                for replicas in self._by_model.values()
                for r in replicas.values()
                if r is not replica
                and r.asleep
                and {s.node for s in r.shards} & nodes
                and not self._pinned(r.model)
            ),
            key=lambda r: (self._priority(r.model), r.resident_since),
        )
        need = replica.profile.sleep_host_memory_gb
        host = self._sleeping_host()
        for node_id in nodes:
            budget = self._sleep_budget_gb(node_id)
            freeable = sum(
                r.profile.sleep_host_memory_gb
                for r in others
                if any(s.node == node_id for s in r.shards)
            )
            if host.get(node_id, 0.0) - freeable + need > budget + 1e-9:
                return f"node {node_id}'s sleep_memory ({budget:.1f} GB) is too small"
        for other in others:
            if self.why_not_sleep(replica) is None:
                break
            self._drain(other, f"asleep longest: sleep_memory for {replica.id}")
        return self.why_not_sleep(replica)

    def _pinned(self, name: str) -> bool:
        state = self.catalog.get(name)
        return state is not None and state.model.pinned

    def _priority(self, name: str) -> int:
        state = self.catalog.get(name)
        return state.model.priority if state is not None else 0

    def _sleep(self, replica: ReplicaRecord, why: str, reason: str) -> None:
        """
        Put C{replica} to sleep: unpublished now, its shards told to sleep
        once its last request ends (L{_finish_sleep}).
        """
        replica.sleep_at = self.clock.seconds()
        replica.sleep_sent_at = None
        replica.sleep_reason = why
        self.counts.swapped(replica.model, reason)
        self.log.info(
            "putting replica {replica} of {model} to sleep ({sleep}): {why}",
            replica=replica.id,
            model=replica.model,
            sleep=replica.profile.sleep,
            why=why,
        )
        self._changes.model(replica.model)
        self._republish(replica.id)
        self._publish_ready()

    def _finish_sleep(self, replica: ReplicaRecord, now: float) -> None:
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
        if self.replicas.get(replica.id) is not replica or not replica.dormant:
            return
        failed = next((r for r in results if not r.ok), None)
        if failed is not None:
            replica.sleep_at = None
            self._stop_failed(replica, "go to sleep", failed)
        elif replica.sleep_sent_at is not None:
            replica.asleep_at = self.clock.seconds()
            seconds = replica.asleep_at - replica.sleep_sent_at
            self.counts.observed("sleep", replica.model, seconds)
        self._changes.model(replica.model)
        self.loop.kick()

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
        self._drain(replica, f"it did not {what}", self.leave_timeout)

    # Waking.

    def _wake_room(self, replica: ReplicaRecord, fleet: Fleet) -> str | None:
        """
        @return: why C{replica} cannot be woken where it sleeps in
            C{fleet}, or L{None} when each of its GPUs has the memory it
            would take back and no other replica is placed there.  A node
            not heard since it went to sleep still counts its memory awake.
        """
        profile = replica.profile
        for shard in replica.shards:
            view = fleet.get(shard.node)
            if view is None or view.state != NodeState.READY:
                return f"node {shard.node} is not ready"
            node = self.inventory.get(shard.node)
            stale = (
                node is not None
                and replica.asleep_at is not None
                and node.heard <= replica.asleep_at
            )
            held = profile.gpu_memory_gb if stale else profile.sleep_gpu_memory_gb
            need_mib = int((profile.gpu_memory_gb - held) * 1024)
            for gpu in view.gpus:
                if gpu.index not in shard.gpus:
                    continue
                if gpu.allocated:
                    return f"GPU {gpu.index} of {shard.node} is in use"
                if gpu.free_mib < need_mib:
                    return (
                        f"GPU {gpu.index} of {shard.node} has"
                        f" {gpu.free_mib / 1024:.1f} GB free, waking needs"
                        f" {need_mib / 1024:.1f} GB"
                    )
        return None

    def _wake(self, replica: ReplicaRecord, now: float, why: str) -> None:
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
        self._changes.model(replica.model)

    def _woken(self, results: list[pb.CommandResult], replica: ReplicaRecord) -> None:
        if self.replicas.get(replica.id) is not replica or replica.wake_at is None:
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
            seconds = self.clock.seconds() - woke_at
            self.counts.observed("wake", replica.model, seconds)
            self._republish(replica.id)
        self._changes.model(replica.model)
        self.loop.kick()

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
        now = self.clock.seconds()
        replica.sleep_at = replica.sleep_sent_at = replica.asleep_at = now
        replica.sleep_reason = "its wake was refused: " + error
        replica.wake_refusals += 1
        wait = backoff(
            self.settings.base_backoff, self.settings.max_backoff, replica.wake_refusals
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

    def _wake_missing(
        self,
        state: ModelState,
        now: float,
        snapshot: Snapshot,
        asleep: Sequence[ReplicaRecord],
        missing: int,
    ) -> list[ReplicaRecord]:
        """
        Wake up to C{missing} of C{asleep} (its model's replicas asleep)
        where their GPUs have room, the most recently resident first.

        @return: those woken.
        """
        woken: list[ReplicaRecord] = []
        name = state.model.name
        for replica in sorted(asleep, key=lambda r: -r.resident_since):
            if len(woken) >= missing:
                break
            if self._wake_room(replica, self._fleet_for(name, snapshot)) is not None:
                continue
            self._wake(replica, now, "its model is wanted and its GPUs have room")
            snapshot.take(held_plan(replica))
            woken.append(replica)
        if woken:
            state.no_fit = None
            self._swap_done(name, placed=True)
        return woken

    def _place_or_wake(
        self,
        state: ModelState,
        now: float,
        snapshot: Snapshot | None,
        live: list[ReplicaRecord],
        want: int,
        dormant: list[ReplicaRecord],
    ) -> Snapshot:
        """
        Bring C{state}'s model up to C{want} replicas: wake those asleep
        whose GPUs have room (preferred to a cold start); with requests
        held and none of them with room, evict what lets one wake
        (L{llmgw.control.swaps}); place the rest (L{_place_missing}).
        """
        name = state.model.name
        if self._swap_waits(name, now):
            return snapshot or self._live_snapshot()
        if snapshot is None:
            snapshot = self._live_snapshot()
        staying = sum(1 for r in live if r.leaving_since is None)
        # Those whose last wake was refused (gpus_in_use) wait their turn.
        refused = [r for r in dormant if r.asleep and now < r.wake_refused_until]
        asleep = [r for r in dormant if r.asleep and r not in refused]
        woken = self._wake_missing(state, now, snapshot, asleep, want - staying)
        if woken:
            live = live + woken
        elif asleep and state.waiters and self.settings.evict:
            latest = max(asleep, key=lambda r: r.resident_since)
            # With a free place, only idle replicas are evicted for a wake,
            # and the model never waits for busy ones.
            spread = frozenset(s.node for r in live for s in r.shards)
            free = place(
                state.model.profiles,
                self._fleet_for(name, snapshot),
                self.ports,
                spread,
            )
            if self._evict_for_wake(
                state, now, snapshot, latest, idle_only=isinstance(free, Plan)
            ):
                return snapshot
        elif (
            not asleep
            and any(not r.asleep for r in dormant)
            and state.waiters
            and self._falling_asleep(state, now)
        ):
            # Going to sleep (evicted, its requests ending): a wake once it
            # sleeps beats a cold start, as above.
            return snapshot
        elif (
            refused
            and not woken
            and self._refused_in_the_way(state, snapshot, live, refused)
        ):
            # Its GPUs are held by an engine placement does not see: a start
            # going there would be refused too; its wake is tried again.
            return snapshot
        if staying + len(woken) >= want:
            return snapshot
        return self._place_missing(state, now, snapshot, live, want)

    def _refused_in_the_way(
        self,
        state: ModelState,
        snapshot: Snapshot,
        live: list[ReplicaRecord],
        refused: list[ReplicaRecord],
    ) -> bool:
        """
        @param refused: C{state}'s model's sleepers whose wake was refused
            and who wait to be tried again.
        @return: whether a replica of the model placed now would go on
            GPUs of one of C{refused} (they look free to placement), or
            has no place: then the model waits for their next try rather
            than start one.
        """
        held = {(s.node, g) for r in refused for s in r.shards for g in s.gpus}
        spread = frozenset(s.node for r in live for s in r.shards)
        fleet = self._fleet_for(state.model.name, snapshot)
        plan = place(state.model.profiles, fleet, self.ports, spread)
        if not isinstance(plan, Plan):
            return True
        return any((s.node, g) in held for s in plan.shards for g in s.gpus)

    def _falling_asleep(self, state: ModelState, now: float) -> bool:
        """
        @return: whether C{state}'s model, whose replicas are dormant but
            none asleep yet, waits for one to fall asleep: its oldest held
            request has waited less than the model's mean cold start.
        """
        starts = self.counts.cold_start_seconds.get(state.model.name)
        oldest = state.oldest_wait()
        if not starts or oldest is None:
            return False
        return now - oldest < mean(starts)

    def _dormant_over(
        self, model: Model, live: list[ReplicaRecord], dormant: list[ReplicaRecord]
    ) -> None:
        """
        Stop the dormant replicas of C{model} that are of no use: all of
        them when its C{max_replicas} is 0, and those on GPUs where one of
        its replicas is awake or a more recently resident one sleeps.
        """
        taken = {(s.node, g) for r in live for s in r.shards for g in s.gpus}
        for replica in sorted(dormant, key=lambda r: -r.resident_since):
            places = {(s.node, g) for s in replica.shards for g in s.gpus}
            if model.max_replicas == 0 or places & taken:
                self._drain(replica, "asleep where it is not needed")
            taken |= places


WAKE_REFUSALS = 3
"""
Wakes of one sleeper refused in a row for C{gpus_in_use} after which the
next refusal stops it (another engine holds its GPUs for good).
"""


def held_plan(replica: ReplicaRecord) -> Plan:
    """
    @return: C{replica}'s shards as a placement L{Plan} (to count them
        taken in a snapshot).
    """
    shards = tuple(ShardPlan(s.node, s.gpus, s.port, s.rank) for s in replica.shards)
    return Plan(replica.profile, shards, replica.rendezvous_port)
