"""
Who goes first where requests wait in the router (the overload room,
L{llmgw.router.routing.overload}; the activation queue,
L{llmgw.router.routing.activation}): a key's I{priority} first, then, within a
priority, the I{weighted fair share} of the tokens each key was served
recently, so that a key sending ten times more does not get ten times
the turns; arrival order breaks ties.  When a room is full the lowest
priority's newest request is refused first (L{FairQueue.victim}).

A priority is a name (C{interactive}, C{standard}, C{batch}) or an
integer; higher goes first: C{interactive} is 2, C{standard} (every key
without one) 1, C{batch} 0.  A weight is a positive number, 1 by
default: a key of weight 2 is given twice the tokens of a key of weight
1 of the same priority while both wait.

A batch's lines (L{BATCH_RANK}, below every priority) go after every
client's request and are refused first, in the first-come-first-served
order too (C{waiting_order = "fifo"}): that order is among clients; batch
work only fills what they leave.

The tokens served decay with a half-life (L{HALF_LIFE}) so that a key
is judged by what it was served lately, not since the start.  Limits
and budgets (L{llmgw.router.accounting.auth}) are checked as before: this only
orders those that wait.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from itertools import count
from typing import Generic, TypeVar

from twisted.internet.interfaces import IReactorTime

from llmgw.router.interfaces import BATCH_RANK, Tenant

PRIORITIES = {"interactive": 2, "standard": 1, "batch": 0}
"""
The named priorities and their numbers (higher goes first).
"""

HALF_LIFE = 30.0
"""
Seconds after which a key's tokens served count half in its share.
"""


def priority_rank(value: str | int | None) -> int:
    """
    @param value: a priority as a key holds it: a name of L{PRIORITIES},
        an integer (or its digits), or L{None} for C{standard}.
    @return: its number, higher goes first.
    @raise ValueError: neither a known name nor an integer, naming what
        is expected.
    """
    if value is None:
        return PRIORITIES["standard"]
    if isinstance(value, bool):
        raise ValueError(f"priority: {value!r}: expected {_expected()}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if text in PRIORITIES:
        return PRIORITIES[text]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"priority: {text[:60]!r}: expected {_expected()}") from None


def is_batch(tenant: Tenant) -> bool:
    """
    @return: whether C{tenant}'s request is a batch's line (L{BATCH_RANK}).
    """
    return tenant.rank <= BATCH_RANK


def _expected() -> str:
    return ", ".join(PRIORITIES) + " or an integer (higher goes first)"


def check_weight(value: object) -> float:
    """
    @return: C{value} as a weight.
    @raise ValueError: not a finite number above 0.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"weight: {value!r}: expected a number above 0")
    weight = float(value)
    if not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"weight: {value!r}: expected a number above 0")
    return weight


ANONYMOUS = Tenant()
"""
The tenant of a request without a key (or of a gateway without keys).
"""


class FairShare:
    """
    The tokens each key was served lately, decaying with L{HALF_LIFE}.

    @param clock: the reactor's clock.
    """

    def __init__(self, clock: IReactorTime, half_life: float = HALF_LIFE) -> None:
        self._clock = clock
        self._rate = math.log(2) / half_life
        self._served: dict[str, tuple[float, float]] = {}

    def served(self, tenant: Tenant, tokens: float) -> None:
        """
        Count C{tokens} (may be negative: an estimate corrected) to
        C{tenant}.
        """
        now = self._clock.seconds()
        total = max(0.0, self._decayed(tenant.name, now) + tokens)
        if total < 0.5:
            self._served.pop(tenant.name, None)
        else:
            self._served[tenant.name] = (total, now)

    def share(self, tenant: Tenant) -> float:
        """
        @return: C{tenant}'s tokens served lately divided by its weight:
            lower goes first within a priority.
        """
        return self._decayed(tenant.name, self._clock.seconds()) / tenant.weight

    def _decayed(self, name: str, now: float) -> float:
        held = self._served.get(name)
        if held is None:
            return 0.0
        tokens, since = held
        return tokens * math.exp(-self._rate * max(0.0, now - since))


T = TypeVar("T")


class FairQueue(Generic[T]):
    """
    One room's waiting requests, taken by priority, then fair share,
    then arrival (or by arrival alone with C{fifo}).

    @param shares: the tokens served lately (shared by the rooms).
    @param fifo: first come, first served, whatever the tenants.
    """

    def __init__(self, shares: FairShare, fifo: bool = False) -> None:
        self._shares = shares
        self._fifo = fifo
        self._entries: dict[int, tuple[Tenant, T]] = {}
        self._seq = count()

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[T]:
        return (item for _, item in self._entries.values())

    def push(self, tenant: Tenant, item: T) -> None:
        """
        C{item} waits, for C{tenant}.
        """
        self._entries[next(self._seq)] = (tenant, item)

    def remove(self, item: T) -> bool:
        """
        @return: whether C{item} waited (it no longer does).
        """
        for seq, (_, held) in self._entries.items():
            if held is item:
                del self._entries[seq]
                return True
        return False

    def pop(self) -> tuple[Tenant, T]:
        """
        @return: the next to go on, and its tenant.
        @raise IndexError: none waits.
        """
        if not self._entries:
            raise IndexError("pop from an empty FairQueue")
        if self._fifo:
            seq = min(self._entries, key=lambda s: (is_batch(self._entries[s][0]), s))
        else:
            share = self._shares_now()
            seq = min(
                self._entries,
                key=lambda s: (
                    -self._entries[s][0].rank,
                    share(self._entries[s][0]),
                    s,
                ),
            )
        return self._entries.pop(seq)

    def ahead(self, tenant: Tenant) -> int:
        """
        @return: how many waiting requests would go before a new one of
            C{tenant} (all of them with C{fifo}).
        """
        if self._fifo:
            if is_batch(tenant):
                return len(self._entries)
            return sum(1 for other, _ in self._entries.values() if not is_batch(other))
        share = self._shares_now()
        mine = share(tenant)
        return sum(
            1
            for other, _ in self._entries.values()
            if other.rank > tenant.rank
            or (other.rank == tenant.rank and share(other) <= mine)
        )

    def _shares_now(self) -> Callable[[Tenant], float]:
        """
        @return: each tenant's share at one instant, computed once per
            tenant: read at different instants, the decay made the same
            tenant's later entries look served less, and its newest went
            first.
        """
        seen: dict[Tenant, float] = {}

        def share(tenant: Tenant) -> float:
            if tenant not in seen:
                seen[tenant] = self._shares.share(tenant)
            return seen[tenant]

        return share

    def victim(self, tenant: Tenant) -> T | None:
        """
        The room is full and a request of C{tenant} comes: the lowest
        priority's newest request is refused first.

        @return: the waiting request to refuse in the newcomer's stead
            (remove it), or L{None} to refuse the newcomer (it is of the
            lowest priority waiting, or the order is C{fifo} and no batch
            line waits or the newcomer is one).
        """
        if not self._entries:
            return None
        if self._fifo:
            if is_batch(tenant):
                return None
            lines = [s for s, (t, _) in self._entries.items() if is_batch(t)]
            return self._entries[max(lines)][1] if lines else None
        seq = min(self._entries, key=lambda s: (self._entries[s][0].rank, -s))
        lowest, item = self._entries[seq]
        if lowest.rank >= tenant.rank:
            return None
        return item


def retry_from_rate(
    released: Callable[[], tuple[int, float]], ahead: int, fallback: int
) -> int:
    """
    @param released: how many requests the room let go lately and over
        how many seconds.
    @param ahead: requests that would go before the one refused.
    @param fallback: seconds when the room let none go lately.
    @return: whole seconds for C{Retry-After}, at least 1: the time the
        room takes to let C{ahead} + 1 requests go at its recent rate.
    """
    n, seconds = released()
    if n < 2 or seconds <= 0:
        return fallback
    return max(1, math.ceil((ahead + 1) * seconds / n))


__all__ = [
    "ANONYMOUS",
    "BATCH_RANK",
    "HALF_LIFE",
    "PRIORITIES",
    "FairQueue",
    "FairShare",
    "Tenant",
    "check_weight",
    "is_batch",
    "priority_rank",
    "retry_from_rate",
]
