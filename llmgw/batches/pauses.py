"""
The batches' runner's back-offs: lines held back per name (a model, or a
key) after an answer that said "not now", each pause doubling the last
until an answer comes through.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from twisted.internet.interfaces import IReactorTime

Name = TypeVar("Name", bound=Hashable)


class Pauses(Generic[Name]):
    """
    Who is held back, and until when.

    @param clock: the reactor's clock.
    @param backoff: seconds of the first pause after an answer came.
    @param max_backoff: seconds a pause lasts at most, C{Retry-After}
        included.
    """

    def __init__(self, clock: IReactorTime, backoff: float, max_backoff: float):
        self._clock = clock
        self._first = backoff
        self._most = max_backoff
        self._until: dict[Name, float] = {}
        self._last: dict[Name, float] = {}

    def paused(self, name: Name) -> bool:
        """
        @return: whether C{name}'s lines are held back now.
        """
        return self._until.get(name, 0.0) > self._clock.seconds()

    def pause(self, name: Name, retry_after: float | None) -> None:
        """
        Hold C{name}'s lines back: C{retry_after} seconds when the answer
        said (at most C{max_backoff}), else the back-off, doubled at each
        pause since its last answer.  A pause while one runs adds none:
        the lines of one burst, sent before it, pause once.
        """
        if self.paused(name):
            return
        wait = max(self._first, min(self._most, self._last.get(name, 0.0) * 2))
        self._last[name] = wait
        if retry_after is not None:
            wait = min(self._most, retry_after)
        self._until[name] = self._clock.seconds() + wait

    def answered(self, name: Name) -> None:
        """
        An answer came for C{name}: its next pause starts from the first.
        """
        self._last.pop(name, None)

    def ends(self) -> list[float]:
        """
        @return: seconds from now to the end of each pause that runs.
        """
        now = self._clock.seconds()
        return [until - now for until in self._until.values() if until > now]
