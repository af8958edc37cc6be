"""
The simplest L{llmgw.router.interfaces.BatchRoom}: a fixed count of lines
in flight per ready replica of a model, one while it has none (the line
then waits for the model to start, at the batch's rank).  It knows nothing
of the engines' load: the room that follows it replaces this one in the
server's wiring when it is there.
"""

from __future__ import annotations

from collections.abc import Callable


class FixedRoom:
    """
    @param replicas: how many ready replicas serve a model name now.
    @param per_replica: lines in flight per ready replica, at least 1.
    """

    def __init__(self, replicas: Callable[[str], int], per_replica: int) -> None:
        self._replicas = replicas
        self._per_replica = max(1, per_replica)
        self._in_flight: dict[str, int] = {}

    def room(self, model: str) -> int:
        replicas = self._replicas(model)
        limit = replicas * self._per_replica if replicas > 0 else 1
        return max(0, limit - self._in_flight.get(model, 0))

    def sent(self, model: str) -> None:
        self._in_flight[model] = self._in_flight.get(model, 0) + 1

    def ended(self, model: str) -> None:
        left = self._in_flight.get(model, 0) - 1
        if left > 0:
            self._in_flight[model] = left
        else:
            self._in_flight.pop(model, None)
