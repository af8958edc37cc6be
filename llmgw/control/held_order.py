"""
The order of the swap queue's models by the priority of the requests they
hold (issue 22 item 1), for L{llmgw.control.swaps}' C{_held_order} to sort
by once the activation carries the waiting request's priority: models
holding requests first, the highest priority held first
(L{llmgw.router.fairness}: a priority's number, higher goes first), then
the oldest held.  Pure: the control plane imports nothing of the router.
"""

from __future__ import annotations


def held_order(
    oldest: float | None, top_rank: int | None = None
) -> tuple[float, float, float]:
    """
    @param oldest: clock time the model's oldest held request began to
        wait, or L{None} when it holds none.
    @param top_rank: the highest priority number among its held requests,
        or L{None} when unknown (all count as C{standard}, 1).
    @return: a sort key, lower first: with C{top_rank} left out it orders
        as C{_held_order} does today (held first, the oldest first).
    """
    if oldest is None:
        return (1.0, 0.0, 0.0)
    return (0.0, -float(1 if top_rank is None else top_rank), oldest)
