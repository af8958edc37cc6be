"""
A stream's backpressure: between the client's connection and the replica's.

When the client reads slower than the replica writes, the client's transport
pauses its producer (Twisted's C{FileDescriptor} does so once more than
C{bufferSize}, 64 KiB, waits to be sent, and resumes it once all of it went
out).  The producer here passes that on to the replica's connection, so the
replica is held back instead of filling memory, and stops the replica's
deadline meanwhile (L{llmgw.router.upstream.deadlines.Deadlines.pause}): the replica
is not late while llmgw does not read it.

A client that reads nothing at all would then hold the replica for ever; so
while paused the client's progress is watched, and after C{stall_timeout}
seconds without any, C{on_stall} is called (the exchange cuts the client).
Progress is the client's unsent backlog changing (bytes leaving for the
client, L{unsent_bytes}); where the backlog cannot be read, a pause as long
as C{stall_timeout} counts as none.
"""

from __future__ import annotations

import fcntl
import struct
import termios
from collections.abc import Callable

from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.web.iweb import IRequest
from zope.interface import implementer

from llmgw.router.upstream.deadlines import Deadlines


def _kernel_unsent(descriptor: object) -> int | None:
    # Linux's SIOCOUTQ (the same number as TIOCOUTQ): bytes in the socket's
    # send queue, not yet acknowledged by the peer (tcp(7)).
    fileno = getattr(descriptor, "fileno", None)
    if fileno is None or not hasattr(termios, "TIOCOUTQ"):
        return None
    try:
        answer = fcntl.ioctl(fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError, TypeError):
        return None
    value: int = struct.unpack("i", answer)[0]
    return value


def unsent_bytes(transport: object) -> tuple[int, int | None] | None:
    """
    How much written to a client has not reached it yet: a value that
    changes when the client reads (the kernel's queue drains, or Twisted's
    buffer moves into it) and stays while it reads nothing.  Twisted's
    buffer alone cannot tell: the kernel takes more only once a third of
    its send buffer (megabytes on loopback) is free.

    @param transport: a client's transport (a TCP connection, or TLS or
        HTTP/2 over one).
    @return: the bytes in Twisted's buffer of the C{FileDescriptor} under
        C{transport} and those in its socket's send queue (L{None} where the
        system cannot tell); L{None} when there is no such descriptor.
    """
    for _ in range(4):
        if transport is None:
            return None
        buffer = getattr(transport, "dataBuffer", None)
        if isinstance(buffer, bytes):
            offset = getattr(transport, "offset", 0)
            queued = getattr(transport, "_tempDataLen", 0)
            if isinstance(offset, int) and isinstance(queued, int):
                return len(buffer) - offset + queued, _kernel_unsent(transport)
            return None
        transport = getattr(transport, "transport", None)
    return None


def abort_client(request: IRequest) -> str:
    """
    Close a client's connection now, without waiting for what is unsent to
    go (its client does not read it).

    @return: the client's address, C{host:port}, for a log line.
    """
    address = request.getClientAddress()
    host, port = getattr(address, "host", None), getattr(address, "port", None)
    channel = getattr(request, "channel", None)
    # HTTP/2 streams abort themselves; HTTP/1.1 channels through their
    # transport.
    abort = getattr(channel, "abortConnection", None)
    if abort is None:
        abort = getattr(getattr(channel, "transport", None), "abortConnection", None)
    if abort is not None:
        abort()
    return f"{host}:{port}" if host is not None else str(address)


@implementer(IPushProducer)
class Backpressure:
    """
    The producer registered on a client's request while a replica's stream
    is relayed to it.

    @param clock: the reactor's clock.
    @param upstream: the replica's connection, paused and resumed in turn.
    @param deadlines: the request's deadlines, stopped while paused.
    @param stall_timeout: seconds a paused client may make no progress; 0
        for no limit.
    @param progress: a value that changes when the client reads (see
        L{unsent_bytes}), or L{None} when none can be read.
    @param on_stall: called once, with no argument, when the client made
        no progress for C{stall_timeout} seconds.
    @ivar paused: whether the client holds the replica back now.
    """

    def __init__(
        self,
        clock: IReactorTime,
        upstream: IPushProducer,
        deadlines: Deadlines,
        stall_timeout: float,
        progress: Callable[[], object],
        on_stall: Callable[[], None],
    ) -> None:
        self._clock = clock
        self._upstream = upstream
        self._deadlines = deadlines
        self._stall_timeout = stall_timeout
        self._progress = progress
        self._on_stall = on_stall
        self._timer: IDelayedCall | None = None
        self._seen: object = None
        self._since = 0.0
        self.paused = False
        self._stopped = False

    def pauseProducing(self) -> None:
        if self._stopped:
            return
        self.paused = True
        self._upstream.pauseProducing()
        self._deadlines.pause()
        if self._stall_timeout > 0 and self._timer is None:
            self._seen = self._progress()
            self._since = self._clock.seconds()
            self._timer = self._clock.callLater(self._interval(), self._check)

    def resumeProducing(self) -> None:
        if self._stopped:
            return
        self.paused = False
        self._cancel()
        self._upstream.resumeProducing()
        self._deadlines.resume()

    def stopProducing(self) -> None:
        self.stop()
        self._upstream.stopProducing()

    def stop(self) -> None:
        """
        The relay ended: no more calls through, and no timer left.
        """
        self._stopped = True
        self._cancel()

    def _interval(self) -> float:
        # A few looks per stall_timeout: a client is cut within a quarter
        # of it past the limit.
        return self._stall_timeout / 4

    def _cancel(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _check(self) -> None:
        self._timer = None
        now = self._clock.seconds()
        seen = self._progress()
        if seen is not None and seen != self._seen:
            self._seen = seen
            self._since = now
        if now - self._since >= self._stall_timeout:
            self._stopped = True
            self._on_stall()
            return
        self._timer = self._clock.callLater(self._interval(), self._check)
