"""
The reactor a daemon's C{tap.py} hands to what it builds: the global one,
typed as the intersection of the interfaces its parts need.  Library code
takes one of those interfaces (L{IReactorTime} for a clock, L{IReactorTCP}
to connect...), never this one.
"""

from __future__ import annotations

from typing import cast

from twisted.internet.interfaces import (
    IReactorCore,
    IReactorFromThreads,
    IReactorProcess,
    IReactorSocket,
    IReactorTCP,
    IReactorThreads,
    IReactorTime,
)


class ISignalReactor(IReactorCore, IReactorFromThreads):
    """
    What a stop that a second signal does not interrupt needs: shutdown
    triggers (L{IReactorCore}) and a log line from a signal handler
    (L{IReactorFromThreads}).
    """


class IDaemonReactor(
    ISignalReactor,
    IReactorTime,
    IReactorTCP,
    IReactorSocket,
    IReactorProcess,
    IReactorThreads,
):
    """
    What a daemon's wiring uses of its reactor: running and stopping
    (L{IReactorCore}), timers (L{IReactorTime}), TCP connections and
    listeners (L{IReactorTCP}), an adopted C{SO_REUSEPORT} socket
    (L{IReactorSocket}), the router workers' processes (L{IReactorProcess})
    and calls from the store's and Redis' threads (L{IReactorThreads}).
    Twisted's default reactor on Linux provides them all.
    """


def global_reactor() -> IDaemonReactor:
    """
    @return: the global reactor, installed by twistd before C{makeService}.
    """
    from twisted.internet import reactor

    # The module stands for the reactor twistd installed: mypy sees a module.
    return cast(IDaemonReactor, reactor)
