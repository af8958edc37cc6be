"""
Swaps (L{llmgw.control.plane}; docs/catalog.md, "Eviction"): a request
held for a model that fits nowhere has room made for it by evicting
replicas of other models (the policy is L{llmgw.control.eviction}).

One eviction per held model at a time (a L{Swap}): its victims are
unpublished at once and leave when their last request ends (bounded by
the router's C{total_timeout}), and the GPUs the held model's plan needs
are kept for it meanwhile: other models' placements see them allocated.
Once the victims are gone the held model is placed there once their GPUs
report the memory free (a release is the GPU's word, not llmgw's
reckoning): until then, for at most L{RELEASE_SECONDS}, the held model
waits rather than evict more; after that its swap ends with a warning
naming what the GPU still reports used, and the model goes on as one that
fits nowhere.  Held models
are served in the order their oldest requests came (the pass places them
first, oldest first).

A model whose held requests are all batch lines (L{batch_only}) has
nothing evicted for it, neither to be placed nor for a sleeper of it to
wake, and is never passed over for C{swap_max_wait}: it is started or
woken only where the fleet has free room, after every model holding a
client's request (L{llmgw.control.held_order}).

The layer above the replica actions (L{llmgw.control.actions}); bringing
a model up (L{llmgw.control.placing}) calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control import eviction
from llmgw.control.actions import ReplicaActions
from llmgw.control.catalog import Model
from llmgw.control.eviction import Candidate, Place
from llmgw.control.held_order import batch_only, held_order
from llmgw.control.inventory import Inventory
from llmgw.control.ledger import Ledger
from llmgw.control.placement import Fleet, NoFit, ShardPlan, shares
from llmgw.control.records import ReplicaRecord, ReplicaState, ShardRecord
from llmgw.control.runtime import ModelCatalog
from llmgw.control.scaling import ModelState
from llmgw.control.settings import ControlConfig
from llmgw.control.sleeping import SleepRoom
from llmgw.control.snapshot import Snapshot
from llmgw.router.interfaces import Standing

RELEASE_SECONDS = 60.0
"""
How long a held model waits, once its eviction's victims are gone, for
their GPUs to report the memory they held free: a few heartbeats (each
tells NVML's reading of the heartbeat before) and an engine's exit.
"""


@dataclass
class Swap:
    """
    An eviction under way for a held model.

    @ivar model: the held model.
    @ivar victims: the ids of the replicas evicted for it.
    @ivar room: per node, the GPU indices kept for it.
    @ivar freed_mib: per node and GPU index, the memory its victims held
        (free once their GPUs report it so).
    @ivar since: reactor seconds when the eviction began.
    @ivar words: what was evicted and why, for logs, the placement's
        explanation and a held request's standing.
    @ivar gone_at: reactor seconds when the last victim went, or L{None}.
    """

    model: str
    victims: tuple[str, ...]
    room: dict[str, set[int]]
    freed_mib: dict[str, dict[int, int]]
    since: float
    words: str
    gone_at: float | None = None
    asleep: set[str] = field(default_factory=set)


def _use(victim: Candidate, now: float) -> str:
    """
    @return: how C{victim} was in use, for the log and the explanation:
        C{"idle 12s"}, or C{"1 in flight, last request 3s ago"}.
    """
    since = now - victim.last_used
    if victim.in_flight:
        return f"{victim.in_flight} in flight, last request {since:.0f}s ago"
    return f"idle {since:.0f}s"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10)
    return f"{n}{suffix or 'th'}"


class Swaps:
    """
    Makes room for held models: the swap queue (docs/catalog.md,
    "Eviction").  The layer above the replica actions, which it calls to
    put its victims to sleep or drain them; it calls nothing above it.

    @param clock: the reactor's clock.
    @param settings: the C{[control]} table.
    @param inventory: the nodes.
    @param catalog: the catalog at run time.
    @param ledger: the records.
    @param ports: ports engines may listen on.
    @param actions: puts victims to sleep or drains them.
    @param room: whether a replica may sleep, and a sleeper wake.
    @param outstanding: clients' requests in flight to a replica id, by
        the router's count: a batch's lines make no replica busy, so that
        one serving only them goes for a held request as an idle one does
        (its lines end first).
    @ivar swaps: the evictions under way, by held model.
    @ivar evicted: per held model, the words of its last eviction and
        when (kept for the placement's explanation after it is placed).
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        settings: ControlConfig,
        inventory: Inventory,
        catalog: ModelCatalog,
        ledger: Ledger,
        ports: range,
        actions: ReplicaActions,
        room: SleepRoom,
        outstanding: Callable[[str], int],
    ) -> None:
        self._clock = clock
        self._settings = settings
        self._inventory = inventory
        self._catalog = catalog
        self._ledger = ledger
        self._ports = ports
        self._actions = actions
        self._room = room
        self._outstanding = outstanding
        self.swaps: dict[str, Swap] = {}
        self.evicted: dict[str, tuple[str, float]] = {}

    def fleet_for(self, name: str, snapshot: Snapshot) -> Fleet:
        """
        @return: the fleet as placement sees it for model C{name}: the
            room kept for another model's eviction allocated.  What its own
            eviction freed is free once the GPUs report it (their memory
            as reported, L{llmgw.control.placement.GpuView.free_mib}).
        """
        if not self.swaps:
            return snapshot.fleet
        others: dict[str, set[int]] = {}
        for swap in self.swaps.values():
            if swap.model != name:
                for node, gpus in swap.room.items():
                    others.setdefault(node, set()).update(gpus)
        return Fleet(eviction.reserved(snapshot.fleet.nodes(), others))

    def releasing(self, name: str, now: float, fleet: Fleet) -> bool:
        """
        Model C{name} fits nowhere in C{fleet}: whether its eviction's
        victims are gone but their GPUs have not reported the memory free
        yet, for less than L{RELEASE_SECONDS}; then it waits, rather than
        evict more.  Past that its swap ends, with a warning naming what
        the GPUs still report used.
        """
        swap = self.swaps.get(name)
        if swap is None or swap.gone_at is None:
            return False
        if now - swap.gone_at < RELEASE_SECONDS:
            return True
        reported = []
        for node_id, freed in sorted(swap.freed_mib.items()):
            view = fleet.get(node_id)
            for gpu in view.gpus:
                if gpu.index in freed:
                    reported.append(
                        f"GPU {gpu.index} of {node_id} reports"
                        f" {gpu.memory_used_mib} MiB used of {gpu.memory_total_mib}"
                    )
        self.log.warn(
            "model {model}: {seconds:g}s after its eviction's victims went"
            " ({words}), their GPUs do not report the memory free: {reported}",
            model=name,
            seconds=now - swap.gone_at,
            words=swap.words,
            reported="; ".join(reported) or "no report",
        )
        del self.swaps[name]
        return False

    def waits(self, name: str, now: float) -> bool:
        """
        @return: whether model C{name} waits for its eviction's victims
            to go (not yet gone or asleep); sets the swap's C{gone_at}
            once they are.
        """
        swap = self.swaps.get(name)
        if swap is None:
            return False
        if name not in self._catalog:
            del self.swaps[name]
            return False
        for replica_id in swap.victims:
            replica = self._ledger.replicas.get(replica_id)
            if replica is not None and not (
                replica_id in swap.asleep and replica.asleep
            ):
                return True
        if swap.gone_at is None:
            swap.gone_at = now
        return False

    def done(self, name: str, placed: bool) -> None:
        """
        Model C{name} was placed (C{placed}) or found no room even in
        what its eviction freed: its swap ends.
        """
        swap = self.swaps.pop(name, None)
        if swap is not None and not placed:
            self.log.warn(
                "model {model}: the room its eviction freed ({words}) does not"
                " fit it now",
                model=name,
                words=swap.words,
            )

    def evict_for(
        self,
        state: ModelState,
        now: float,
        snapshot: Snapshot,
        spread: frozenset[str],
        no_fit: NoFit,
    ) -> bool:
        """
        C{state}'s model has requests held and fits nowhere: evict what
        makes room for it, if anything does (L{eviction}).

        @return: whether an eviction began.
        """
        name = state.model.name
        if not self._settings.evict or not state.waiters or name in self.swaps:
            return False
        if batch_only(state.top_rank()):
            # Batch lines wait for room the fleet has free.
            return False
        candidates, spare = self._candidates(name, now)
        ordered = eviction.eligible(
            candidates,
            now,
            spare,
            self._busy_too(state, now),
            in_use=self._settings.swap_in_use,
        )
        fleet = self.fleet_for(name, snapshot)
        chosen = eviction.choose(
            state.model.profiles, fleet.nodes(), self._ports, ordered, spread
        )
        if chosen is None and any(c.sleeps for c in ordered):
            # What they would keep asleep leaves no room: stopped, they may.
            stopping = [
                replace(c, sleeps=False, kept_gpu_memory_gb=0.0) for c in ordered
            ]
            chosen = eviction.choose(
                state.model.profiles, fleet.nodes(), self._ports, stopping, spread
            )
        if chosen is None:
            return False
        why = f"{name} fits nowhere ({'; '.join(no_fit.lines()[:2])})"
        self._begin_swap(name, now, chosen.victims, chosen.plan.shards, why)
        return True

    def evict_for_wake(
        self,
        state: ModelState,
        now: float,
        snapshot: Snapshot,
        sleeper: ReplicaRecord,
        idle_only: bool = False,
    ) -> bool:
        """
        C{state}'s model has requests held and C{sleeper}, one of its
        replicas asleep, has no room to wake where it sleeps: evict what
        makes that room, if anything does (L{eviction.choose_in_place}).
        With C{idle_only} (a free place elsewhere), only idle replicas are
        evicted.  When what holds the room may go only later (it has
        requests in flight, or has been resident less than its
        C{min_resident}), and the oldest held request has waited less than
        the model's mean cold start, nothing is evicted and the model
        waits for it: a wake soon beats a cold start, here or elsewhere.

        @return: whether the model waits for an eviction, or for its
            sleeper's room.
        """
        name = state.model.name
        if name in self.swaps or batch_only(state.top_rank()):
            return False
        busy_too = self._busy_too(state, now) and not idle_only
        victims = self._wake_victims(state, now, snapshot, sleeper, busy_too)
        if victims is not None:
            why = f"replica {sleeper.id} of {name} sleeps where they run"
            self._begin_swap(name, now, victims, sleeper.shards, why)
            return True
        if busy_too:
            return False
        starts = self._ledger.counts.cold_start_seconds.get(name)
        oldest = state.oldest_wait()
        if not starts or oldest is None or now - oldest >= sum(starts) / len(starts):
            return False
        soon = self._wake_victims(state, now, snapshot, sleeper, True, True)
        return soon is not None

    def _wake_victims(
        self,
        state: ModelState,
        now: float,
        snapshot: Snapshot,
        sleeper: ReplicaRecord,
        busy_too: bool,
        young_too: bool = False,
    ) -> tuple[Candidate, ...] | None:
        """
        @return: what to evict so that C{sleeper} may wake where it
            sleeps, busy replicas too when C{busy_too}, those resident
            less than their C{min_resident} too when C{young_too}; L{None}
            if nothing makes the room.
        """
        candidates, spare = self._candidates(state.model.name, now, young_too)
        ordered = eviction.eligible(
            candidates,
            now,
            spare,
            busy_too,
            young_too,
            self._settings.swap_in_use,
        )
        where = {s.node: s.gpus for s in sleeper.shards}
        fleet = self.fleet_for(state.model.name, snapshot)
        return eviction.choose_in_place(
            fleet.nodes(),
            ordered,
            where,
            lambda freed: self._room.wake_room(sleeper, freed) is None,
        )

    def _busy_too(self, state: ModelState, now: float) -> bool:
        """
        @return: whether replicas with requests in flight may be evicted
            for C{state}'s model: its oldest held request was passed over
            for C{swap_max_wait} (never for batch lines alone).
        """
        oldest = state.oldest_wait()
        return (
            self._settings.swap_max_wait > 0
            and not batch_only(state.top_rank())
            and oldest is not None
            and now - oldest >= self._settings.swap_max_wait
        )

    def _begin_swap(
        self,
        name: str,
        now: float,
        victims: Sequence[Candidate],
        room_shards: Iterable[ShardPlan | ShardRecord],
        why: str,
    ) -> None:
        """
        Evict C{victims} for model C{name}, the GPUs of C{room_shards} kept
        for it meanwhile: the victims that may sleep are put to sleep, the
        others drained.
        """
        words = (
            "evicting "
            + ", ".join(f"{v.model} ({_use(v, now)})" for v in victims)
            + " to make room"
        )
        room: dict[str, set[int]] = {}
        for shard in room_shards:
            room.setdefault(shard.node, set()).update(shard.gpus)
        freed: dict[str, dict[int, int]] = {}
        for victim in victims:
            for held in victim.places:
                on = freed.setdefault(held.node, {})
                for index in held.gpus:
                    on[index] = on.get(index, 0) + victim.freed_mib
        swap = Swap(name, tuple(v.replica for v in victims), room, freed, now, words)
        self.swaps[name] = swap
        self.evicted[name] = (words, now)
        for victim in victims:
            replica = self._ledger.replicas[victim.replica]
            owner = self._catalog.get(victim.model)
            if owner is not None:
                # Its model is not to come back until it is asked for.
                low, high = owner.model.min_replicas, owner.model.max_replicas
                owner.wanted = max(low, min(owner.wanted, high) - 1)
            self.log.info(
                "evicting replica {replica} of {victim} ({use}, priority"
                " {priority}) for {model}: {why}",
                replica=replica.id,
                victim=victim.model,
                use=_use(victim, now),
                priority=victim.priority,
                model=name,
                why=why,
            )
            if victim.asleep:
                # Stopped for what its engine keeps: not a swap.
                self._actions.drain(replica, f"stopped asleep to make room for {name}")
            elif self._swap_out(replica, name, victim.sleeps):
                swap.asleep.add(replica.id)

    def _swap_out(self, replica: ReplicaRecord, model: str, sleeps: bool) -> bool:
        """
        Evict C{replica} to make room for C{model}: it takes no new
        requests and, once its last one ends, sleeps (C{sleeps}, and it
        still may) or stops.

        @return: whether it sleeps.
        """
        why = f"evicted to make room for {model}"
        if sleeps and self._actions.retire(replica, why, "slept"):
            return True
        self._ledger.counts.swapped(replica.model, "evicted")
        if replica.draining_since is None:
            self._actions.drain(replica, why, self._actions.leave_timeout)
        return False

    def _candidates(
        self, holder: str, now: float, coming: bool = False
    ) -> tuple[list[Candidate], dict[str, int]]:
        """
        @param coming: count replicas starting or waking too, as resident
            from now (to ask what may go soon, not now).
        @return: the ready replicas of models other than C{holder}, not
            leaving, as eviction candidates; and per model how many may go
            (its ready replicas over its C{min_replicas}).
        """
        candidates = []
        spare = {}
        host = self._room.sleeping_host()
        states = (
            (ReplicaState.READY, ReplicaState.STARTING, ReplicaState.WAKING)
            if coming
            else (ReplicaState.READY,)
        )
        for name, replicas in self._ledger.by_model():
            state = self._catalog.get(name)
            if name == holder or state is None:
                continue
            model = state.model
            replicas = list(replicas)
            ready = [
                r
                for r in replicas
                if r.state in states
                and r.leaving_since is None
                and r.draining_since is None
            ]
            spare[name] = len(ready) - model.min_replicas
            for replica in replicas:
                if replica.asleep and replica.draining_since is None:
                    candidates.append(_asleep(replica, model, state.last_used))
            for replica in ready:
                sleeps = self._room.why_not_sleep(replica, host) is None
                candidates.append(
                    Candidate(
                        replica=replica.id,
                        model=name,
                        priority=model.priority,
                        pinned=model.pinned,
                        min_resident=model.min_resident,
                        last_used=state.last_used,
                        resident_since=(
                            replica.resident_since or replica.created
                            if replica.state == ReplicaState.READY
                            else now
                        ),
                        in_flight=self._outstanding(replica.id),
                        places=tuple(
                            Place(s.node, s.gpus, s.port) for s in replica.shards
                        ),
                        gpu_memory_gb=replica.profile.gpu_memory_gb,
                        kept_gpu_memory_gb=(
                            replica.profile.sleep_gpu_memory_gb if sleeps else 0.0
                        ),
                        sleeps=sleeps,
                        shares=shares(replica.profile),
                    )
                )
        return candidates, spare

    def order_key(self, name: str) -> tuple[int, int, int, float]:
        """
        @return: a sort key for a pass's models (L{held_order}): those with
            requests held first, those passed over for C{swap_max_wait}
            first among them, then the highest priority held, then the
            oldest held.
        """
        state = self._catalog.get(name)
        if state is None:
            return held_order(None)
        now = self._clock.seconds()
        return held_order(
            state.oldest_wait(), state.top_rank(), self._busy_too(state, now)
        )

    def standing(self, name: str) -> Standing:
        """
        @return: where a request held for model C{name} stands (see
            L{ModelCatalog.where}).
        """
        state = self._catalog.get(name)
        if state is None:
            return Standing("")
        starts = self._ledger.counts.cold_start_seconds.get(name)
        eta = sum(starts) / len(starts) if starts else None
        swap = self.swaps.get(name)
        if swap is not None:
            return Standing(swap.words, eta)
        for replica in self._ledger.of_model(name):
            if replica.state == ReplicaState.WAKING:
                wakes = self._ledger.counts.wake_seconds.get(name)
                return Standing(
                    f"waking replica {replica.id}",
                    sum(wakes) / len(wakes) if wakes else None,
                )
            if replica.state == ReplicaState.STARTING:
                return Standing(f"starting replica {replica.id}", eta)
        if state.no_fit is not None and state.waiters:
            ahead = [
                s.model.name
                for s in self._catalog.states()
                if s is not state
                and s.waiters
                and s.no_fit is not None
                and self.order_key(s.model.name) < self.order_key(name)
            ]
            if ahead:
                return Standing(
                    f"{_ordinal(len(ahead) + 1)} in the swap queue, behind"
                    f" {', '.join(ahead)}"
                )
            return Standing("waiting for room: what holds it is busy or pinned")
        return Standing("")


def _asleep(replica: ReplicaRecord, model: Model, last_used: float) -> Candidate:
    """
    @return: C{replica}, asleep, as an eviction candidate: stopping it
        frees what its engine keeps on its GPUs, and its port.
    """
    return Candidate(
        replica=replica.id,
        model=replica.model,
        priority=model.priority,
        pinned=model.pinned,
        min_resident=0.0,
        last_used=last_used,
        resident_since=replica.resident_since or replica.created,
        in_flight=0,
        places=tuple(Place(s.node, s.gpus, s.port) for s in replica.shards),
        gpu_memory_gb=replica.profile.sleep_gpu_memory_gb,
        asleep=True,
        shares=shares(replica.profile),
    )
