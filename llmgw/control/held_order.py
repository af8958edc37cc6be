"""
The order of the swap queue's models (issue 22 item 1), for
L{llmgw.control.swaps}' C{_held_order} to sort by: models holding requests
first; among them, those whose oldest request was passed over for
C{swap_max_wait} (oldest first, whatever their priority, so that no
request waits unbounded), then the highest priority held
(L{llmgw.router.routing.fairness}: a priority's number, higher goes first, which
the waiting request carries in L{ModelCatalog.activate}), then the oldest
held.  Pure: the control plane imports nothing of the router.
"""

from __future__ import annotations


def held_order(
    oldest: float | None, top_rank: int | None = None, overdue: bool = False
) -> tuple[int, int, int, float]:
    """
    @param oldest: clock time the model's oldest held request began to
        wait, or L{None} when it holds none.
    @param top_rank: the highest priority number among its held requests,
        or L{None} when unknown (all count as C{standard}, 1).
    @param overdue: its oldest held request was passed over for
        C{swap_max_wait}.
    @return: a sort key, lower first (the rank kept an integer: a
        priority may be any integer, past a float's range).
    """
    if oldest is None:
        return (1, 0, 0, 0.0)
    if overdue:
        return (0, 0, 0, oldest)
    return (0, 1, -(1 if top_rank is None else top_rank), oldest)
