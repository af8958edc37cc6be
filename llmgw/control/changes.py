"""
What changed since the reconciler's last pass, so that a pass looks at
that and not at everything (issue 12 item 6): the models whose records or
settings changed, the nodes whose description changed, and when each node
is next due to be looked at for its silence.

Nodes are looked at for their silence only when they may have gone
silent (L{llmgw.control.inventory.Inventory.heard_by}) or were heard or
changed (C{Inventory.touched}).

A model is I{settled} when a pass would leave it as it is while nothing
happens to it: its replicas all ready, as many as it wants, nothing in
flight, nobody waiting, no traffic-driven count above C{min_replicas}.
Such a model is looked at again only when an event names it (a shard
status, a drain, a scale, requests in flight to one of its replicas, a
node of one of its shards lost); every other model is looked at every
pass, as before.  Catalog changes and the end of the start-up grace make
the next pass look at everything; a registration names its node and the
models of its shards.
"""

from __future__ import annotations


class Changes:
    """
    The reconciler's dirty sets.

    @ivar everything: the next pass looks at every model and node (the
        first pass; after a catalog change).
    @ivar models: models an event named since the last pass.
    @ivar unsettled: models the last pass left unsettled: looked at again
        by the next one.
    @ivar nodes: nodes whose view for placement is to be worked out
        again.
    """

    def __init__(self) -> None:
        self.everything = True
        self.models: set[str] = set()
        self.unsettled: set[str] = set()
        # Nodes whose view for placement is to be worked out again.
        self.nodes: set[str] = set()

    def model(self, name: str) -> None:
        """
        Something happened to model C{name}: the next pass looks at it.
        """
        self.models.add(name)

    def all(self) -> None:
        """
        The next pass looks at everything.
        """
        self.everything = True

    def take(self) -> tuple[bool, set[str]]:
        """
        A pass begins: what it is to look at.

        @return: whether it looks at everything, and the models events
            named or the last pass left unsettled; both start afresh.
        """
        everything, self.everything = self.everything, False
        work, self.models = self.models | self.unsettled, set()
        return everything, work

    def settled(self, unsettled: set[str]) -> None:
        """
        A pass ends: C{unsettled} are the models the next one looks at
        again even if nothing names them.
        """
        self.unsettled = unsettled

    def take_nodes(self) -> set[str]:
        """
        @return: the nodes whose view is to be worked out again, which
            start afresh.
        """
        nodes, self.nodes = self.nodes, set()
        return nodes
