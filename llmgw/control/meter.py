"""
Every second of every GPU the fleet reports, counted and priced
(docs/cost.md): held by a replica starting (or waking), awake or asleep,
or by none (C{free}); a GPU shared by C{share_gpu} replicas counted by
each one's share of its memory (L{llmgw.control.placement.shares}), the
rest free.  Of an awake replica's seconds, those during which the
router had a request in flight to it are the requests' (the router
gives each its part, L{llmgw.router.routing.gpu_share}); the rest of
the fleet's seconds are idle.

Read from the control plane's own records (L{llmgw.control.ledger}) at
each tick: the state found at one tick is counted until the next (a
second apart), the router's busy seconds are read exactly.  What is
counted goes to the store (L{llmgw.store.gpu_time}) as additions, so that
a restart or a standby taking over loses at most one write's worth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from llmgw.control.inventory import Inventory, NodeState
from llmgw.control.prices import Prices
from llmgw.control.records import ReplicaRecord, ReplicaState, ShardRecord
from llmgw.router.interfaces import Endpoint

HOUR = 3600.0


@dataclass(frozen=True)
class Holder:
    """
    A replica holding (part of) one GPU during a tick.

    @ivar replica: its id.
    @ivar model: its model.
    @ivar state: C{"starting"}, C{"awake"} or C{"asleep"}.
    @ivar weight: the part of the GPU it holds, 0 to 1.
    """

    replica: str
    model: str
    state: str
    weight: float


@dataclass(frozen=True)
class Counted:
    """
    What one tick counted of one GPU for one model and state (the
    store's C{gpu_time} row, L{llmgw.store.gpu_time.GpuTimeRow}).

    @ivar hour: the start of the UTC hour it goes to, POSIX seconds.
    @ivar model: C{""} for C{free}.
    @ivar seconds: GPU-seconds.
    @ivar busy: of those, the requests' (awake with one in flight).
    @ivar cost: the price of C{seconds}; C{busy_cost} of C{busy}.
    """

    hour: float
    node: str
    gpu: int
    gpu_name: str
    model: str
    state: str
    seconds: float
    busy: float
    cost: float
    busy_cost: float


@dataclass(frozen=True)
class Gpu:
    """
    One GPU as a tick found it.

    @ivar node: its node's id.
    @ivar index: its index on the node.
    @ivar name: its model name, as its agent reports it.
    @ivar per_second: its price per second.
    @ivar holders: the replicas holding it.
    """

    node: str
    index: int
    name: str
    per_second: float
    holders: tuple[Holder, ...]


def replica_state(replica: ReplicaRecord) -> str | None:
    """
    @return: what a second of C{replica}'s GPUs is: C{"starting"} (or
        waking), C{"awake"} (ready, draining, or going to sleep with its
        last requests), C{"asleep"}, or L{None} for a failed one (its
        GPUs count as free).
    """
    state = replica.state
    if state in (ReplicaState.STARTING, ReplicaState.WAKING):
        return "starting"
    if state == ReplicaState.SLEEPING:
        return "asleep" if replica.asleep_at is not None or replica.asleep else "awake"
    if state in (ReplicaState.READY, ReplicaState.DRAINING):
        return "awake"
    return None


Shards = Callable[[], Iterable[tuple[ReplicaRecord, ShardRecord]]]
"""
The shards the control plane records, with their replicas
(L{llmgw.control.ledger.Ledger.shards}), read when called.
"""


def fleet_gpus(inventory: Inventory, shards: Shards, prices: Prices) -> list[Gpu]:
    """
    @return: every GPU of the nodes not lost, with the replicas holding
        it: a whole-GPU replica holds all of it; a sharing one its share
        of the memory (L{ShardRecord.share}), or an equal part of what
        the sharers whose share is not known leave; never more than the
        whole GPU in all.
    """
    held: dict[tuple[str, int], list[tuple[ReplicaRecord, float, str]]] = {}
    for replica, shard in shards():
        state = replica_state(replica)
        if state is None or shard.state.gone:
            continue
        share = shard.share if replica.profile.share_gpu else 1.0
        for index in shard.gpus:
            held.setdefault((shard.node, index), []).append((replica, share, state))
    out = []
    for node in inventory.nodes():
        if node.state == NodeState.LOST:
            continue
        for info in node.gpus:
            here = held.get((node.id, info.index), [])
            known = sum(share for _, share, _ in here)
            unknown = [h for h in here if h[1] <= 0]
            each = max(0.0, 1.0 - known) / len(unknown) if unknown else 0.0
            weights = [(r, share if share > 0 else each, s) for r, share, s in here]
            total = sum(w for _, w, _ in weights)
            scale = 1.0 / total if total > 1.0 else 1.0
            holders = tuple(
                Holder(r.id, r.model, s, w * scale) for r, w, s in weights if w > 0
            )
            price = prices.per_hour(node.id, info.name) / HOUR
            out.append(Gpu(node.id, info.index, info.name, price, holders))
    return out


class GpuMeter:
    """
    Counts each GPU's seconds by state and by model, and the part of them
    the router's requests used.

    @param inventory: the nodes and their GPUs.
    @param shards: the control plane's shards (L{llmgw.control.ledger.Ledger.shards}).
    @param prices: the C{[cost]} table's prices.
    @param busy: per replica id, the seconds the router had a request in
        flight to it, since it first had one
        (L{llmgw.router.routing.balancer.Balancer.busy}).
    @ivar totals: since this meter began, per C{(node, gpu index, model,
        state)}: C{[seconds, busy seconds, cost, busy cost]}.
    """

    def __init__(
        self,
        inventory: Inventory,
        shards: Shards,
        prices: Prices,
        busy: Callable[[str], float],
    ) -> None:
        self._inventory = inventory
        self._shards = shards
        self._prices = prices
        self._busy = busy
        self._last: float | None = None
        self._gpus: list[Gpu] = []
        self._busy_seen: dict[str, float] = {}
        self.totals: dict[tuple[str, int, str, str], list[float]] = {}

    @property
    def counting(self) -> bool:
        """
        Whether a tick since the last L{stop} began counting.
        """
        return self._last is not None

    def stop(self) -> None:
        """
        Stop counting (the server no longer leads): the next L{tick}
        begins afresh, counting nothing for the time between.
        """
        self._last = None

    def tick(self, now: float) -> list[Counted]:
        """
        Count the seconds since the last tick as the last tick found the
        fleet, and look at it again.

        @param now: seconds (the reactor's: POSIX time in the server).
        @return: what was counted, per GPU, model and state; the seconds
            between two ticks go to the hour of the later one.
        """
        counted: list[Counted] = []
        if self._last is not None and now > self._last:
            counted = self._count(now - self._last, (now // HOUR) * HOUR)
        else:
            self._read_busy(())
        self._last = now
        self._gpus = fleet_gpus(self._inventory, self._shards, self._prices)
        return counted

    def _read_busy(self, replicas: Iterable[str]) -> dict[str, float]:
        """
        @return: per replica id, the busy seconds since the last reading.
        """
        ids = set(replicas) | set(self._busy_seen)
        out = {}
        seen = {}
        for replica_id in ids:
            busy = self._busy(replica_id)
            before = self._busy_seen.get(replica_id, 0.0)
            # A replica the router forgot and counts afresh starts at 0.
            out[replica_id] = busy - before if busy >= before else busy
            if busy > 0:
                seen[replica_id] = busy
        self._busy_seen = seen
        return out

    def _count(self, elapsed: float, hour: float) -> list[Counted]:
        replicas = {h.replica for g in self._gpus for h in g.holders}
        busy = self._read_busy(replicas)
        counted = []
        for gpu in self._gpus:
            free = elapsed
            parts: dict[tuple[str, str], list[float]] = {}
            for holder in gpu.holders:
                seconds = holder.weight * elapsed
                used = holder.weight * min(elapsed, busy.get(holder.replica, 0.0))
                part = parts.setdefault((holder.model, holder.state), [0.0] * 4)
                part[0] += seconds
                part[1] += used
                free -= seconds
            if free > 1e-12:
                parts.setdefault(("", "free"), [0.0] * 4)[0] += free
            for (model, state), part in parts.items():
                part[2] = part[0] * gpu.per_second
                part[3] = part[1] * gpu.per_second
                key = (gpu.node, gpu.index, model, state)
                total = self.totals.setdefault(key, [0.0] * 4)
                for i in range(4):
                    total[i] += part[i]
                counted.append(
                    Counted(hour, gpu.node, gpu.index, gpu.name, model, state, *part)
                )
        return counted

    def priced(self, endpoints: Iterable[Endpoint]) -> list[Endpoint]:
        """
        @return: C{endpoints} with each replica's GPUs (its shares summed)
            and their price per hour, as the fleet is now, for the
            router's requests' shares (L{Endpoint.gpus},
            L{Endpoint.gpu_hour}); a static endpoint (no replica) as it
            is.
        """
        rates: dict[str, list[float]] = {}
        for gpu in fleet_gpus(self._inventory, self._shards, self._prices):
            for holder in gpu.holders:
                rate = rates.setdefault(holder.replica, [0.0, 0.0])
                rate[0] += holder.weight
                rate[1] += holder.weight * gpu.per_second * HOUR
        out = []
        for endpoint in endpoints:
            gpus, gpu_hour = rates.get(endpoint.id, (0.0, 0.0))
            if gpus:
                endpoint = replace(endpoint, gpus=gpus, gpu_hour=gpu_hour)
            out.append(endpoint)
        return out
