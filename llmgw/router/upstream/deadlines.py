"""
A request's phase deadlines on an injected clock: the whole request
(C{total}), and one phase at a time (C{first_byte}, then C{idle} between
chunks).  C{connect} is kept by the upstream client's endpoint; it is named
here so that its 504 reads like the others.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from llmgw.router.errors import APIError, deadline_exceeded

FIRST_BYTE_TOKENS = 8192
"""
Tokens the C{first_byte_timeout} is for: a request the engine must read
(and, for an answer not streamed, write) more of before its first byte gets
the timeout once per this many (L{first_byte_seconds}).
"""


def first_byte_seconds(timeout: float, prompt: int, answer: int = 0) -> float:
    """
    The first-byte deadline of one request, scaled to its size: an engine
    prefills a prompt at a rate (tokens a second), so a prompt of 60,000
    tokens needs about seven times the time of one of 8,192; and an answer
    that is not streamed comes whole, after its last token.

    @param timeout: C{[router] first_byte_timeout}, seconds; 0 is no
        deadline.
    @param prompt: the prompt's tokens, estimated.
    @param answer: tokens the engine writes before its first byte: the
        request's C{max_tokens} when it does not stream, else 0.
    @return: seconds: C{timeout} for up to L{FIRST_BYTE_TOKENS} tokens, in
        proportion beyond.
    """
    return timeout * max(1.0, (prompt + answer) / FIRST_BYTE_TOKENS)


class Deadlines:
    """
    The timers of one request.  A duration of 0 turns that deadline off.

    @param clock: the reactor's clock.
    @param on_expire: called with no argument when a deadline passes (the
        exchange cancels what it waits for).
    @param connect: seconds to connect to a replica.
    @param first_byte: seconds from sending to the replica's first byte
        (L{first_byte_seconds} of the request).
    @param idle: seconds between two chunks of the replica's answer.
    @param total: seconds for the whole request.
    @ivar expired: the phase whose deadline passed, or L{None}.
    """

    def __init__(
        self,
        clock: IReactorTime,
        on_expire: Callable[[], None],
        connect: float,
        first_byte: float,
        idle: float,
        total: float,
    ) -> None:
        self._clock = clock
        self._on_expire = on_expire
        self._seconds = {
            "connect": connect,
            "first_byte": first_byte,
            "idle": idle,
            "total": total,
        }
        self.expired: str | None = None
        self._phase: IDelayedCall | None = None
        self._phase_name = ""
        self._phase_seconds = 0.0
        self._paused = False
        self._total: IDelayedCall | None = None

    def start_total(self) -> None:
        """
        Start the deadline of the whole request.
        """
        total = self._seconds["total"]
        if total > 0:
            self._total = self._clock.callLater(total, self._expire, "total")

    def start(self, phase: str) -> None:
        """
        Start C{phase} (C{"first_byte"} or C{"idle"}), ending the one
        before.
        """
        if self._phase is not None and self._phase.active():
            self._phase.cancel()
        self._phase = None
        self._phase_name = phase
        seconds = self._phase_seconds = self._seconds[phase]
        if seconds > 0 and not self._paused:
            self._phase = self._clock.callLater(seconds, self._expire, phase)

    def pause(self) -> None:
        """
        llmgw itself stopped reading the replica (a slow client holds it
        back): the current phase measures the replica, so it stops until
        L{resume}.  The whole request's deadline runs on.
        """
        self._paused = True
        if self._phase is not None and self._phase.active():
            self._phase.cancel()
        self._phase = None

    def resume(self) -> None:
        """
        llmgw reads the replica again: the current phase starts over.
        """
        if not self._paused:
            return
        self._paused = False
        if self.expired is None and self._phase_name and self._phase_seconds > 0:
            self._phase = self._clock.callLater(
                self._phase_seconds, self._expire, self._phase_name
            )

    def touch(self) -> None:
        """
        Bytes came: the current phase starts over (C{idle} between chunks).
        """
        if self._phase is not None:
            self._phase.reset(self._phase_seconds)

    def _expire(self, phase: str) -> None:
        if phase == "total":
            self._total = None
        else:
            self._phase = None
        self.expired = phase
        self._on_expire()

    def error(self) -> APIError:
        """
        @return: the 504 for the deadline that passed.
        """
        assert self.expired is not None
        seconds = (
            self._phase_seconds
            if self.expired in ("first_byte", "idle")
            else self._seconds[self.expired]
        )
        return deadline_exceeded(self.expired, seconds)

    def stop(self) -> None:
        """
        Cancel the timers still pending.
        """
        for timer in (self._phase, self._total):
            if timer is not None and timer.active():
                timer.cancel()
        self._phase = self._total = None
        self._phase_name = ""
