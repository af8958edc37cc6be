"""
Eviction policy as pure functions (docs/catalog.md, "Eviction"): which
replicas of other models make room for a request held for a model that
fits nowhere.  No clock and no I/O: the reconciler (L{llmgw.control.swaps})
passes the time and the candidates, and acts on the answer.

A candidate is a replica of another model that is ready and not leaving.
It may be evicted when its model is not C{pinned}, it has been resident
(started or woken) at least its model's C{min_resident}, it has no request
in flight (unless the held request was passed over for C{[control]
swap_max_wait}: then busy ones may go too, after the idle ones), and its
model keeps its C{min_replicas} without it.  Candidates are taken lower
C{priority} first, then least recently used, then the longest resident;
the victims are the shortest run of them, in that order, whose room lets
placement fit the held model, less those whose room the placement does
not use and those it fits without (on a GPU several replicas share, a
newcomer needs only some of them gone: the memory it needs, not the
whole GPU).  When even every candidate does not make room, there are none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from llmgw.control.placement import Fleet, NodeView, Plan, Profile, place


@dataclass(frozen=True)
class Place:
    """
    What one shard of a replica holds on its node.

    @ivar gpus: GPU indices.
    @ivar port: its engine's port.
    """

    node: str
    gpus: tuple[int, ...]
    port: int


@dataclass(frozen=True)
class Candidate:
    """
    A replica that might be evicted.

    @ivar replica: its id.
    @ivar model: its model's name.
    @ivar priority: its model's C{priority} (lower goes first).
    @ivar pinned: its model's C{pinned}.
    @ivar min_resident: its model's C{min_resident}, seconds.
    @ivar last_used: reactor seconds of its model's last use.
    @ivar resident_since: reactor seconds when it was started or woken.
    @ivar in_flight: requests in flight to it.
    @ivar places: what each of its shards holds.
    @ivar gpu_memory_gb: GB it holds on each of its GPUs awake.
    @ivar kept_gpu_memory_gb: GB it keeps on each GPU once evicted: what a
        sleeping engine keeps when it would sleep, 0 when it would stop.
    @ivar sleeps: whether it would sleep rather than stop.
    @ivar asleep: it sleeps already: evicting it stops it, freeing what
        its engine keeps (its C{gpu_memory_gb}) and its port, not its
        GPUs' allocation (it holds none); taken first, whatever its
        model's C{min_replicas}, C{min_resident} or use.
    @ivar shares: it shares its GPU (L{llmgw.control.placement.shares}):
        evicting it frees its memory there, not the GPU whole.
    """

    replica: str
    model: str
    priority: int
    pinned: bool
    min_resident: float
    last_used: float
    resident_since: float
    in_flight: int
    places: tuple[Place, ...]
    gpu_memory_gb: float
    kept_gpu_memory_gb: float = 0.0
    sleeps: bool = False
    asleep: bool = False
    shares: bool = False

    @property
    def freed_mib(self) -> int:
        """
        @return: MiB its eviction frees on each of its GPUs.
        """
        return max(0, int((self.gpu_memory_gb - self.kept_gpu_memory_gb) * 1024))


@dataclass(frozen=True)
class Eviction:
    """
    What to evict, and where the held model then goes.

    @ivar victims: the replicas to evict, in the order taken.
    @ivar plan: the held model's placement once they are gone.
    """

    victims: tuple[Candidate, ...]
    plan: Plan


def eligible(
    candidates: Iterable[Candidate],
    now: float,
    spare: Mapping[str, int],
    busy_too: bool = False,
    young_too: bool = False,
    in_use: float = 0.0,
) -> list[Candidate]:
    """
    @param now: reactor seconds.
    @param spare: per model, how many of its replicas may go without it
        going below its C{min_replicas} (missing: none).
    @param busy_too: whether replicas with requests in flight may go
        (the held request was passed over for C{swap_max_wait}).
    @param young_too: whether replicas resident less than their model's
        C{min_resident} count too (to ask what may go soon, not now).
    @param in_use: seconds: a replica whose model was used this recently
        counts as busy, as one with requests in flight does (C{[control]
        swap_in_use}).
    @return: the candidates that may be evicted, in the order they are
        taken: those asleep first, the idle before the busy, lower
        C{priority} first, least recently used first, the longest
        resident first.
    """

    def busy(c: Candidate) -> bool:
        return c.in_flight > 0 or now - c.last_used < in_use

    ordered = sorted(
        (
            c
            for c in candidates
            if not c.pinned
            and (
                c.asleep
                or (young_too or now - c.resident_since >= c.min_resident)
                and (busy_too or not busy(c))
            )
        ),
        key=lambda c: (
            not c.asleep,
            busy(c),
            c.priority,
            c.last_used,
            c.resident_since,
            c.replica,
        ),
    )
    taken: dict[str, int] = {}
    result = []
    for candidate in ordered:
        count = taken.get(candidate.model, 0)
        if candidate.asleep:
            result.append(candidate)
        elif count < spare.get(candidate.model, 0):
            taken[candidate.model] = count + 1
            result.append(candidate)
    return result


def freed(
    nodes: Iterable[NodeView],
    victims: Iterable[Candidate],
) -> list[NodeView]:
    """
    @return: C{nodes} as placement would see them with C{victims} gone:
        their GPUs not allocated, the memory they hold less what they keep
        (asleep) taken off the memory used, the ports of those that stop
        free.
    """
    gpus: dict[str, dict[int, int]] = {}
    ports: dict[str, set[int]] = {}
    allocated: dict[str, set[int]] = {}
    sharers: dict[str, dict[int, int]] = {}
    for victim in victims:
        for held in victim.places:
            on = gpus.setdefault(held.node, {})
            left = sharers.setdefault(held.node, {})
            for index in held.gpus:
                on[index] = on.get(index, 0) + victim.freed_mib
                if victim.shares and not victim.asleep:
                    left[index] = left.get(index, 0) + 1
            if not victim.asleep and not victim.shares:
                allocated.setdefault(held.node, set()).update(held.gpus)
            if not victim.sleeps:
                ports.setdefault(held.node, set()).add(held.port)
    return [
        _freed(
            node,
            gpus.get(node.id),
            ports.get(node.id),
            allocated.get(node.id),
            sharers.get(node.id),
        )
        for node in nodes
    ]


def _freed(
    node: NodeView,
    gpus: dict[int, int] | None,
    ports: set[int] | None,
    allocated: set[int] | None,
    sharers: dict[int, int] | None,
) -> NodeView:
    if not gpus and not ports:
        return node
    gpus = gpus or {}
    allocated = allocated or set()
    sharers = sharers or {}
    return replace(
        node,
        gpus=tuple(
            replace(
                g,
                allocated=g.allocated and g.index not in allocated,
                memory_used_mib=max(0, g.memory_used_mib - gpus[g.index]),
                claimed_mib=max(0, g.claimed_mib - gpus[g.index]),
                sharers=max(0, g.sharers - sharers.get(g.index, 0)),
            )
            if g.index in gpus
            else g
            for g in node.gpus
        ),
        ports_in_use=node.ports_in_use - (ports or set()),
    )


def choose(
    profiles: Sequence[Profile],
    nodes: Sequence[NodeView],
    ports: range,
    candidates: Sequence[Candidate],
    spread: frozenset[str] = frozenset(),
) -> Eviction | None:
    """
    @param profiles: the held model's profiles.
    @param nodes: the fleet as placement sees it now.
    @param ports: C{[control] port_range}.
    @param candidates: those that may go, in order (L{eligible}).
    @param spread: nodes already running a replica of the held model.
    @return: the shortest run of C{candidates}, in order, whose room
        lets the held model be placed, less those whose room its plan
        does not use; L{None} when even all of them do not make room.
    """
    nodes = list(nodes)
    for count in range(1, len(candidates) + 1):
        run = candidates[:count]
        result = place(profiles, Fleet(freed(nodes, run)), ports, spread)
        if not isinstance(result, Plan):
            continue
        needed = tuple(v for v in run if _used_by(result, v))
        if len(needed) < len(run):
            fewer = place(profiles, Fleet(freed(nodes, needed)), ports, spread)
            if isinstance(fewer, Plan):
                run, result = list(needed), fewer
        run = _pruned(
            run,
            lambda kept: isinstance(
                place(profiles, Fleet(freed(nodes, kept)), ports, spread), Plan
            ),
        )
        result = place(profiles, Fleet(freed(nodes, run)), ports, spread)
        assert isinstance(result, Plan)
        return Eviction(tuple(run), result)
    return None


def _pruned(
    run: Sequence[Candidate], fits: Callable[[list[Candidate]], bool]
) -> list[Candidate]:
    """
    @return: C{run} less the replicas it fits without, the last taken
        tried first (evicting them would free memory nothing needs: on a
        shared GPU, the newcomer may need only some of its replicas gone).
    """
    kept = list(run)
    for victim in sorted(run, key=lambda v: (not v.asleep, -run.index(v))):
        fewer = [v for v in kept if v is not victim]
        if fits(fewer):
            kept = fewer
    return kept


def choose_in_place(
    nodes: Sequence[NodeView],
    candidates: Sequence[Candidate],
    where: Mapping[str, tuple[int, ...]],
    fits: Callable[[Fleet], bool],
) -> tuple[Candidate, ...] | None:
    """
    Choose what to evict so that a sleeping replica may wake where it
    sleeps.

    @param nodes: the fleet as placement sees it now.
    @param candidates: those that may go, in order (L{eligible}).
    @param where: per node, the GPU indices the sleeping replica holds.
    @param fits: whether it may wake in a fleet.
    @return: the shortest run of those C{candidates} holding one of
        C{where}'s GPUs, in order, whose room lets it wake; L{None} when
        even all of them do not.
    """
    nodes = list(nodes)
    there = [
        c
        for c in candidates
        if any(set(p.gpus) & set(where.get(p.node, ())) for p in c.places)
    ]
    for count in range(1, len(there) + 1):
        run = there[:count]
        if fits(Fleet(freed(nodes, run))):
            return tuple(_pruned(run, lambda kept: fits(Fleet(freed(nodes, kept)))))
    return None


def _used_by(plan: Plan, victim: Candidate) -> bool:
    """
    @return: whether C{plan} uses a GPU or a port C{victim} holds.
    """
    for shard in plan.shards:
        for held in victim.places:
            if held.node != shard.node:
                continue
            if set(held.gpus) & set(shard.gpus) or held.port == shard.port:
                return True
    return False


def reserved(nodes: Iterable[NodeView], room: Mapping[str, set[int]]) -> list[NodeView]:
    """
    @param room: per node, GPU indices kept for another model's eviction.
    @return: C{nodes} with those GPUs counted as allocated.
    """
    return [
        replace(
            node,
            gpus=tuple(
                replace(g, allocated=True) if g.index in room[node.id] else g
                for g in node.gpus
            ),
        )
        if node.id in room
        else node
        for node in nodes
    ]
