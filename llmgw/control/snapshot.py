"""
The inventory as placement sees it during one reconciler pass, and the
ports placement leaves alone for a while.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control.inventory import Inventory, Node, NodeState
from llmgw.control.ledger import Ledger
from llmgw.control.placement import Fleet, GpuView, NodeView, Plan, shares
from llmgw.control.records import ReplicaRecord, ShardRecord
from llmgw.control.releases import Claims, Releases, Shards

SUSPECT_PORT_SECONDS = 600.0
"""
How long a port where a shard could not start is left out of placement on
its node.
"""


EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"
"""
The kernel's range of ports for outgoing connections (ip-sysctl.rst,
C{ip_local_port_range}; Linux's default: 32768 to 60999).
"""

_log = Logger(namespace="llmgw.control")


def ephemeral_overlap(ports: range, path: str = EPHEMERAL_PORTS) -> range:
    """
    @param ports: C{[control] port_range}.
    @param path: where the kernel tells its ephemeral range, two numbers.
    @return: the ports of C{ports} inside the ephemeral range (Linux's
        default when it cannot be read), empty when none.
    """
    try:
        with open(path) as f:
            low, high = (int(n) for n in f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(max(ports.start, low), min(ports.stop, high + 1))


def warn_ephemeral(ports: range, path: str = EPHEMERAL_PORTS) -> None:
    """
    Log one warning when engine ports lie in the ephemeral range: any
    outgoing connection may take one, and a start there finds it busy.
    """
    overlap = ephemeral_overlap(ports, path)
    if overlap:
        _log.warn(
            "control.port_range {first}-{last} overlaps the kernel's ephemeral"
            " ports ({path}) on {low}-{high}: outgoing connections take ports"
            " there, and engines then start on another; choose a range outside",
            first=ports.start,
            last=ports.stop - 1,
            path=path,
            low=overlap.start,
            high=overlap.stop - 1,
        )


class SuspectPorts:
    """
    Ports where a shard could not start (something else holds them),
    per node, for L{SUSPECT_PORT_SECONDS}.
    """

    def __init__(self) -> None:
        self._since: dict[tuple[str, int], float] = {}

    def mark(self, node: str, port: int, now: float) -> None:
        """
        A start on C{node} found C{port} in use at C{now} (reactor
        seconds).
        """
        self._since[node, port] = now

    def nodes(self) -> set[str]:
        """
        @return: the nodes with a port marked, expired or not.
        """
        return {node for node, _ in self._since}

    def current(self, now: float) -> dict[str, set[int]]:
        """
        @return: per node, the ports marked less than
            L{SUSPECT_PORT_SECONDS} before C{now}; older marks are dropped.
        """
        ports: dict[str, set[int]] = {}
        for (node, port), since in list(self._since.items()):
            if now - since >= SUSPECT_PORT_SECONDS:
                del self._since[node, port]
            else:
                ports.setdefault(node, set()).add(port)
        return ports


STRAY_SECONDS = 45.0
"""
How long a stray is counted at most: an engine told to stop is killed
after C{commands.STOP_GRACE} (30 s), so by then it is gone even if no
status said so.
"""


class Strays:
    """
    Engines the records no longer hold that may still run: shards of a
    dropped replica told to stop, and engines a node lists that no
    replica claims.  Until they are gone (reported stopped or failed, no
    longer listed when their node registers, or after L{STRAY_SECONDS})
    a new shard is not given what they hold: their port, and the GPUs of
    those this server placed (an unclaimed engine's GPUs are the agent's
    to refuse, C{gpus_in_use}, which is not the model's failure).
    """

    def __init__(self) -> None:
        self._held: dict[str, dict[str, tuple[tuple[int, ...], int, float]]] = {}

    def add(
        self, node: str, shard_id: str, gpus: Iterable[int], port: int, now: float
    ) -> None:
        """
        C{shard_id} on C{node} may run on until it stops, holding C{gpus}
        and C{port} (0: none); C{now} in reactor seconds.
        """
        self._held.setdefault(node, {})[shard_id] = (tuple(gpus), port, now)

    def listed(self, node: str, shard_ids: set[str]) -> None:
        """
        C{node} registered listing C{shard_ids}: the others are gone.
        """
        held = self._held.get(node, {})
        for shard_id in [s for s in held if s not in shard_ids]:
            del held[shard_id]

    def gone(self, node: str, shard_id: str) -> None:
        """
        C{shard_id} on C{node} was reported stopped or failed.
        """
        self._held.get(node, {}).pop(shard_id, None)

    def nodes(self) -> set[str]:
        """
        @return: the nodes where a stray is held, expired or not.
        """
        return {node for node, held in self._held.items() if held}

    def held(self, now: float) -> dict[str, list[tuple[tuple[int, ...], int]]]:
        """
        @return: per node, the GPU indices and port each stray holds;
            those older than L{STRAY_SECONDS} at C{now} are dropped.
        """
        result: dict[str, list[tuple[tuple[int, ...], int]]] = {}
        for node, held in self._held.items():
            for shard_id, (gpus, port, since) in list(held.items()):
                if now - since >= STRAY_SECONDS:
                    del held[shard_id]
                else:
                    result.setdefault(node, []).append((gpus, port))
        return result


def _hold(
    replica: ReplicaRecord,
    shard: ShardRecord,
    taken: set[int],
    claims: Claims,
    each: Shards,
) -> None:
    """
    Count what C{shard} (of C{replica}, not gone) holds on its node: a
    sleeping engine its C{sleep_gpu_memory_gb} and no GPU whole; any
    other, turning ones included (starting, waking, going to sleep,
    stopping), its C{gpu_memory_gb}, and its GPUs whole unless its profile
    shares them.  C{each} gets the shard's own figure (L{Releases}).
    """
    profile = replica.profile
    asleep = replica.asleep
    gb = profile.sleep_gpu_memory_gb if asleep else profile.gpu_memory_gb
    sharer = not asleep and shares(profile)
    if not asleep and not sharer:
        taken.update(shard.gpus)
    each[shard.id] = (shard.gpus, int(gb * 1024))
    for index in shard.gpus:
        mib, count = claims.get(index, (0, 0))
        claims[index] = (mib + int(gb * 1024), count + sharer)


def _node_view(
    node: Node,
    used: frozenset[int],
    busy: frozenset[int],
    cache: dict[str, tuple[Any, NodeView]],
    claims: Claims | None = None,
) -> NodeView:
    """
    @param used: GPU indices taken whole on the node.
    @param busy: ports taken on its address.
    @param claims: what llmgw's engines on it hold, per GPU (L{Claims}).
    @param cache: views of earlier passes by node id, reused when nothing
        placement reads has changed; updated.
    @return: C{node} as placement sees it.
    """
    state: str = node.state
    if state == NodeState.READY and not node.connected:
        state = "disconnected"
    if state == NodeState.READY and node.draining:
        state = "draining"
    if state == NodeState.READY and node.engines_stopped:
        state = "engines stopped"
    claims = claims or {}
    version = (node.version, state, used, busy, node.address, sorted(claims.items()))
    hit = cache.get(node.id)
    if hit is not None and hit[0] == version:
        return hit[1]
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
                foreign_used_mib=g.foreign_used_mib,
                problems=tuple(g.problems),
                allocated=g.index in used,
                claimed_mib=claims.get(g.index, (0, 0))[0],
                sharers=claims.get(g.index, (0, 0))[1],
            )
            for g in node.gpus
        ),
        ports_in_use=busy,
        address=node.address,
    )
    cache[node.id] = (version, view)
    return view


class Snapshot:
    """
    The inventory as placement sees it during one pass: GPUs and ports
    taken by live shards count as allocated, and each placement made in
    the pass is taken at once so the next one does not reuse it.

    @param suspect_ports: per node, ports to leave alone.
    @param strays: per node, the GPUs and port each stray holds
        (L{Strays.held}).
    @param releases: memory given back and not yet reported free, added
        to what each node's engines hold (L{Releases.adjust}), at C{now}
        (reactor seconds); with C{record}, drops since are recorded (the
        snapshot kept from pass to pass).
    @param cache: node views of earlier passes, reused for nodes where
        nothing placement reads has changed; updated in place.
    @ivar fleet: what L{llmgw.control.placement.place} reads.
    """

    def __init__(
        self,
        nodes: Iterable[Node],
        replicas: Iterable[ReplicaRecord],
        suspect_ports: dict[str, set[int]],
        cache: dict[str, tuple[Any, NodeView]] | None = None,
        strays: dict[str, list[tuple[tuple[int, ...], int]]] | None = None,
        releases: Releases | None = None,
        now: float = 0.0,
        record: bool = False,
    ) -> None:
        nodes = list(nodes)
        taken: dict[str, set[int]] = {}
        claims: dict[str, Claims] = {}
        each: dict[str, Shards] = {}
        # Ports are per address: two nodes on one host (two agents, or a
        # test fleet) share its ports.
        address = {node.id: node.address for node in nodes}
        ports: dict[str, set[int]] = {}
        for node_id, suspect in suspect_ports.items():
            ports.setdefault(address.get(node_id, node_id), set()).update(suspect)
        for node_id, held in (strays or {}).items():
            for gpus, port in held:
                taken.setdefault(node_id, set()).update(gpus)
                if port:
                    ports.setdefault(address.get(node_id, node_id), set()).add(port)
        for replica in replicas:
            for shard in replica.shards:
                if shard.state.gone:
                    continue
                # Asleep once every shard is: one going to sleep still runs.
                _hold(
                    replica,
                    shard,
                    taken.setdefault(shard.node, set()),
                    claims.setdefault(shard.node, {}),
                    each.setdefault(shard.node, {}),
                )
                key = address.get(shard.node, shard.node)
                ports.setdefault(key, set()).add(shard.port)
                if shard.rank == 0 and replica.rendezvous_port:
                    ports[key].add(replica.rendezvous_port)
        if cache is None:
            cache = {}
        views = [
            _node_view(
                node,
                frozenset(taken.get(node.id, ())),
                frozenset(ports.get(node.address, ())),
                cache,
                releases.adjust(
                    node, claims.get(node.id, {}), each.get(node.id, {}), now, record
                )
                if releases is not None
                else claims.get(node.id),
            )
            for node in nodes
        ]
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
        """
        Count C{plan}'s GPUs (whole, or its memory on them for a sharing
        profile) and ports as taken (its ports on every node at the same
        address).
        """
        sharer = shares(plan.profile)
        mib = int(plan.profile.gpu_memory_gb * 1024)
        for shard in plan.shards:
            held = {shard.port}
            if shard.rank == 0 and plan.rendezvous_port:
                held.add(plan.rendezvous_port)
            view = self.fleet.get(shard.node)
            self.fleet.replace(
                replace(
                    view,
                    gpus=tuple(
                        replace(
                            g,
                            allocated=g.allocated or not sharer,
                            claimed_mib=g.claimed_mib + mib,
                            sharers=g.sharers + sharer,
                        )
                        if g.index in shard.gpus
                        else g
                        for g in view.gpus
                    ),
                    ports_in_use=view.ports_in_use | held,
                )
            )
            for other in self._same_address.get(shard.node, ()):
                view = self.fleet.get(other)
                self.fleet.replace(replace(view, ports_in_use=view.ports_in_use | held))


class LiveSnapshot(Snapshot):
    """
    A L{Snapshot} kept from pass to pass: built once, then refreshed only
    for the nodes that changed (and those at their addresses), so that a
    pass that places a replica costs what changed, not the fleet.
    """

    def __init__(
        self,
        nodes: Iterable[Node],
        replicas: Iterable[ReplicaRecord],
        suspect_ports: dict[str, set[int]],
        cache: dict[str, tuple[Any, NodeView]],
        strays: dict[str, list[tuple[tuple[int, ...], int]]],
        releases: Releases,
        now: float,
    ) -> None:
        nodes = list(nodes)
        super().__init__(
            nodes, replicas, suspect_ports, cache, strays, releases, now, record=True
        )
        self._releases = releases
        self._address = {node.id: node.address for node in nodes}
        self._peers: dict[str, list[str]] = {}
        for node in nodes:
            self._peers.setdefault(node.address, []).append(node.id)

    def refresh(
        self,
        inventory: Inventory,
        changed: Iterable[str],
        shards_on: Callable[[str], Iterable[tuple[ReplicaRecord, ShardRecord]]],
        suspect_ports: dict[str, set[int]],
        strays: dict[str, list[tuple[tuple[int, ...], int]]],
        cache: dict[str, tuple[Any, NodeView]],
        now: float = 0.0,
    ) -> bool:
        """
        Work the views of the nodes C{changed} out again, with every node
        at their addresses, as L{Snapshot} would.

        @param shards_on: a node id's shard records, with their replicas.
        @param suspect_ports: L{SuspectPorts.current}.
        @param strays: L{Strays.held}.
        @return: C{False} when a node is new or moved (then only a new
            snapshot is right).
        """
        addresses = set()
        for node_id in changed:
            node = inventory.get(node_id)
            if node is None:
                continue
            if self._address.get(node_id) != node.address:
                return False
            addresses.add(node.address)
        for address in addresses:
            peers = [inventory.get(node_id) for node_id in self._peers[address]]
            busy: set[int] = set()
            used: dict[str, set[int]] = {}
            claims: dict[str, Claims] = {}
            each: dict[str, Shards] = {}
            for peer in peers:
                assert peer is not None
                taken = used.setdefault(peer.id, set())
                claimed = claims.setdefault(peer.id, {})
                own = each.setdefault(peer.id, {})
                busy.update(suspect_ports.get(peer.id, ()))
                for gpus, port in strays.get(peer.id, ()):
                    taken.update(gpus)
                    if port:
                        busy.add(port)
                for replica, shard in shards_on(peer.id):
                    if shard.state.gone:
                        continue
                    _hold(replica, shard, taken, claimed, own)
                    busy.add(shard.port)
                    if shard.rank == 0 and replica.rendezvous_port:
                        busy.add(replica.rendezvous_port)
            ports = frozenset(busy)
            for peer in peers:
                assert peer is not None
                held = self._releases.adjust(peer, claims[peer.id], each[peer.id], now)
                view = _node_view(peer, frozenset(used[peer.id]), ports, cache, held)
                if view is not self.fleet.get(peer.id):
                    self.fleet.replace(view)
        return True


class Snapshots:
    """
    The inventory as placement sees it, for the plane's parts: a fresh
    L{Snapshot} when asked, and the L{LiveSnapshot} kept from pass to
    pass, refreshed for the nodes that changed (L{Ledger.changes}).

    @param clock: the reactor's clock (suspect ports and strays expire).
    @param inventory: the nodes.
    @param ledger: the records.
    @ivar suspect: ports where a shard could not start, left alone a while.
    @ivar strays: engines that may run unrecorded.
    """

    def __init__(
        self, clock: IReactorTime, inventory: Inventory, ledger: Ledger
    ) -> None:
        self._clock = clock
        self._inventory = inventory
        self._ledger = ledger
        self.suspect = SuspectPorts()
        self.strays = Strays()
        self.releases = Releases(inventory)
        self._views: dict[str, tuple[Any, NodeView]] = {}
        self._live: LiveSnapshot | None = None

    def snapshot(self) -> Snapshot:
        """
        @return: the inventory as placement sees it now.
        """
        now = self._clock.seconds()
        return Snapshot(
            self._inventory.nodes(),
            self._ledger.replicas.values(),
            self.suspect.current(now),
            self._views,
            self.strays.held(now),
            self.releases,
            now,
        )

    def live(self) -> LiveSnapshot:
        """
        @return: the snapshot kept from pass to pass, its nodes that
            changed worked out again (L{LiveSnapshot}).
        """
        now = self._clock.seconds()
        changes = self._ledger.changes
        changed = changes.take_nodes()
        # Before they expire: a node whose mark expires changes too.
        changed |= self.suspect.nodes() | self.strays.nodes() | self.releases.nodes()
        suspect = self.suspect.current(now)
        strays = self.strays.held(now)
        live = self._live
        if live is None or not live.refresh(
            self._inventory,
            changed,
            self._ledger.shards_on,
            suspect,
            strays,
            self._views,
            now,
        ):
            live = self._live = LiveSnapshot(
                self._inventory.nodes(),
                self._ledger.replicas.values(),
                suspect,
                self._views,
                strays,
                self.releases,
                now,
            )
        return live

    def forget(self) -> None:
        """
        The next L{live} is built anew (a pass over everything, a pass
        whose scaling failed).
        """
        self._live = None
