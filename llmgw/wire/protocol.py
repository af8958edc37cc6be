"""
The thin Twisted protocol over the frame codec, and command correlation.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from google.protobuf.message import DecodeError, Message
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionLost
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.wire import agent_pb2 as pb
from llmgw.wire.codec import (
    DEFAULT_MAX_FRAME_SIZE,
    FrameDecoder,
    FrameError,
    encode_frame,
)

M = TypeVar("M", bound=Message)

# The ControlMessage fields that are commands (not welcome, redirect,
# refused).
_COMMANDS = (
    "start_shard",
    "stop_shard",
    "remove_weights",
    "sleep_shard",
    "wake_shard",
)


class MessageTooLarge(FrameError):
    """
    A message to send serializes to more than the frame maximum in force:
    it is not sent (the peer would close the link on it).

    @ivar kind: the message type and what it holds, such as
        C{"AgentMessage.weights_report"}.
    """

    def __init__(self, kind: str, size: int, max_frame_size: int) -> None:
        super().__init__(size, max_frame_size)
        self.kind = kind
        self.args = (
            f"{kind} of {size} bytes is over the frame maximum of"
            f" {max_frame_size} bytes: not sent",
        )

    def __str__(self) -> str:
        return str(self.args[0])


def describe(message: Message) -> str:
    """
    @return: the message's type, and the field its C{kind} oneof holds if
        it has one: C{"ControlMessage.start_shard"}.
    """
    name = type(message).__name__
    try:
        kind = message.WhichOneof("kind")
    except ValueError:
        kind = None
    return f"{name}.{kind}" if kind else name


class CommandFailed(Exception):
    """
    The agent answered a command with C{ok = false}.

    @ivar result: the C{pb.CommandResult}, whose C{error} says why.
    """

    def __init__(self, result: pb.CommandResult) -> None:
        super().__init__(result.error or "command failed")
        self.result = result


class MessageStream(Protocol, Generic[M]):
    """
    Frames in, messages of one type out to L{message_received}; L{send}
    frames a message out.  A frame of zero or too many bytes, or one that is
    not a valid message, closes the connection with a log line that names
    the size.

    @param incoming: the message class the peer sends.
    @param max_frame_size: the largest frame accepted or sent, bytes (the
        largest sent can be lowered to the peer's: L{limit_sent}).
    """

    log = Logger()

    def __init__(
        self, incoming: type[M], max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    ) -> None:
        self._incoming = incoming
        self._max = max_frame_size
        self._max_sent = max_frame_size
        self._decoder = FrameDecoder(max_frame_size)
        self._closing = False

    def dataReceived(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            frames = self._decoder.feed(data)
        except FrameError as e:
            self._violation("{error}", error=str(e), size=e.size)
            return
        for frame in frames:
            message = self._incoming()
            try:
                message.ParseFromString(frame)
            except DecodeError:
                self._violation(
                    "a frame of {size} bytes is not a {kind}",
                    size=len(frame),
                    kind=self._incoming.__name__,
                )
                return
            self.message_received(message)
            if self._closing:
                return

    def _violation(self, template: str, **fields: object) -> None:
        self._closing = True
        peer = self.transport.getPeer() if self.transport is not None else None
        self.log.error(
            "closing the connection from {peer}: " + template, peer=peer, **fields
        )
        if self.transport is not None:
            self.violated(template.format(**fields))
            self.transport.loseConnection()

    def violated(self, reason: str) -> None:
        """
        Called once the peer broke the framing, just before the connection
        is closed (nothing more is read from it); override to tell the
        peer why.

        @param reason: what was wrong, such as C{"frame of 0 bytes: empty"}.
        """

    @property
    def max_sent(self) -> int:
        """
        The largest frame L{send} writes, bytes: the smaller of this side's
        maximum and the peer's, once known.
        """
        return self._max_sent

    def limit_sent(self, peer_max_frame_size: int) -> None:
        """
        Keep to the peer's frame maximum too, when it is smaller than this
        side's.

        @param peer_max_frame_size: bytes; 0 (unsaid) changes nothing.
        """
        if peer_max_frame_size > 0:
            self._max_sent = min(self._max, peer_max_frame_size)

    def send(self, message: Message) -> None:
        """
        Frame C{message} and write it, after checking its size against
        L{max_sent}.

        @raise MessageTooLarge: the message serializes to more than
            L{max_sent}; nothing was written.
        """
        assert self.transport is not None
        payload = message.SerializeToString()
        if len(payload) > self._max_sent:
            raise MessageTooLarge(describe(message), len(payload), self._max_sent)
        self.transport.write(encode_frame(payload, self._max_sent))

    def message_received(self, message: M) -> None:
        """
        Called with each message from the peer; override.
        """


class CommandTracker:
    """
    Outstanding commands by C{command_id}: each L{send} returns a Deferred
    that the matching C{pb.CommandResult} fires, and all of them fail when
    the connection is lost (L{fail_all}).
    """

    def __init__(self) -> None:
        self._next_id = 1
        self._pending: dict[int, Deferred[pb.CommandResult]] = {}
        self._closed: Failure | None = None

    def prepare(self, message: pb.ControlMessage) -> Deferred[pb.CommandResult]:
        """
        Give the command in C{message} the next C{command_id}.

        @param message: a C{pb.ControlMessage} holding a command (not a
            welcome).
        @return: fires with the C{pb.CommandResult} when the agent answers
            C{ok}, fails with L{CommandFailed} when it answers not C{ok}, or
            with the reason the connection was lost.
        @raise ValueError: C{message} holds no command.
        """
        kind = message.WhichOneof("kind")
        if kind not in _COMMANDS:
            raise ValueError(f"not a command: {kind}")
        command_id = self._next_id
        self._next_id += 1
        getattr(message, kind).command_id = command_id
        waiting: Deferred[pb.CommandResult] = Deferred()
        if self._closed is not None:
            # The connection is gone: nothing will ever answer.
            waiting.errback(self._closed)
            return waiting
        self._pending[command_id] = waiting
        return waiting

    def forget(self, message: pb.ControlMessage, reason: Failure) -> None:
        """
        Fail the command in C{message} (prepared, never sent) with
        C{reason}.
        """
        kind = message.WhichOneof("kind")
        command_id = getattr(message, kind).command_id if kind else 0
        waiting = self._pending.pop(command_id, None)
        if waiting is not None:
            waiting.errback(reason)

    @property
    def outstanding(self) -> int:
        """
        Commands sent and not yet answered.
        """
        return len(self._pending)

    def result_received(self, result: pb.CommandResult) -> bool:
        """
        Fire the command C{result} answers.

        @return: whether a command was waiting for it.
        """
        waiting = self._pending.pop(result.command_id, None)
        if waiting is None:
            return False
        if result.ok:
            waiting.callback(result)
        else:
            waiting.errback(CommandFailed(result))
        return True

    def fail_all(self, reason: Failure | None = None) -> None:
        """
        Fail every outstanding command, with C{reason} or L{ConnectionLost}.
        """
        pending, self._pending = self._pending, {}
        failure = reason if reason is not None else Failure(ConnectionLost())
        self._closed = failure
        for waiting in pending.values():
            waiting.errback(failure)


class CommandingStream(MessageStream[pb.AgentMessage]):
    """
    The server's side of one agent link: receives C{pb.AgentMessage}, sends
    commands whose results come back as Deferreds.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        super().__init__(pb.AgentMessage, max_frame_size)
        self.commands = CommandTracker()

    def send_command(self, message: pb.ControlMessage) -> Deferred[pb.CommandResult]:
        """
        Send a command; see L{CommandTracker.prepare} for what fires.  A
        command over the frame maximum fails with L{MessageTooLarge}, the
        link untouched.
        """
        waiting = self.commands.prepare(message)
        if not waiting.called:
            try:
                self.send(message)
            except MessageTooLarge:
                self.commands.forget(message, Failure())
        return waiting

    def message_received(self, message: pb.AgentMessage) -> None:
        if message.WhichOneof("kind") == "command_result":
            if not self.commands.result_received(message.command_result):
                self.log.warn(
                    "result for unknown command {command_id}",
                    command_id=message.command_result.command_id,
                )
            return
        self.agent_message_received(message)

    def agent_message_received(self, message: pb.AgentMessage) -> None:
        """
        Called with every message but command results; override.
        """

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.commands.fail_all(reason)
