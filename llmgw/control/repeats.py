"""
Warnings that repeat: the server's refusals of agent links.  An agent
refused for a mistake of its operator (another CA's certificate, another
node's, a node id already linked) retries with a growing delay and is
refused again each time, for as long as the mistake stays: one warning
per attempt said the same thing seven times in 68 s of a trial.  Here a
reason is logged at once, then at most once per C{interval}, that line
saying how many like it were not logged since the last.

Pure, on an injected clock: no timer, so nothing is left to cancel at a
stop; the count of the last suppressed lines waits for the next one of
their reason (the agent's own log, told by its C{Refused} or its failed
handshake, has every attempt's outcome).
"""

from __future__ import annotations

from collections.abc import Hashable

from twisted.internet.interfaces import IReactorTime

REPEAT_INTERVAL = 60.0
"""
Seconds between two lines of one reason: an agent's delays between
attempts grow to 30 s (L{llmgw.agent.service}), so a mistake left alone
costs one line a minute, and a new one shows at once.
"""

MAX_REASONS = 1024
"""
Reasons remembered at once; past it, those whose interval ended are
forgotten (a peer that varies its claims cannot grow the table without
bound; at worst it gets a line per attempt, as before).
"""


class Repeats:
    """
    Which lines of a repeating warning to log.

    @param clock: the reactor's time.
    @param interval: seconds between two lines of one reason.
    """

    def __init__(self, clock: IReactorTime, interval: float = REPEAT_INTERVAL) -> None:
        self._clock = clock
        self.interval = interval
        # Reason -> [when its last line was logged (clock seconds), lines
        # not logged since].
        self._seen: dict[Hashable, list[float]] = {}

    def admit(self, reason: Hashable) -> str | None:
        """
        One more occurrence of C{reason}.

        @param reason: what makes two occurrences the same, such as a
            refusal's code with the certificate's CN and the node id
            claimed.
        @return: L{None} when its line is not to be logged now; else the
            text to end it with: C{""} when none was held back since the
            last, else C{" (N more like it in the last S s, not logged)"}.
        """
        now = self._clock.seconds()
        seen = self._seen.get(reason)
        if seen is not None and now - seen[0] < self.interval:
            seen[1] += 1
            return None
        if seen is None and len(self._seen) >= MAX_REASONS:
            self._forget(now)
        held = 0 if seen is None else int(seen[1])
        since = 0.0 if seen is None else now - seen[0]
        self._seen[reason] = [now, 0]
        if not held:
            return ""
        return f" ({held} more like it in the last {since:.0f}s, not logged)"

    def _forget(self, now: float) -> None:
        for reason, (at, _) in list(self._seen.items()):
            if now - at >= self.interval:
                del self._seen[reason]
        if len(self._seen) >= MAX_REASONS:
            self._seen.clear()
