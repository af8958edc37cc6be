"""
Outlier ejection for answers (after Envoy's outlier detection,
C{consecutive_5xx}, growing ejection time and a cap on ejected hosts:
envoyproxy.io, "Outlier detection"): a replica whose answers fail (5xx, or
a deadline passed waiting for it) this many times in a row sits out a
cooldown that doubles with each ejection in a row; when it ends, one
request (the half-open probe) goes to it, and its outcome brings the
replica back or ejects it again.  A replica is never ejected when that
would leave one of its models with none.
"""

from __future__ import annotations

from dataclasses import dataclass

# The longest cooldown, in base cooldowns (10 s base: 640 s at most).
MAX_DOUBLINGS = 6


@dataclass
class Health:
    """
    One replica's answer record.

    @ivar failures: failed answers in a row since the last good one.
    @ivar ejections: ejections in a row (the next cooldown is the base
        times 2 to this power); 0 when healthy.
    @ivar probing: the half-open probe is in flight.
    """

    failures: int = 0
    ejections: int = 0
    probing: bool = False

    def half_open(self) -> bool:
        """
        @return: whether the replica was ejected for its answers and waits
            for a probe (its cooldown is over, no probe is in flight).
        """
        return self.ejections > 0 and not self.probing


def cooldown(base: float, ejections: int) -> float:
    """
    @param ejections: ejections in a row, this one included (at least 1).
    @return: seconds the replica sits out: C{base}, then twice as long each
        time, up to C{base * 2 ** MAX_DOUBLINGS}.
    """
    return base * float(2 ** min(ejections - 1, MAX_DOUBLINGS))


def verdict(
    health: Health, failed: bool | None, eject_after: int, others_left: bool
) -> int:
    """
    Record an answer's outcome.

    @param failed: L{True} for a 5xx or a deadline, L{False} for an answer,
        L{None} when it says nothing of the replica (the client left, the
        connection broke before an answer).
    @param eject_after: failures in a row that eject (0: never).
    @param others_left: whether every model of the replica keeps another
        replica in service if this one goes.
    @return: the number of ejections in a row when the replica is to be
        ejected now (see L{cooldown}), -1 when it is back in service after
        an ejection, else 0.
    """
    probe, health.probing = health.probing, False
    if failed is None:
        return 0
    if not failed:
        health.failures = 0
        if health.ejections:
            # Its probe, or a request sent while all were out.
            health.ejections = 0
            return -1
        return 0
    health.failures += 1
    if probe or (eject_after and health.failures >= eject_after):
        if not others_left:
            return 0
        health.failures = 0
        health.ejections += 1
        return health.ejections
    return 0


def outcome(status: int | None, expired: bool, client_gone: bool) -> bool | None:
    """
    What an attempt says of its replica, for L{verdict}.

    @param status: the replica's answer status, or L{None} when none came.
    @param expired: a deadline passed.
    @param client_gone: the client left (then nothing is learnt).
    """
    if client_gone:
        return None
    if expired:
        return True
    return None if status is None else status >= 500
