"""
What the operator asks of replicas and models through the admin API: put
a replica to sleep, wake one, pin a model or unpin it (docs/catalog.md,
"Sleep" and "Eviction").  Each changes the model's C{wanted} as the
automatic policy would, and leaves the rest to the plane's next pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control.actions import ReplicaActions
from llmgw.control.catalog import Model
from llmgw.control.ledger import Ledger
from llmgw.control.records import ReplicaRecord
from llmgw.control.runtime import ModelCatalog
from llmgw.control.sleeping import SleepRoom, held_plan
from llmgw.control.snapshot import Snapshots
from llmgw.control.swaps import Swaps


class SleepRefused(Exception):
    """
    An operator's sleep or wake of a replica cannot be done now; the
    message says why.
    """


class Operator:
    """
    The operator's sleep, wake and pin.  The layer above making room
    (a wake's room is seen as the swap queue sees it); it calls nothing
    above it.

    @param clock: the reactor's clock.
    @param catalog: the catalog at run time.
    @param ledger: the records.
    @param room: whether a replica may sleep, and a sleeper wake.
    @param actions: puts replicas to sleep and wakes them.
    @param swaps: the fleet as placement sees it for a model.
    @param snapshots: the placement snapshot.
    @param kick: asks for one more pass.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        catalog: ModelCatalog,
        ledger: Ledger,
        room: SleepRoom,
        actions: ReplicaActions,
        swaps: Swaps,
        snapshots: Snapshots,
        kick: Callable[[], None],
    ) -> None:
        self._clock = clock
        self._catalog = catalog
        self._ledger = ledger
        self._room = room
        self._actions = actions
        self._swaps = swaps
        self._snapshots = snapshots
        self._kick = kick

    def sleep_replica(self, replica_id: str) -> ReplicaRecord:
        """
        Put a ready replica to sleep (the admin API's); its model's wanted
        count goes down by one, as a scale-down's.

        @raise KeyError: no such replica.
        @raise SleepRefused: it may not sleep now (the message says why),
            or its model would go below C{min_replicas}.
        """
        replica = self._ledger.replicas[replica_id]
        state = self._catalog.get(replica.model)
        why = self._room.why_not_sleep(replica)
        if why is not None:
            raise SleepRefused(f"replica {replica_id} cannot sleep: {why}")
        awake = self._awake(replica.model)
        if state is not None and awake - 1 < state.model.min_replicas:
            raise SleepRefused(
                f"replica {replica_id} cannot sleep: model {replica.model} would"
                f" have {awake - 1} replicas awake, under its min_replicas"
                f" {state.model.min_replicas}"
            )
        if state is not None:
            state.wanted = awake - 1
        self._actions.sleep(replica, "put to sleep by the operator", "slept")
        self._kick()
        return replica

    def wake_replica(self, replica_id: str) -> ReplicaRecord:
        """
        Wake a sleeping replica (the admin API's); its model's wanted
        count goes up by one, and its idle time counts from now.

        @raise KeyError: no such replica.
        @raise SleepRefused: it is not asleep, its model is at
            C{max_replicas}, or its GPUs have no room (the message says
            which).
        """
        replica = self._ledger.replicas[replica_id]
        if replica.dormant and not replica.asleep:
            raise SleepRefused(
                f"replica {replica_id} is still going to sleep; wake it once asleep"
            )
        if not replica.asleep:
            raise SleepRefused(f"replica {replica_id} is {replica.state}, not asleep")
        state = self._catalog.get(replica.model)
        awake = self._awake(replica.model)
        if state is not None and awake >= state.model.max_replicas:
            raise SleepRefused(
                f"model {replica.model} has {awake} replicas awake, its max_replicas"
            )
        snapshot = self._snapshots.live()
        room = self._room.wake_room(
            replica, self._swaps.fleet_for(replica.model, snapshot)
        )
        if room is not None:
            raise SleepRefused(f"replica {replica_id} cannot wake now: {room}")
        now = self._clock.seconds()
        if state is not None:
            state.wanted = awake + 1
            state.busy_at = max(state.busy_at, now)
            state.last_used = max(state.last_used, now)
        self._actions.wake(replica, now, "woken by the operator")
        snapshot.take(held_plan(replica))
        self._kick()
        return replica

    def _awake(self, name: str) -> int:
        """
        @return: model C{name}'s replicas neither draining, leaving nor
            dormant.
        """
        return sum(
            1
            for r in self._ledger.of_model(name)
            if r.draining_since is None and r.leaving_since is None and not r.dormant
        )

    def pin(self, name: str, pinned: bool) -> Model:
        """
        Mark a model pinned (never evicted to make room for another) or
        not; kept until the server restarts.

        @return: the model, changed.
        @raise KeyError: no such model.
        """
        state = self._catalog.get(name)
        if state is None:
            raise KeyError(name)
        state.model = replace(state.model, pinned=pinned)
        self.log.info(
            "model {model} {what}", model=name, what="pinned" if pinned else "unpinned"
        )
        self._ledger.changes.model(name)
        self._kick()
        return state.model
