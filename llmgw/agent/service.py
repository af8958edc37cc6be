"""
The agent's service: its uplink to the server, reconnecting forever, and
what it reports; built the same for C{twistd llmgw-agent} and for the
agent inside C{llmgw-server --local}.

The uplink is a L{ClientService} on the reactor's clock whose connection
counts only once registered: its C{prepareConnection} waits for the
server's Welcome, so a link the server closes before welcoming (a refused
certificate or node id) is a failed attempt and the backoff keeps growing,
while a link lost after its Welcome starts the backoff again from the
first delay.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IProtocol, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from llmgw import __version__
from llmgw.agent.gpus import GpuMonitor, Nvml, discover
from llmgw.agent.link import AgentFactory, AgentProtocol
from llmgw.agent.settings import (
    AgentConfig,
    agent_state_dir,
    node_ram_bytes,
    sleep_memory_bytes,
)
from llmgw.agent.shard import Shard
from llmgw.agent.state_lock import StateLock, hold_state_dir
from llmgw.reactors import IAgentReactor
from llmgw.wire import agent_pb2 as pb
from llmgw.wire import versions

log = Logger(namespace="llmgw.agent")


class _Gate(Protocol):
    """
    Between L{ClientService}'s protocol and the endpoint: a link lost before
    its Welcome is told to the agent's protocol only, whose C{registered}
    fails (the attempt failed: C{prepareConnection}'s answer); a link lost
    after, to L{ClientService} too (a connection ended).  L{ClientService}
    has no transition for a connection lost while it prepares it.
    """

    def __init__(self, outer: IProtocol, agent: AgentProtocol) -> None:
        self.outer = outer
        self._agent = agent

    def makeConnection(self, transport: Any) -> None:
        self.transport = transport
        self.connected = True
        self.outer.makeConnection(transport)

    def dataReceived(self, data: bytes) -> None:
        self.outer.dataReceived(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.connected = False
        if self._agent.welcomed:
            self.outer.connectionLost(reason)
        else:
            self._agent.connectionLost(reason)


class _GateFactory(Factory):
    noisy = False

    def __init__(self, outer: Any, agents: AgentFactory) -> None:
        self._outer = outer
        self._agents = agents

    def buildProtocol(self, addr: Any) -> Protocol | None:
        outer = self._outer.buildProtocol(addr)
        agent = self._agents.current
        if outer is None or agent is None:
            return None
        return _Gate(outer, agent)


@implementer(IStreamClientEndpoint)
class _Uplink:
    """
    The endpoint the uplink dials through: picks the server (the one last
    registered with or named by a standby first, else the next of the
    list, in turn), puts the L{_Gate} in, and says why a connection to the
    server failed, naming it (L{ClientService}'s own line names only the
    endpoint object).

    @param dial: the endpoint of a C{HOST:PORT} (TLS wrapped around it, or
        not).
    @param servers: C{HOST:PORT} of each server, at least one.
    """

    def __init__(
        self, dial: Callable[[str], Any], servers: Sequence[str], agents: AgentFactory
    ) -> None:
        self._dial = dial
        self._servers = list(servers)
        self._next = 0
        self._agents = agents

    def connect(self, factory: Any) -> Deferred[Any]:
        server = self._agents.take_hint()
        if server in self._servers:
            # Should it fail, the turn goes on from the server after it.
            self._next = self._servers.index(server) + 1
        elif server is None:
            server = self._servers[self._next % len(self._servers)]
            self._next += 1
        self._agents.dialed(server)

        def failed(reason: Failure) -> Failure:
            log.warn(
                "cannot connect to the server at {server}: {reason}",
                server=server,
                reason=reason.getErrorMessage(),
            )
            return reason

        try:
            endpoint = self._dial(server)
        except Exception as e:
            # A standby named an address this agent cannot dial.
            return fail(e).addErrback(failed)
        d: Deferred[Any] = endpoint.connect(_GateFactory(factory, self._agents))
        # ClientService is given back the protocol its factory built.
        return d.addCallbacks(lambda gate: gate.outer, failed)

    def __repr__(self) -> str:
        return f"<llmgw servers at {', '.join(self._servers)}>"


def retry_policy(servers: int, agents: AgentFactory) -> Callable[[int], float]:
    """
    The uplink's waits between attempts: from 0.5 s (1 s with one server)
    to 30 s, doubling per round of the C{servers} servers, plus up to 1 s
    of jitter so that a fleet does not dial back in lockstep; 0.1 s after
    a standby's Redirect.

    @return: seconds before the next attempt, given the failed attempts
        in a row (from 1).
    """
    backoff = backoffPolicy(initialDelay=0.5, maxDelay=30.0, factor=2.0)

    def policy(attempt: int) -> float:
        if agents.redirected:
            return 0.1
        if servers <= 1:
            return backoff(attempt)
        return backoff((attempt - 1) // servers)

    return policy


def _registered(protocol: Any) -> Deferred[None]:
    """
    C{prepareConnection}: the link counts once the server welcomed it.
    """
    d: Deferred[None] = Deferred()

    def told(result: object) -> object:
        if isinstance(result, Failure):
            d.errback(result)
        else:
            d.callback(None)
        return result

    protocol.registered.addBoth(told)
    return d


class AgentService(ClientService):
    """
    The uplink; on stop it aborts the connection at once, so the agent ends
    within seconds even while a write to the server is stuck.

    @param factory: the agent's factory; its C{current} protocol is the one
        aborted.
    @param dial: the endpoint of a server's C{HOST:PORT} (TLS wrapped
        around it, or not).
    @param servers: C{HOST:PORT} of each server (see L{_Uplink}).
    @param clock: the reactor (its clock times the retries).
    @param state_lock: the agent's hold on its state directory, whose file
        is given this process's pid at start (twistd may have forked
        since it was taken).
    """

    def __init__(
        self,
        factory: AgentFactory,
        dial: Callable[[str], Any],
        servers: Sequence[str],
        clock: Any,
        state_lock: StateLock | None = None,
    ) -> None:
        super().__init__(
            _Uplink(dial, servers, factory),
            factory,
            retryPolicy=retry_policy(len(servers), factory),
            clock=clock,
            prepareConnection=_registered,
        )
        self._agent_factory = factory
        self.state_lock = state_lock

    def startService(self) -> None:
        if self.state_lock is not None:
            self.state_lock.note_pid()
        super().startService()

    def stopService(self) -> Deferred[None]:
        protocol = self._agent_factory.current
        if protocol is not None and protocol.transport is not None:
            protocol.transport.abortConnection()  # type: ignore[attr-defined]
        return super().stopService()


def _engine_memory(
    nvml: Nvml, in_thread: Callable[[Callable[[], Any]], Deferred[Any]]
) -> Callable[[Shard], Deferred[float | None]]:
    """
    @return: the GB an engine's processes hold on each of its GPUs, read
        from NVML in a thread (L{Nvml.engine_memory_gb}).
    """

    def held(shard: Shard) -> Deferred[float | None]:
        indices = list(shard.command.gpu_indices)
        return in_thread(lambda: nvml.engine_memory_gb(shard.pid or 0, indices))

    return held


def build_agent(
    reactor: IAgentReactor,
    config: AgentConfig,
    dial: Callable[[str], Any],
    program: str = "llmgw-agent",
) -> tuple[AgentService, AgentFactory]:
    """
    The agent's uplink to the servers of C{config} through C{dial} (a
    server's C{HOST:PORT} to its endpoint, TLS already wrapped around it,
    or not), reconnecting forever (L{retry_policy}); the state directory
    is locked for this process (L{hold_state_dir}), then engines recorded
    in it that still run are adopted.  Blocking (NVML's start): call it
    before the reactor runs.

    @param program: this process, as a second agent on the same state
        directory is told it.
    @return: the service, not started, and the factory whose supervisor
        runs the engines.
    @raise ConfigError: another process holds the state directory; the
        C{sleep_memory} budget is more than the node's RAM.
    """
    # Before anything reads the directory: a second agent adopting the
    # same engines would stop them.
    state_lock = hold_state_dir(agent_state_dir(config), program)
    gpus, nvml = discover(config.node_id, list(config.simulated_gpus))
    page = node_ram_bytes()
    budget = sleep_memory_bytes(config.sleep_memory, page)

    def in_thread(call: Any) -> Deferred[Any]:
        return deferToThreadPool(reactor, reactor.getThreadPool(), call)

    monitor = GpuMonitor(
        gpus,
        nvml,
        in_thread,
        lambda: factory.supervisor.simulated_memory_mib(),
        lambda: frozenset(s.pid for s in factory.supervisor.shards.values() if s.pid),
    )

    def register() -> pb.Register:
        return pb.Register(
            node_id=config.node_id,
            agent_version=__version__,
            protocol_version=versions.text(),
            address=config.address or "127.0.0.1",
            labels=config.labels,
            fabrics=config.fabrics,
            cpus=os.cpu_count() or 1,
            memory_bytes=page,
            sleep_memory_bytes=budget,
            gpus=gpus,
            shards=factory.supervisor.running(),
        )

    factory = AgentFactory(
        register,
        monitor.heartbeat,
        reactor,
        agent_state_dir(config),
        engine_host=config.address or "127.0.0.1",
        weights_dirs=config.weights_dirs,
        in_thread=in_thread,
        node_id=config.node_id,
        gpu_memory=_engine_memory(nvml, in_thread) if nvml is not None else None,
    )
    # Engines outlive the agent: taken back before the first Register.
    adopted = factory.supervisor.adopt_running()
    servers = config.all_servers()
    service = AgentService(factory, dial, servers, reactor, state_lock)
    log.info(
        "llmgw-agent {node}: {gpus} GPUs ({simulated} simulated), {adopted} engines"
        " adopted; dialing {server}",
        adopted=len(adopted),
        node=config.node_id,
        gpus=len(gpus),
        simulated=sum(1 for g in gpus if g.simulated),
        server=", ".join(servers),
    )
    return service, factory
