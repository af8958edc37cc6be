"""
Memory llmgw's engines gave back that their GPUs have not reported free
yet (docs/catalog.md): placement counts it held until the node's memory
reports say otherwise (L{llmgw.control.snapshot} adds it to what each
GPU's engines hold).
"""

from __future__ import annotations

from llmgw.control.inventory import Inventory, Node

Shards = dict[str, tuple[tuple[int, ...], int]]
"""
Per shard id, its GPU indices and the MiB it is counted to hold on each.
"""

Claims = dict[int, tuple[int, int]]
"""
Per GPU index, the MiB llmgw's engines on it are counted to hold and how
many sharing replicas (L{llmgw.control.placement.shares}) are among
them.
"""


RELEASE_SECONDS = 60.0
"""
How long memory an engine gave back is counted held at most, waiting for
its GPU's reports (as L{llmgw.control.swaps.RELEASE_SECONDS}).
"""


class Releases:
    """
    Memory llmgw's engines gave back by going (a stop, a failure, a
    replica dropped) that their GPUs have not reported free yet: it stays
    counted held
    until the node has sent enough memory reports since (one for a
    simulated GPU, whose report is computed as it is sent; two for a real
    one, whose heartbeat carries NVML's reading of the heartbeat before),
    at most L{RELEASE_SECONDS}.  Found by comparing what each node's
    engines are counted to hold from one snapshot to the next.
    """

    def __init__(self, inventory: Inventory) -> None:
        """
        @param inventory: the nodes (their memory reports, L{Node.reports}).
        """
        self._inventory = inventory
        self._seen: dict[str, Shards] = {}
        self._held: dict[str, list[tuple[int, int, int, float]]] = {}

    def adjust(
        self, node: Node, claims: Claims, each: Shards, now: float, record: bool = True
    ) -> Claims:
        """
        @param claims: what C{node}'s engines are counted to hold now.
        @param each: the same per shard (an engine that stops while another
            starts on its GPU leaves the total alike).
        @param now: reactor seconds.
        @param record: whether drops since the last recording call are
            recorded (the snapshot kept from pass to pass) or only what is
            held is added (a snapshot made to be read: asking changes
            nothing).
        @return: C{claims} with what was given back and not yet reported
            free added (sharers unchanged).
        """
        held = list(self._held.get(node.id, ()))
        if record:
            before = self._seen.get(node.id, {})
            self._seen[node.id] = dict(each)
            for shard_id, (gpus, mib) in before.items():
                if shard_id not in each and mib > 0:
                    held.extend((i, mib, node.reports, now) for i in gpus)
        held = [h for h in held if not _settled(node, h, now)]
        if record:
            self._held[node.id] = held
        out = dict(claims)
        for index, mib, _, _ in held:
            count, sharers = out.get(index, (0, 0))
            out[index] = (count + mib, sharers)
        return out

    def nodes(self) -> set[str]:
        """
        @return: the nodes where memory given back is held, settled or not
            (their views are worked out again, which drops what settled).
        """
        return {node for node, held in self._held.items() if held}

    def pending(self, now: float) -> set[str]:
        """
        @return: the nodes where memory given back is still counted held
            at C{now} (reactor seconds): not reported free yet.
        """
        out = set()
        for node_id, held in self._held.items():
            node = self._inventory.get(node_id)
            if node is not None and any(not _settled(node, h, now) for h in held):
                out.add(node_id)
        return out


def _settled(node: Node, held: tuple[int, int, int, float], now: float) -> bool:
    """
    @param held: (GPU index, MiB, the node's reports then, reactor seconds
        then).
    @return: whether the node has reported since as often as its GPU needs
        (one report for a simulated GPU, two for a real one), or
        L{RELEASE_SECONDS} passed.
    """
    index, _, reports, since = held
    simulated = any(g.simulated for g in node.gpus if g.index == index)
    return now - since >= RELEASE_SECONDS or node.reports >= reports + (
        1 if simulated else 2
    )
