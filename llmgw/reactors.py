"""
The reactor interfaces llmgw's parts take, where one Twisted interface is
not enough: each an intersection of Twisted's own, in this one module, a
leaf every package may import.  A part takes the narrowest that covers
what it calls (L{IReactorTime} alone for a clock); only a daemon's
C{tap.py} holds the whole reactor (L{IDaemonReactor}, from
L{global_reactor}).

These are zope interfaces, not C{typing.Protocol}s: mypy-zope checks them
by name, so a reactor typed with an intersection is accepted wherever one
of its parts is asked for.
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


class IConnectingReactor(IReactorTCP, IReactorTime):
    """
    What a L{twisted.internet.endpoints.HostnameEndpoint} or a
    L{twisted.web.client.Agent} needs: TCP connections, and timers for
    their timeouts and pools.
    """


class ISpawningReactor(IReactorTime, IReactorProcess):
    """
    What a supervisor of child processes needs: spawning them, and timers
    for restarts and kills.
    """


class IEngineReactor(IConnectingReactor, IReactorProcess):
    """
    What the agent's engine supervisor needs: engine processes, their
    health checks over HTTP, timers.
    """


class IAgentReactor(IEngineReactor, IReactorThreads):
    """
    What the agent's uplink needs: its supervisor's, and a thread pool for
    NVML and the weights scan.
    """


class ISignalReactor(IReactorCore, IReactorFromThreads):
    """
    What a stop that a second signal does not interrupt needs: shutdown
    triggers (L{IReactorCore}) and a log line from a signal handler
    (L{IReactorFromThreads}).
    """


class ILeaderReactor(IReactorCore, IReactorTime, IReactorThreads):
    """
    What the leader lock among servers needs: the lock's calls in a thread
    pool, timers, and stopping the process when leadership is lost.
    """


class IThreadedClockReactor(IReactorTime, IReactorFromThreads):
    """
    What a part fed from a library's own thread needs: calls brought back
    to the reactor's thread, and timers (the span exporter's log lines and
    its bounded stop).
    """


class IDaemonReactor(
    IAgentReactor,
    ISpawningReactor,
    ILeaderReactor,
    ISignalReactor,
    IThreadedClockReactor,
    IReactorSocket,
):
    """
    The whole reactor a daemon's wiring hands out, each part taking the
    interfaces above or Twisted's it needs; with L{IReactorSocket}, an
    adopted C{SO_REUSEPORT} socket.  Twisted's default reactor on Linux
    provides them all.
    """


def global_reactor() -> IDaemonReactor:
    """
    @return: the global reactor, installed by twistd before C{makeService}:
        for a daemon's C{tap.py} only.
    """
    from twisted.internet import reactor

    # Twisted types it with the interfaces every reactor has; twistd's
    # default one on Linux provides the others too.
    return cast(IDaemonReactor, reactor)
