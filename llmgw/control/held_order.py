"""
The order of the swap queue's models (issue 22 item 1), for
L{llmgw.control.swaps}' C{_held_order} to sort by: models holding requests
first; among them, those whose oldest request was passed over for
C{swap_max_wait} (oldest first, whatever their priority, so that no
request waits unbounded), then the highest priority held
(L{llmgw.router.routing.fairness}: a priority's number, higher goes first, which
the waiting request carries in L{ModelCatalog.activate}), then the oldest
held.  Pure: the control plane imports nothing of the router.

A model whose held requests are all batch lines (L{batch_only}: the
router's L{BATCH_RANK}) goes after every model holding a client's request,
and is never passed over for C{swap_max_wait}: batch work waits for room
the fleet has free, and never makes any (L{llmgw.control.swaps} evicts
nothing for it).  Such models keep the order of their oldest line among
them, so that the lines of one model go together, as its held requests do.

And the order a starting model's first places go in (L{release_turns}): the
requests held for it across the fleet (the server's own router and every
router of a tier, whose activations the server answers) by priority, then
arrival; and which of them is refused first when the fleet holds more
than the model's bound (L{refused_first}): the lowest priority's newest,
the same rule as one router's full activation queue
(L{llmgw.router.routing.activation.ActivationQueues.make_room}).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.router.interfaces import BATCH_RANK


def batch_only(top_rank: int | None) -> bool:
    """
    @param top_rank: the highest priority number among a model's held
        requests, or L{None} when it holds none.
    @return: whether it holds requests and all of them are batch lines
        (L{BATCH_RANK}).
    """
    return top_rank is not None and top_rank <= BATCH_RANK


def held_order(
    oldest: float | None, top_rank: int | None = None, overdue: bool = False
) -> tuple[int, int, int, float]:
    """
    @param oldest: clock time the model's oldest held request began to
        wait, or L{None} when it holds none.
    @param top_rank: the highest priority number among its held requests,
        or L{None} when unknown (all count as C{standard}, 1).
    @param overdue: its oldest held request was passed over for
        C{swap_max_wait} (not heeded for a model holding only batch
        lines).
    @return: a sort key, lower first (the rank kept an integer: a
        priority may be any integer, past a float's range).
    """
    if oldest is None:
        return (1, 0, 0, 0.0)
    if overdue and not batch_only(top_rank):
        return (0, 0, 0, oldest)
    return (0, 1, -(1 if top_rank is None else top_rank), oldest)


def release_turns(held: Sequence[tuple[float, int]]) -> list[list[int]]:
    """
    The order in which the requests held for a model get its first
    places once a replica is ready, the same whichever router holds them
    (the server answers every router's activation, L{ModelCatalog.release}).

    @param held: each held request's arrival (clock seconds, earlier
        first) and priority number (higher first), in the order they
        were held.
    @return: the indices of C{held} in turns, one turn per priority held,
        the highest first; within a turn the oldest first (ties in the
        order held).
    """
    order = sorted(range(len(held)), key=lambda i: (-held[i][1], held[i][0], i))
    turns: list[list[int]] = []
    for index in order:
        if turns and held[turns[-1][0]][1] == held[index][1]:
            turns[-1].append(index)
        else:
            turns.append([index])
    return turns


def refused_first(held: Sequence[tuple[float, int]]) -> int | None:
    """
    Which of the requests held for a model is refused first when the
    fleet holds more of them than the model's bound
    (L{llmgw.control.runtime.ModelCatalog.activate}), whichever router
    holds it: the lowest priority's newest.

    @param held: each held request's arrival (clock seconds) and priority
        number (higher first), in the order they were held.
    @return: the index in C{held} of the request to refuse (of two that
        arrived together, the one held last), or L{None} when none is
        held.
    """
    if not held:
        return None
    return min(range(len(held)), key=lambda i: (held[i][1], -held[i][0], -i))
