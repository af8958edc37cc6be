"""
C{Server-Timing} (W3C Server Timing, U{https://www.w3.org/TR/server-timing/})
on every answer of the router: C{llmgw;dur=} the milliseconds the router
itself took until the answer's head went out (the total less the
replica's), and, when a replica answered, C{replica;dur=} the milliseconds
from sending the request to it until its answer came: its whole body for
a whole answer, its first byte of events for a stream (whose head goes
out with that byte, before the rest exists).  Only the last attempt's
replica counts; earlier attempts are the router's time.
"""

from __future__ import annotations


def server_timing(total: float, replica: float | None) -> bytes:
    """
    @param total: seconds from the request's arrival to its answer's head.
    @param replica: seconds the replica took (see the module), or L{None}
        when none answered.
    @return: the header's value, e.g. C{b"llmgw;dur=1.2, replica;dur=340.5"}
        (milliseconds, to the tenth).
    """
    total = max(0.0, total)
    if replica is None:
        return b"llmgw;dur=%.1f" % (total * 1000)
    replica = min(max(0.0, replica), total)
    return b"llmgw;dur=%.1f, replica;dur=%.1f" % (
        (total - replica) * 1000,
        replica * 1000,
    )
