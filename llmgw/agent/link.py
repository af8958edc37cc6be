"""
The agent's end of the link: Register on connect, heartbeats, answers to
commands, and the server's refusals told to the operator on the node.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from OpenSSL import SSL
from service_identity import VerificationError
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.protocol import Factory, connectionDone
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.agent.engines import CommandRefused
from llmgw.agent.shard import Shard
from llmgw.agent.supervisor import Supervisor
from llmgw.agent.weights import fit_report, remove, scan
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb
from llmgw.wire import versions
from llmgw.wire.codec import DEFAULT_MAX_FRAME_SIZE
from llmgw.wire.protocol import MessageStream, MessageTooLarge
from llmgw.wire.refusals import Refusal
from llmgw.wire.tls import ServerCertificateRefused

WEIGHTS_REPORT_INTERVAL = 60.0


def handshake_failure(reason: Failure, server: str) -> str | None:
    """
    What the operator on the node must read of a TLS handshake that failed:
    no C{Refused} can pass before it, so the agent says it itself.  A
    server certificate this agent refused for its role or its names
    (L{llmgw.wire.tls.ServerCertificateRefused}) is told as its sentence,
    which lists what the certificate holds and the name dialed.

    @param reason: why a link was lost before the server's Welcome.
    @param server: the C{HOST:PORT} dialed.
    @return: the sentence, or L{None} when C{reason} is no handshake
        failure.
    """
    host = server.rsplit(":", 1)[0].strip("[]") or server
    if reason.check(ServerCertificateRefused):
        # Its role or names, with what it holds (llmgw.wire.tls).
        return str(reason.value)
    if reason.check(VerificationError):
        return (
            f"the server's certificate does not name {host}, the host this agent"
            f" dials: make it with llmgw certs server --host {host}"
        )
    if not reason.check(SSL.Error):
        return None
    # pyOpenSSL's errors: [(library, function, reason), ...].
    args = reason.value.args if reason.value is not None else ()
    errors = args[0] if args and isinstance(args[0], list) else []
    detail = "; ".join(str(e[-1]) for e in errors if isinstance(e, tuple) and e)
    detail = detail or str(reason.value)
    if "alert" in detail:
        return (
            f"the server refused this agent's certificate in the TLS handshake"
            f" ({detail}): is it from the fleet's CA? check --tls-dir"
        )
    if "certificate verify failed" in detail:
        return (
            f"this agent does not trust the server's certificate ({detail}):"
            " ca.pem in --tls-dir must be the fleet's CA"
        )
    return f"the TLS handshake with the server failed ({detail})"


class AgentProtocol(MessageStream[pb.ControlMessage]):
    """
    Sends Register when connected, heartbeats every interval the server's
    Welcome names, and a CommandResult for every command.

    @param register: builds the Register message (the whole inventory).
    @param heartbeat: builds a Heartbeat message; it must not block (see
        L{llmgw.agent.gpus.GpuMonitor}).
    @param max_frame_size: the largest frame accepted or sent, bytes; what
        is sent keeps to the server's maximum too, once its Welcome says it.
    """

    log = Logger()

    def __init__(
        self,
        register: Callable[[], pb.Register],
        heartbeat: Callable[[], pb.Heartbeat],
        clock: object,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        super().__init__(pb.ControlMessage, max_frame_size)
        self._register = register
        self._heartbeat = heartbeat
        self._clock = clock
        self._beat: LoopingCall | None = None
        self._weights: LoopingCall | None = None
        # Scans run in threads and may end out of order: each is numbered,
        # and one that ends after a later one was sent is not sent.
        self._scans_started = 0
        self._scan_sent = 0
        # Fires on Welcome; fails if the link is lost before.
        self.registered: Deferred[None] = Deferred()
        self.welcomed = False
        # The server's refusal, when it sent one before closing.
        self.refusal: pb.Refused | None = None

    def connectionMade(self) -> None:
        register = self._register()
        register.max_frame_size = self._max
        if isinstance(self.factory, AgentFactory):
            register.agent_instance = self.factory.instance
        if not self.send_or_log(pb.AgentMessage(register=register)):
            # Without its Register the server would wait and then close.
            assert self.transport is not None
            self.transport.loseConnection()

    def _refused(self, refusal: pb.Refused) -> None:
        # The server closes the link after it; so does the agent, should
        # the server not.
        self.refusal = refusal
        self.factory.note_refusal(refusal)
        if self.transport is not None:
            self.transport.loseConnection()

    def _welcome(self, welcome: pb.Welcome) -> None:
        if not self.registered.called:
            self.welcomed = True
            self.factory.welcomed()
            self.registered.callback(None)
        interval = welcome.heartbeat_interval_seconds or 5
        self.limit_sent(welcome.max_frame_size)
        self.log.info(
            "registered with llmgw-server {version} (protocol {protocol}); heartbeat"
            " every {interval}s; frames up to {max_frame} bytes",
            version=welcome.server_version,
            protocol=welcome.protocol_version or versions.text(versions.UNSAID),
            interval=interval,
            max_frame=self.max_sent,
        )
        if versions.mismatch(welcome.protocol_version, "server"):
            # A server of an older build serves any Register: the agent
            # says what the rule would.
            self.log.warn(
                "llmgw-server {version} speaks protocol {protocol}, this agent"
                " {ours}: more than one minor version apart; upgrade one minor"
                " version at a time, {order}",
                version=welcome.server_version,
                protocol=welcome.protocol_version or versions.text(versions.UNSAID),
                ours=versions.text(),
                order=versions.UPGRADE_ORDER,
            )
        if self._beat is None:
            self._beat = LoopingCall(self._send_heartbeat)
            self._beat.clock = self._clock  # type: ignore[assignment]
            self._beat.start(interval, now=False)
        if self._weights is None and self.factory.weights_dirs:
            self._weights = LoopingCall(self.send_weights)
            self._weights.clock = self._clock  # type: ignore[assignment]
            self._weights.start(WEIGHTS_REPORT_INTERVAL, now=True)

    def _redirect(self, redirect: pb.Redirect) -> None:
        # A standby: dial the leader it names next (or, when it names
        # none, the next server of the list).
        leader = redirect.leader
        self.factory.redirect_to(leader)
        self.log.info(
            "the server is a standby; the leader is {leader}",
            leader=leader or "not chosen yet",
        )
        if self.transport is not None:
            self.transport.loseConnection()

    def send_or_log(self, message: pb.AgentMessage) -> bool:
        """
        Send C{message}; one over the frame maximum is not sent but logged
        as an error naming its type and size (no traceback: the link
        stays).

        @return: whether it was sent.
        """
        try:
            self.send(message)
        except MessageTooLarge as e:
            self.log.error("cannot send to the server: {error}", error=str(e))
            return False
        return True

    def message_received(self, message: pb.ControlMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "refused":
            self._refused(message.refused)
            return
        if kind == "welcome":
            self._welcome(message.welcome)
            return
        if kind == "redirect":
            self._redirect(message.redirect)
            return
        if kind is None:
            return
        command = getattr(message, kind)
        if kind in ("sleep_shard", "wake_shard"):
            self._sleep_or_wake(kind, command)
            return
        error = code = ""
        supervisor = self.factory.supervisor
        try:
            if kind == "start_shard":
                supervisor.start(command)
            elif kind == "stop_shard":
                supervisor.stop(command.shard_id, command.grace_seconds or 30)
            elif kind == "remove_weights":
                removed = remove(
                    self.factory.weights_dirs,
                    list(command.paths),
                    [s.command.source for s in supervisor.shards.values()],
                )
                self.log.info(
                    "removed weights: {paths}", paths=", ".join(removed) or "none"
                )
            else:
                error = f"unknown command {kind}"
        except CommandRefused as e:
            error, code = str(e), e.code
            self.log.warn("{kind} refused: {error}", kind=kind, error=error)
        except Exception as e:
            # Whatever the server sent, it gets an answer and the link stays.
            error = f"cannot {kind.replace('_', ' ')}: {e}"[:1000]
            self.log.failure("{kind} failed", kind=kind)
        self.send_or_log(
            pb.AgentMessage(
                command_result=pb.CommandResult(
                    command_id=command.command_id, ok=not error, error=error, code=code
                )
            )
        )
        if kind == "remove_weights" and not error:
            self.send_weights()

    def _sleep_or_wake(self, kind: str, command: Any) -> None:
        """
        Sleep or wake a shard's engine (L{Supervisor.sleep},
        L{Supervisor.wake}): answered once the engine did, on this link if
        it is still up.
        """
        supervisor = self.factory.supervisor
        if kind == "sleep_shard":
            work = supervisor.sleep(command.shard_id, command.level)
        else:
            work = supervisor.wake(command.shard_id)

        def answer(reason: Failure | None) -> None:
            error = code = ""
            if reason is not None:
                if isinstance(reason.value, CommandRefused):
                    error, code = str(reason.value), reason.value.code
                else:
                    error = f"cannot {kind.replace('_', ' ')}: {reason.value}"[:1000]
                    self.log.failure("{kind} failed", reason, kind=kind)
                self.log.warn("{kind} refused: {error}", kind=kind, error=error)
            if self.transport is not None:
                result = pb.CommandResult(
                    command_id=command.command_id, ok=not error, error=error, code=code
                )
                self.send_or_log(pb.AgentMessage(command_result=result))

        Deferred.fromCoroutine(work).addCallbacks(lambda _: answer(None), answer)

    def send_weights(self) -> Deferred[None]:
        """
        Report the model files in the weights directories, scanned in a
        thread (up to L{MAX_FILES_WALKED} files: seconds, on a slow disk),
        as many as fit in one frame (L{fit_report}): a longer list goes
        truncated, flagged, with its total, and a warning when that begins
        or its total changes.

        @return: fires once sent (or dropped, the link being gone).
        """
        self._scans_started += 1
        number = self._scans_started
        scanned = self.factory.in_thread(lambda: scan(self.factory.weights_dirs))

        def report(files: list[pb.WeightsFile]) -> None:
            if number < self._scan_sent:
                # A later scan (after a removal) was sent already: this
                # one would bring back what it no longer saw.
                return
            self._scan_sent = number
            if self.transport is not None and self.factory.current is self:
                weights = fit_report(files, self.max_sent)
                self.factory.note_truncation(weights)
                self.send_or_log(pb.AgentMessage(weights_report=weights))

        def failed(reason: Failure) -> None:
            self.log.failure("scanning the weights directories", reason)

        done: Deferred[None] = scanned.addCallbacks(report, failed)
        return done

    def _send_heartbeat(self) -> None:
        self.send_or_log(pb.AgentMessage(heartbeat=self._heartbeat()))

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        for loop in (self._beat, self._weights):
            if loop is not None and loop.running:
                loop.stop()
        self._beat = self._weights = None
        factory = self.factory
        if isinstance(factory, AgentFactory):
            factory.lost(self)
        if not self.registered.called:
            # Connected but never welcomed (a refused certificate or node
            # id): the uplink counts a failed attempt, its backoff grows.
            self.registered.errback(reason)
            self.registered.addErrback(lambda _: None)
        if self.refusal is not None:
            self.log.info(
                "link to the server closed: refused ({code})", code=self.refusal.code
            )
            return
        if not self.welcomed and isinstance(factory, AgentFactory):
            failed = handshake_failure(reason, factory.dialing)
            if failed is not None:
                factory.note_handshake_failure(failed)
        self.log.info(
            "link to the server lost: {reason}", reason=reason.getErrorMessage()
        )


class AgentFactory(Factory):
    """
    Builds the L{AgentProtocol} of each connection the agent dials, and
    holds what outlives a connection: the L{Supervisor} of the node's
    engines, and which server to dial next.

    @param state_dir: the agent's state directory (the supervisor's
        records).
    @param engine_host: the interface engines listen on.
    @param weights_dirs: the weights directories, scanned and reported.
    @param in_thread: runs blocking work off the reactor thread.
    @param node_id: named in every engine's marker.
    @param gpu_memory: the GB an engine holds on each of its GPUs (NVML),
        for the supervisor; L{None} without NVML.
    """

    log = Logger()

    def __init__(
        self,
        register: Callable[[], pb.Register],
        heartbeat: Callable[[], pb.Heartbeat],
        clock: IEngineReactor,
        state_dir: str,
        engine_host: str = "127.0.0.1",
        weights_dirs: tuple[str, ...] = (),
        in_thread: Callable[[Callable[[], Any]], Deferred[Any]] | None = None,
        node_id: str = "",
        gpu_memory: Callable[[Shard], Deferred[float | None]] | None = None,
    ) -> None:
        self.weights_dirs = weights_dirs
        # Runs blocking work (the weights scan) off the reactor thread; by
        # default in the caller's thread (tests on a Clock).
        self.in_thread: Callable[[Callable[[], Any]], Deferred[Any]] = (
            in_thread or maybeDeferred
        )
        self._register = register
        self._heartbeat = heartbeat
        self._clock = clock
        self.current: AgentProtocol | None = None
        # The server being dialed, and the one to dial next (the server
        # last registered with, or the leader a standby named), HOST:PORT.
        self.dialing = ""
        self.server_hint: str | None = None
        # A standby just redirected this agent: dial again at once.
        self.redirected = False
        self._truncated_total: int | None = None
        # Sent in every Register: the server tells this agent connecting
        # again from another agent claiming the same node id.
        self.instance = uuid.uuid4().hex
        # The refusals warned of since the last Welcome: each once.
        self._refusals_told: set[tuple[str, str, str]] = set()
        self.supervisor = Supervisor(
            clock,
            self.send_status,
            state_dir,
            engine_host=engine_host,
            node_id=node_id,
            gpu_memory=gpu_memory,
        )

    def send_status(self, status: pb.ShardStatus) -> None:
        """
        Report a shard's transition over the link, when it is up (Register
        carries the shards again after a reconnect).
        """
        if self.current is not None and self.current.transport is not None:
            self.current.send_or_log(pb.AgentMessage(shard_status=status))

    def note_refusal(self, refusal: pb.Refused) -> None:
        """
        Warn of the server's refusal, naming the certificate and the node id
        it saw, once per kind of refusal (its code) of that certificate
        and claim until a Welcome (the uplink retries with a
        growing delay meanwhile, each attempt logged at info).
        """
        # By kind, not by sentence: the sentence may carry a time ("heard
        # 0.8s ago") that differs at each attempt.
        told = (refusal.code, refusal.certificate_name, refusal.node_id)
        if told in self._refusals_told:
            return
        self._refusals_told.add(told)
        what = {
            Refusal.CERTIFICATE_MISMATCH.value: "check --tls-dir and --node-id;"
            " retrying",
            Refusal.NODE_TAKEN.value: "is another agent running with this node"
            " id? retrying",
            Refusal.PROTOCOL_VERSION.value: "this agent speaks protocol"
            f" {versions.text()}; upgrade it or the server; retrying",
        }.get(refusal.code, "retrying")
        self.log.warn(
            "the server at {server} refused this agent: {reason} (certificate"
            " {certificate}, node id {node}); {what}",
            server=self.dialing or "?",
            reason=refusal.reason or refusal.code,
            certificate=repr(refusal.certificate_name)
            if refusal.certificate_name
            else "none",
            node=repr(refusal.node_id) if refusal.node_id else "none",
            code=refusal.code,
            what=what,
        )

    def note_handshake_failure(self, what: str) -> None:
        """
        Warn of a failed TLS handshake (L{handshake_failure}), once per
        sentence until a Welcome.
        """
        told = ("tls", what, "")
        if told in self._refusals_told:
            return
        self._refusals_told.add(told)
        self.log.warn(
            "cannot link to the server at {server}: {what}; retrying",
            server=self.dialing or "?",
            what=what,
        )

    def dialed(self, server: str) -> None:
        """
        The uplink dials C{server} (C{HOST:PORT}): warnings name it, and it
        is dialed first again once it welcomes this agent.
        """
        self.dialing = server

    def take_hint(self) -> str | None:
        """
        @return: the server to dial first (the one last registered with, or
            the leader a standby named), or L{None} for the next of the
            list; taken once, and a standby's redirect with it.
        """
        hint, self.server_hint = self.server_hint, None
        self.redirected = False
        return hint

    def redirect_to(self, leader: str) -> None:
        """
        A standby redirected this agent to C{leader} (C{HOST:PORT}, or
        C{""} when none is chosen yet: the next server of the list): dialed
        next, at once.
        """
        self.server_hint = leader or None
        self.redirected = True

    def welcomed(self) -> None:
        """
        The server welcomed this agent: a later refusal is warned of again,
        and this server is dialed first when the link is lost.
        """
        self._refusals_told.clear()
        self.server_hint = self.dialing

    def lost(self, protocol: AgentProtocol) -> None:
        """
        The link of C{protocol} is lost: commands no longer reach it.
        """
        if self.current is protocol:
            self.current = None

    def note_truncation(self, report: pb.WeightsReport) -> None:
        """
        Warn when the weights report starts being truncated or its total
        changes while it is (not every 60 s), and say when it fits again.
        """
        total = report.total if report.truncated else None
        if total == self._truncated_total:
            return
        self._truncated_total = total
        if total is None:
            self.log.info("the weights report fits in one frame again")
        else:
            self.log.warn(
                "weights directories hold {total} entries; the report to the"
                " server carries the first {sent} (one frame), marked truncated",
                total=total,
                sent=len(report.files),
            )

    def buildProtocol(self, addr: object) -> AgentProtocol:
        protocol = AgentProtocol(self._register, self._heartbeat, self._clock)
        protocol.factory = self
        self.current = protocol
        return protocol
