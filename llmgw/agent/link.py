"""
The agent's end of the link: Register on connect, heartbeats, answers to
commands.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.protocol import Factory, connectionDone
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.wire import agent_pb2 as pb
from llmgw.wire.protocol import MessageStream

# What the agent cannot do yet answers every command (issue 3 items 6-7:
# engine adapters and the supervisor are still to come).
_NO_ENGINES = "this agent does not start, stop or drain engines yet"


class AgentProtocol(MessageStream[pb.ControlMessage]):
    """
    Sends Register when connected, heartbeats every interval the server's
    Welcome names, and a CommandResult for every command.

    @param register: builds the Register message (the whole inventory).
    @param heartbeat: builds a Heartbeat message.
    """

    log = Logger()

    def __init__(
        self,
        register: Callable[[], pb.Register],
        heartbeat: Callable[[], pb.Heartbeat],
        clock: object,
    ) -> None:
        super().__init__(pb.ControlMessage)
        self._register = register
        self._heartbeat = heartbeat
        self._clock = clock
        self._beat: LoopingCall | None = None

    def connectionMade(self) -> None:
        self.send(pb.AgentMessage(register=self._register()))

    def message_received(self, message: pb.ControlMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "welcome":
            interval = message.welcome.heartbeat_interval_seconds or 5
            self.log.info(
                "registered with llmgw-server {version}; heartbeat every {interval}s",
                version=message.welcome.server_version,
                interval=interval,
            )
            if self._beat is None:
                self._beat = LoopingCall(self._send_heartbeat)
                self._beat.clock = self._clock  # type: ignore[assignment]
                self._beat.start(interval, now=False)
            return
        if kind is None:
            return
        command_id = getattr(message, kind).command_id
        self.send(
            pb.AgentMessage(
                command_result=pb.CommandResult(
                    command_id=command_id, ok=False, error=_NO_ENGINES
                )
            )
        )

    def _send_heartbeat(self) -> None:
        self.send(pb.AgentMessage(heartbeat=self._heartbeat()))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._beat is not None and self._beat.running:
            self._beat.stop()
        self._beat = None
        factory = self.factory
        if isinstance(factory, AgentFactory) and factory.current is self:
            factory.current = None
        self.log.info(
            "link to the server lost: {reason}", reason=reason.getErrorMessage()
        )


class AgentFactory(Factory):
    """
    Builds the L{AgentProtocol} of each connection the agent dials.
    """

    def __init__(
        self,
        register: Callable[[], pb.Register],
        heartbeat: Callable[[], pb.Heartbeat],
        clock: object,
    ) -> None:
        self._register = register
        self._heartbeat = heartbeat
        self._clock = clock

        self.current: AgentProtocol | None = None

    def buildProtocol(self, addr: object) -> AgentProtocol:
        protocol = AgentProtocol(self._register, self._heartbeat, self._clock)
        protocol.factory = self
        self.current = protocol
        return protocol
