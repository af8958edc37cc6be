"""
Placement: where a replica of a model can run, as pure functions over a
snapshot of the inventory (L{llmgw.control.snapshot}).  No I/O and no clock: the
reconciler takes a snapshot, asks, and acts on the answer.

Profiles are tried in priority order (highest first, then as listed).  A
profile asks for C{gpus} GPUs on each of C{nodes} nodes (C{gpus = 0} runs
on the CPU), each GPU with C{gpu_memory_gb} free, none reporting problems
and none allocated to another shard.  A profile of one GPU that says
C{share_gpu} (L{shares}) takes no GPU whole: it goes on a GPU no whole-GPU
shard holds where its C{gpu_memory_gb} fits beside the replicas already
there (the tightest such GPU first), and a whole-GPU profile never goes
on a GPU a sharing replica holds.  A GPU's free memory is its total less
the most of what it reports used, what processes llmgw does not manage
hold, and what llmgw's own engines on it are counted to hold
(C{claimed_mib}): memory a sleep, a stop or an eviction frees counts as
free only once the GPU reports it free.  Among the nodes that fit, the best
fit wins, the one left with the fewest free GPUs, so large free blocks
stay whole for the profiles that need them (free: not allocated and
without problems).  A profile of several nodes is
a gang on nodes sharing its C{fabric}.  When nothing fits, every node's
reason is given.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Profile:
    """
    One way to run a model.

    @ivar gpus: GPUs per shard (per node); 0 for the CPU.
    @ivar gpu_memory_gb: free memory needed on each of those GPUs, GB
        (1024 MiB).
    @ivar nodes: shards per replica; more than 1 is a multi-node gang.
    @ivar fabric: the interconnect the gang's nodes must share.
    @ivar priority: higher is tried first.
    @ivar sleep: C{"off"}, C{"weights"} or C{"discard"}: whether an idle
        replica sleeps rather than stops, and at which level
        (L{llmgw.wire.engines.SLEEP_LEVELS}).
    @ivar sleep_gpu_memory_gb: GB a sleeping engine keeps on each of its
        GPUs.
    @ivar sleep_host_memory_gb: GB of host memory a sleeping replica
        holds on each of its nodes.
    """

    name: str
    engine: str
    source: str
    gpus: int = 0
    gpu_memory_gb: float = 0.0
    nodes: int = 1
    fabric: str | None = None
    priority: int = 0
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    sleep: str = "off"
    sleep_gpu_memory_gb: float = 1.0
    sleep_host_memory_gb: float = 0.0
    share_gpu: bool = False


def shares(profile: Profile) -> bool:
    """
    @return: whether C{profile}'s replicas share their GPU with others
        where their memory fits: it says C{share_gpu}, runs on one GPU of
        one node and declares its C{gpu_memory_gb}.  Tensor-parallel and
        gang profiles always take whole GPUs.
    """
    return (
        profile.share_gpu
        and profile.gpus == 1
        and profile.nodes == 1
        and profile.gpu_memory_gb > 0
    )


@dataclass(frozen=True)
class GpuView:
    """
    A GPU as placement sees it.  Memory in MiB.

    @ivar memory_used_mib: what the GPU last reported used (NVML, or the
        sim's report).
    @ivar foreign_used_mib: held by processes llmgw does not manage: never
        free, whatever llmgw's own engines release.
    @ivar allocated: a whole-GPU shard holds it.
    @ivar claimed_mib: what llmgw's engines on it are counted to hold: the
        C{gpu_memory_gb} of those awake, starting, waking, going to sleep
        or stopping, the C{sleep_gpu_memory_gb} of those asleep.
    @ivar sharers: the replicas of sharing profiles (L{shares}) on it.
    """

    index: int
    name: str
    memory_total_mib: int
    memory_used_mib: int = 0
    problems: tuple[str, ...] = ()
    allocated: bool = False
    foreign_used_mib: int = 0
    claimed_mib: int = 0
    sharers: int = 0

    @property
    def free_mib(self) -> int:
        """
        MiB free for a new engine: the total less the most of what the GPU
        reports used, what others hold and what llmgw counts its engines
        to hold (a report older than a start, or a release not yet
        reported, never makes room).
        """
        used = max(self.memory_used_mib, self.foreign_used_mib, self.claimed_mib)
        return self.memory_total_mib - used


@dataclass(frozen=True)
class NodeView:
    """
    A node as placement sees it.

    @ivar ports_in_use: ports of shards placed on it.
    @ivar address: where its engines listen; nodes of one address share
        its ports (C{""}: its own).
    """

    id: str
    state: str
    fabrics: frozenset[str] = frozenset()
    gpus: tuple[GpuView, ...] = ()
    ports_in_use: frozenset[int] = frozenset()
    address: str = ""


@dataclass(frozen=True)
class ShardPlan:
    """
    Where one shard goes: node, GPU indices, port, rank (0 leads).

    @ivar share: for a sharing profile (L{shares}), the fraction of its
        GPU's total memory the engine is given; 0 for whole GPUs.
    """

    node: str
    gpus: tuple[int, ...]
    port: int
    rank: int
    share: float = 0.0


@dataclass(frozen=True)
class Plan:
    """
    A replica placed: the profile chosen and its shards, leader first.

    @ivar rendezvous_port: for a gang, a further port on the leader's
        address where its ranks meet; 0 for one node.
    """

    profile: Profile
    shards: tuple[ShardPlan, ...]
    rendezvous_port: int = 0


@dataclass(frozen=True)
class NoFit:
    """
    Nothing fits: per profile tried, one reason per node.

    @ivar reasons: C{(profile name, ("node: why", ...))}, in the order tried.
    """

    reasons: tuple[tuple[str, tuple[str, ...]], ...] = field(default=())

    def lines(self) -> list[str]:
        """
        @return: the explanation, one line per profile and node, such as
            C{"profile a100x2: gpu-03: needs 2 GPUs, 1 usable: 1 allocated"}.
        """
        out = []
        for profile, reasons in self.reasons:
            if not reasons:
                out.append(f"profile {profile}: no nodes")
            out.extend(f"profile {profile}: {reason}" for reason in reasons)
        return out


def _fitting_gpus(node: NodeView, profile: Profile) -> tuple[list[GpuView], str]:
    """
    @return: the node's GPUs this profile could use, tightest fit first,
        and why others cannot be used (empty when nothing is missing).
    """
    need_mib = int(profile.gpu_memory_gb * 1024)
    sharing = shares(profile)
    usable: list[GpuView] = []
    allocated = troubled = small = 0
    others: list[str] = []
    for gpu in node.gpus:
        if gpu.allocated or (gpu.sharers and not sharing):
            allocated += 1
        elif gpu.problems:
            troubled += 1
        elif gpu.free_mib < need_mib:
            small += 1
            if gpu.foreign_used_mib:
                others.append(f"GPU {gpu.index} {gpu.foreign_used_mib / 1024:.1f} GB")
        else:
            usable.append(gpu)
    usable.sort(key=lambda g: (g.free_mib, g.index))
    if len(usable) >= profile.gpus:
        return usable, ""
    if len(node.gpus) < profile.gpus:
        return usable, f"has {len(node.gpus)} GPUs, needs {profile.gpus}"
    if all(g.memory_total_mib < need_mib for g in node.gpus):
        # Whatever is freed, it will never fit here.
        return usable, f"no GPU has {profile.gpu_memory_gb:g} GB"
    why = []
    if allocated:
        why.append(f"{allocated} allocated")
    if troubled:
        why.append(f"{troubled} with problems")
    if small:
        why.append(f"{small} with under {profile.gpu_memory_gb:g} GB free")
    if others:
        why[-1] += f" ({', '.join(others)} used by processes llmgw does not manage)"
    return usable, (
        f"needs {profile.gpus} GPUs, {len(usable)} usable: " + ", ".join(why)
    )


def _free_port(node: NodeView, ports: range) -> int | None:
    for port in ports:
        if port not in node.ports_in_use:
            return port
    return None


def _node_fit(
    node: NodeView, profile: Profile, ports: range
) -> tuple[list[GpuView], int, str]:
    """
    @return: usable GPUs, a free port, and the reason it does not fit
        (empty when it does).
    """
    if node.state != "ready":
        return [], 0, f"{node.id}: {node.state}"
    if profile.nodes > 1 and profile.fabric and profile.fabric not in node.fabrics:
        return [], 0, f"{node.id}: not on fabric {profile.fabric}"
    usable, why = _fitting_gpus(node, profile)
    if why:
        return [], 0, f"{node.id}: {why}"
    port = _free_port(node, ports)
    if port is None:
        return [], 0, f"{node.id}: no free port in {ports.start}-{ports.stop - 1}"
    return usable, port, ""


class Fleet:
    """
    An inventory snapshot indexed for placement: ready nodes by how many
    free GPUs they have, so that best fit for one node looks at the
    tightest nodes first instead of every node.

    @param nodes: the snapshot.
    """

    def __init__(self, nodes: Iterable[NodeView]) -> None:
        self._nodes: dict[str, NodeView] = {}
        self._free: dict[str, int] = {}
        self._buckets: dict[int, list[str]] = {}
        for node in nodes:
            self._add(node)

    def _add(self, node: NodeView) -> None:
        self._nodes[node.id] = node
        if node.state == "ready":
            free = sum(1 for g in node.gpus if not g.allocated and not g.problems)
            self._free[node.id] = free
            insort(self._buckets.setdefault(free, []), node.id)

    def replace(self, node: NodeView) -> None:
        """
        Put C{node} in place of the view of the same id.
        """
        free = self._free.pop(node.id, None)
        if free is not None:
            bucket = self._buckets[free]
            del bucket[bisect_left(bucket, node.id)]
        self._add(node)

    def get(self, node_id: str) -> NodeView:
        """
        @raise KeyError: no such node.
        """
        return self._nodes[node_id]

    def nodes(self) -> list[NodeView]:
        """
        @return: every node, by id.
        """
        return [self._nodes[k] for k in sorted(self._nodes)]

    def tightest(self, gpus: int) -> Iterator[NodeView]:
        """
        @return: ready nodes with at least C{gpus} free GPUs, those with
            the fewest first, then by id.
        """
        for free in sorted(k for k in self._buckets if k >= gpus):
            for node_id in self._buckets[free]:
                yield self._nodes[node_id]


def _share(profile: Profile, gpus: Sequence[GpuView]) -> float:
    """
    @return: the fraction of the smallest of C{gpus}' memory a sharing
        profile's engine is given; 0 for whole GPUs.
    """
    if not shares(profile) or not gpus:
        return 0.0
    total = min(g.memory_total_mib for g in gpus)
    return min(1.0, profile.gpu_memory_gb * 1024 / total) if total else 0.0


def _plan(profile: Profile, chosen: Sequence[tuple[str, list[GpuView], int]]) -> Plan:
    return Plan(
        profile,
        tuple(
            ShardPlan(
                node=node_id,
                gpus=tuple(sorted(g.index for g in usable[: profile.gpus])),
                port=port,
                rank=rank,
                share=_share(profile, usable[: profile.gpus]),
            )
            for rank, (node_id, usable, port) in enumerate(chosen)
        ),
    )


def _gang(
    profile: Profile,
    fleet: Fleet,
    ports: range,
    chosen: Sequence[tuple[str, list[GpuView], int]],
) -> Plan | None:
    """
    A gang's ports: distinct for its shards on one address (two agents
    may share one), and one more on the leader's for the rendezvous.

    @return: the plan, or L{None} when the ports run out.
    """
    taken: dict[str, set[int]] = {}

    def port_on(node: NodeView) -> int | None:
        held = taken.setdefault(node.address or node.id, set())
        for port in ports:
            if port not in node.ports_in_use and port not in held:
                held.add(port)
                return port
        return None

    ranked = []
    for node_id, usable, _ in chosen:
        port = port_on(fleet.get(node_id))
        if port is None:
            return None
        ranked.append((node_id, usable, port))
    rendezvous = port_on(fleet.get(chosen[0][0]))
    if rendezvous is None:
        return None
    return replace(_plan(profile, ranked), rendezvous_port=rendezvous)


def _place_one_node(
    profile: Profile, fleet: Fleet, ports: range, spread: frozenset[str]
) -> Plan | None:
    """
    Best fit for a single-node profile, from the tightest nodes up; a node
    in C{spread} only when no other fits.
    """
    fallback: tuple[str, list[GpuView], int] | None = None
    for node in fleet.tightest(profile.gpus):
        usable, port, reason = _node_fit(node, profile, ports)
        if reason:
            continue
        if node.id in spread:
            if fallback is None:
                fallback = (node.id, usable, port)
            continue
        return _plan(profile, [(node.id, usable, port)])
    if fallback is not None:
        return _plan(profile, [fallback])
    return None


def place(
    profiles: Sequence[Profile],
    nodes: Sequence[NodeView] | Fleet,
    ports: range,
    spread: frozenset[str] = frozenset(),
) -> Plan | NoFit:
    """
    Place one replica.

    @param profiles: the model's profiles, in catalog order.
    @param nodes: the inventory snapshot, or a L{Fleet} of it (faster when
        placing several replicas on one snapshot).
    @param ports: the port range engines may listen on (C{[control]
        port_range}).
    @param spread: nodes that already run a replica of the model: used
        only when no other node fits, so that replicas of a model land on
        different nodes (one node lost takes one replica, not all).
    @return: a L{Plan} for the first profile, by priority, that fits, or
        a L{NoFit} explaining, per profile and node, why none does.
    """
    fleet = nodes if isinstance(nodes, Fleet) else Fleet(nodes)
    ordered = [
        p
        for _, p in sorted(
            enumerate(profiles), key=lambda item: (-item[1].priority, item[0])
        )
    ]
    for profile in ordered:
        if profile.nodes == 1:
            plan = _place_one_node(profile, fleet, ports, spread)
        else:
            plan, _ = _scan(profile, fleet, ports, spread)
        if plan is not None:
            return plan
    # Nothing fits: only now is every node looked at for every profile.
    return NoFit(tuple((p.name, _scan(p, fleet, ports, spread)[1]) for p in ordered))


def _scan(
    profile: Profile, fleet: Fleet, ports: range, spread: frozenset[str]
) -> tuple[Plan | None, tuple[str, ...]]:
    """
    Look at every node: for a gang, or to explain why nothing fits.

    @return: a plan if C{profile} fits, else why not, per node.
    """
    fits: list[tuple[int, str, list[GpuView], int]] = []
    why: list[str] = []
    for node in fleet.nodes():
        usable, port, reason = _node_fit(node, profile, ports)
        if reason:
            why.append(reason)
        else:
            # Best fit: the node left with the fewest free GPUs.
            fits.append((len(usable) - profile.gpus, node.id, usable, port))
    fits.sort(key=lambda f: (f[1] in spread, f[0], f[1]))
    if len(fits) >= profile.nodes:
        chosen = [(node_id, usable, port) for _, node_id, usable, port in fits]
        if profile.nodes == 1:
            return _plan(profile, chosen[:1]), ()
        gang = _gang(profile, fleet, ports, chosen[: profile.nodes])
        if gang is not None:
            return gang, ()
        why.append(
            f"no {profile.nodes + 1} free ports in {ports.start}-{ports.stop - 1}"
        )
        return None, tuple(why)
    if profile.nodes > 1 and fits:
        why.append(
            f"only {len(fits)} of {profile.nodes} nodes fit"
            + (f" on fabric {profile.fabric}" if profile.fabric else "")
        )
    fragmented = _fragmentation(profile, fleet)
    if fragmented:
        why.append(fragmented)
    return None, tuple(why)


def _fragmentation(profile: Profile, fleet: Fleet) -> str:
    """
    @return: a line saying that enough usable GPUs are free in total over
        the ready nodes, only not enough of them on one node, when that is
        why C{profile} fits nowhere; else C{""}.
    """
    counts = [
        len(_fitting_gpus(node, profile)[0])
        for node in fleet.nodes()
        if node.state == "ready"
    ]
    total = sum(counts)
    whole = sum(1 for count in counts if count >= profile.gpus)
    need = profile.gpus * profile.nodes
    holding = sum(1 for count in counts if count)
    if total < need or whole >= profile.nodes or holding < profile.nodes:
        # Too few GPUs, enough whole nodes, or too few nodes for a gang:
        # not a matter of how the free GPUs are spread.
        return ""
    where = (
        "no node has"
        if profile.nodes == 1
        else f"only {whole} of the {profile.nodes} nodes needed have"
    )
    return (
        f"{total} usable GPUs are free in total on {holding} nodes, enough for"
        f" {need}, but {where} {profile.gpus} of them: the free GPUs are"
        " fragmented"
    )


def _never(profile: Profile, nodes: Sequence[NodeView]) -> str | None:
    """
    @return: why C{profile} fits none of C{nodes} even with all their GPUs
        free, or L{None} when one could hold it.
    """
    if profile.gpus == 0:
        return None
    need_mib = int(profile.gpu_memory_gb * 1024)
    able = [
        n
        for n in nodes
        if (profile.nodes == 1 or not profile.fabric or profile.fabric in n.fabrics)
        and sum(1 for g in n.gpus if g.memory_total_mib >= need_mib) >= profile.gpus
    ]
    if len(able) >= profile.nodes:
        return None
    most = max((len(n.gpus) for n in nodes), default=0)
    largest = max((g.memory_total_mib for n in nodes for g in n.gpus), default=0)
    if profile.nodes > 1:
        why = f"{len(able)} of the {profile.nodes} nodes it needs could hold a shard"
    elif most < profile.gpus:
        why = (
            f"it needs {profile.gpus} GPUs on one node, the most any node has is {most}"
        )
    elif largest < need_mib:
        why = (
            f"it needs {profile.gpu_memory_gb:g} GB on a GPU, the largest GPU has"
            f" {largest / 1024:g} GB"
        )
    else:
        why = f"no node has {profile.gpus} GPUs of {profile.gpu_memory_gb:g} GB"
    return f"profile {profile.name}: {why}"


def never_fits(profiles: Sequence[Profile], nodes: Sequence[NodeView]) -> str | None:
    """
    Whether a model could never be placed on the fleet as it is, whatever
    is freed: no profile fits any node even with every GPU free (too many
    GPUs for any node, more memory than any GPU has, too few nodes for a
    gang).  Nodes' states do not count (one not ready may come back).

    @param nodes: every node known; none known yet answers L{None} (the
        fleet may still be arriving).
    @return: why, one clause per profile joined by C{"; "}, or L{None}.
    """
    if not nodes or not profiles:
        return None
    reasons = []
    for profile in profiles:
        why = _never(profile, nodes)
        if why is None:
            return None
        reasons.append(why)
    return "; ".join(reasons)
