"""
The server's end of the agent links: who may connect, Register first, one
link per node, and the inventory kept from what agents say.

Every link the server refuses is told why before it closes (a C{Refused}
message, L{llmgw.wire.refusals}), so that the agent logs the reason on its
node.  A second agent for a node whose link is alive is refused: it may
take over only once that link has been silent for C{unreachable_after}
(an agent connecting again, by its C{agent_instance}, replaces its own
link at once).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet.defer import Deferred, fail
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Factory, connectionDone
from twisted.logger import Logger
from twisted.protocols.policies import TimeoutMixin
from twisted.python.failure import Failure

from llmgw import __version__
from llmgw.control.inventory import Inventory, Node
from llmgw.control.repeats import Repeats
from llmgw.wire import agent_pb2 as pb
from llmgw.wire import versions
from llmgw.wire.codec import DEFAULT_MAX_FRAME_SIZE
from llmgw.wire.protocol import CommandingStream, MessageTooLarge
from llmgw.wire.refusals import Refusal, refused
from llmgw.wire.states import ShardState
from llmgw.wire.tls import peer_common_name

HEARTBEAT_INTERVAL = 5


class NoLink(Exception):
    """
    A command for a node whose agent is not connected.
    """


class TooOld(Exception):
    """
    A command the node's agent is too old for (L{versions.COMMANDS}): never
    sent, since it would go unanswered.
    """


class LinkListener(Protocol):
    """
    What the control plane hears from the agent links.
    """

    def node_registered(self, node_id: str, register: pb.Register) -> None:
        """
        An agent registered (first or again), listing the shards it runs.
        """

    def shard_status(self, node_id: str, status: pb.ShardStatus) -> None:
        """
        A shard on C{node_id} changed state.
        """


class AgentLink(TimeoutMixin, CommandingStream):
    """
    One agent connection.  It must send Register within
    C{register_timeout} seconds; unless links are insecure, the node id it
    claims must be its certificate's CN; and no other agent may hold a
    live link for that node (L{AgentHub.taken_by}).

    @ivar heard_at: when anything last arrived on it, the hub clock's
        seconds (its connection, at first).
    @ivar instance: the C{agent_instance} of its Register.
    """

    log = Logger()

    def __init__(self, hub: AgentHub) -> None:
        super().__init__(hub.max_frame_size)
        self._hub = hub
        self.node_id: str | None = None
        self.attached_at = 0.0
        # Closing (refused, timed out, or replaced by a newer link): what
        # still arrives on it (retransmitted after a cut link healed) is
        # stale, and changes nothing.
        self.closing = False
        self._register_timer: IDelayedCall | None = None
        self.heard_at = 0.0
        self.instance = ""
        # The protocol version the agent's Register said: commands it lacks
        # are never sent (AgentHub.send).
        self.protocol = versions.UNSAID
        self._claim: str | None = None

    def attached(self, now: float) -> None:
        """
        Its hub took it as its node's link at C{now} (reactor seconds).
        """
        self.attached_at = now

    def connectionMade(self) -> None:
        self.heard_at = self._hub.clock.seconds()
        self._register_timer = self._hub.clock.callLater(
            self._hub.register_timeout, self._register_late
        )

    def _register_late(self) -> None:
        self._register_timer = None
        self._refuse(
            Refusal.REGISTER_TIMEOUT,
            "no Register within {timeout}s",
            timeout=self._hub.register_timeout,
        )

    def _refuse(self, code: Refusal, why: str, **fields: Any) -> None:
        """
        Log why the link is refused (at most once a minute for one code,
        certificate and claim: L{llmgw.control.repeats}), tell the agent (a
        C{Refused} with the same sentence, its certificate's CN and its
        claim), and close.

        @param why: a PEP 3101 template of C{fields}.
        """
        cn = peer_common_name(self.transport)
        repeats = self._hub.repeats.admit((code, cn, self.node_id or self._claim))
        if repeats is not None:
            self.log.warn(
                "refusing agent connection from {peer}: " + why + "{repeats}",
                peer=self._peer(),
                repeats=repeats,
                **fields,
            )
        self.tell(code, why.format(**fields))
        self.close()

    def tell(self, code: Refusal, reason: str) -> None:
        """
        Send the agent a C{Refused} (before a close), unless the link is
        closing already.
        """
        if self.closing or self.transport is None:
            return
        message = refused(
            code, reason, peer_common_name(self.transport), self.node_id or self._claim
        )
        try:
            self.send(message)
        except MessageTooLarge:
            # A peer that claimed a frame maximum this small is told
            # nothing; the close goes ahead.
            pass

    def violated(self, reason: str) -> None:
        self.tell(Refusal.BAD_FRAME, reason)

    def close(self) -> None:
        """
        Stop listening to this link at once, and close it: a link whose
        peer went silent may take long to close (its unsent data waits on
        a cut path), and nothing it delivers meanwhile counts.
        """
        self.closing = True
        if self.node_id is not None:
            self._hub.detach(self)
        if self.transport is not None:
            self.transport.loseConnection()

    def _peer(self) -> str:
        if self.transport is None:
            return "?"
        address = self.transport.getPeer()
        return f"{getattr(address, 'host', address)}:{getattr(address, 'port', '')}"

    def timeoutConnection(self) -> None:
        self.log.warn(
            "refusing agent connection from {peer}: node {node} silent for {seconds}s",
            peer=self._peer(),
            # A link replaced by a newer one is no longer the node's.
            node=self.node_id or self._claim,
            seconds=self.timeOut,
        )
        # No Refused: nothing reaches a peer this silent, and the abort
        # below would discard it.
        self.close()
        # Silent: its path may be cut, and a graceful close would wait
        # on it for minutes.
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def dataReceived(self, data: bytes) -> None:
        if self.closing:
            return
        self.resetTimeout()  # type: ignore[no-untyped-call]
        self.heard_at = self._hub.clock.seconds()
        if self.node_id is not None:
            self._hub.inventory.heard(self.node_id, self._hub.clock.seconds())
        super().dataReceived(data)

    def agent_message_received(self, message: pb.AgentMessage) -> None:
        kind = message.WhichOneof("kind")
        if self.closing:
            return
        if self.node_id is None:
            if kind != "register":
                self._refuse(
                    Refusal.REGISTER_FIRST,
                    "first message was {kind}, not Register",
                    kind=kind,
                )
                return
            self._registered(message.register)
            return
        if kind == "heartbeat":
            self._hub.inventory.heartbeat(
                self.node_id, message.heartbeat, self._hub.wall_clock()
            )
        elif kind == "register":
            if message.register.node_id != self.node_id:
                # The certificate was checked against the first claim only.
                self._refuse(
                    Refusal.NODE_ID_CHANGED,
                    "node {node} sent a Register for {claim}",
                    node=self.node_id,
                    claim=message.register.node_id,
                )
                return
            self._hub.registered(message.register)
        elif kind == "shard_status":
            self._hub.shard_status(self.node_id, message.shard_status)
        elif kind == "weights_report":
            self._hub.inventory.weights(
                self.node_id, message.weights_report, self._hub.wall_clock()
            )

    def _registered(self, register: pb.Register) -> None:
        claim = register.node_id
        self._claim = claim
        if not claim:
            self._refuse(Refusal.NO_NODE_ID, "Register without a node id")
            return
        if not self._hub.insecure:
            cn = peer_common_name(self.transport)
            if cn != claim:
                self._refuse(
                    Refusal.CERTIFICATE_MISMATCH,
                    "certificate CN {cn!r} claims to be node {claim!r}",
                    cn=cn,
                    claim=claim,
                )
                return
        reason = versions.mismatch(register.protocol_version, "agent")
        if reason:
            self._refuse(Refusal.PROTOCOL_VERSION, "{reason}", reason=reason)
            return
        leader = self._hub.redirect()
        if leader is not None:
            # A standby: the agent is told where the leader is, and goes.
            self.log.info(
                "standby: agent {node} redirected to the leader at {leader}",
                node=claim,
                leader=leader or "(none yet)",
            )
            self.send(pb.ControlMessage(redirect=pb.Redirect(leader=leader)))
            self.close()
            return
        self.instance = register.agent_instance
        self.protocol = versions.peer_version(register.protocol_version)
        holder = self._hub.taken_by(claim, self)
        if holder is not None:
            self._refuse(
                Refusal.NODE_TAKEN,
                "node {claim!r} is linked to another agent, from {holder},"
                " heard {silent:.1f}s ago: one agent per node id; this one may"
                " take over once that link is silent for {after:g}s",
                claim=claim,
                holder=holder._peer(),
                silent=self._hub.clock.seconds() - holder.heard_at,
                after=self._hub.unreachable_after,
            )
            return
        if self._register_timer is not None and self._register_timer.active():
            self._register_timer.cancel()
        self._register_timer = None
        self.node_id = claim
        # Both sides keep to the smaller frame maximum.
        self.limit_sent(register.max_frame_size)
        self._hub.attach(self)
        # Heartbeats come every HEARTBEAT_INTERVAL: six missed, the link is
        # dead even if TCP has not noticed.
        self.callLater = self._hub.clock.callLater  # type: ignore[assignment]
        self.setTimeout(self._hub.heartbeat_interval * 6)  # type: ignore[no-untyped-call]
        self.send(
            pb.ControlMessage(
                welcome=pb.Welcome(
                    server_version=__version__,
                    protocol_version=versions.text(),
                    heartbeat_interval_seconds=self._hub.heartbeat_interval,
                    max_frame_size=self._hub.max_frame_size,
                )
            )
        )
        node = self._hub.registered(register)
        self.log.info(
            "agent {node} registered from {peer}: {gpus} GPUs, agent {version},"
            " protocol {protocol}",
            node=claim,
            peer=self._peer(),
            gpus=len(node.gpus),
            version=register.agent_version,
            protocol=register.protocol_version or versions.text(versions.UNSAID),
        )

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._register_timer is not None and self._register_timer.active():
            self._register_timer.cancel()
        self._register_timer = None
        self.setTimeout(None)  # type: ignore[no-untyped-call]
        if self.node_id is not None:
            # Before failing its commands: their errbacks must not find
            # this link still listed for the node.
            self._hub.detach(self)
        super().connectionLost(reason)
        if self.node_id is None:
            if not reason.check(ConnectionDone):
                # A failed TLS handshake ends here: no certificate, one from
                # another CA, or plaintext on the TLS port.  The agent keeps
                # trying: the same failure is logged once a minute.
                message = reason.getErrorMessage()
                repeats = self._hub.repeats.admit(("handshake", message))
                if repeats is not None:
                    self.log.warn(
                        "refused agent connection from {peer}: {reason}{repeats}",
                        peer=self._peer(),
                        reason=message,
                        repeats=repeats,
                    )
            return


class AgentHub(Factory):
    """
    Makes an L{AgentLink} per connection and keeps the current one per
    node: a new connection for a node replaces the old only when it comes
    from the same agent (its C{agent_instance}) or the old has been silent
    for C{unreachable_after}; any other is refused.

    @param clock: for the Register deadline.
    @param inventory: where nodes are recorded.
    @param insecure: accept any claimed node id (plaintext links).
    @param register_timeout: seconds a connection has to send Register.
    @param unreachable_after: seconds of silence after which a node's link
        may be taken over by another agent for that node (C{[control]
        unreachable_after}: the node gets no new placements by then).
    @param wall_clock: POSIX seconds now, for the inventory's
        C{last_seen} and C{weights_at}.
    @param listener: told each Register and shard status (the control
        plane, through the dashboard's failure tap), or L{None} until
        L{listen} names one.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        inventory: Inventory,
        insecure: bool = False,
        register_timeout: float = 10.0,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        heartbeat_interval: int = HEARTBEAT_INTERVAL,
        wall_clock: Callable[[], float] = time.time,
        unreachable_after: float = 15.0,
        listener: LinkListener | None = None,
    ) -> None:
        self.clock = clock
        self.unreachable_after = unreachable_after
        self.heartbeat_interval = max(1, heartbeat_interval)
        self.listener = listener
        self.inventory = inventory
        self.insecure = insecure
        self.register_timeout = register_timeout
        self.max_frame_size = max_frame_size
        self.links: dict[str, AgentLink] = {}
        self.wall_clock = wall_clock
        # Registers from nodes known before (agents that came back).
        self.reconnects = 0
        # The refusals' warnings, each reason at most once a minute.
        self.repeats = Repeats(clock)
        # None while this server leads (or stands alone); on a standby, the
        # leader's agent address to send a registering agent to ("" when
        # none leads yet).
        self._leader: Callable[[], str | None] = lambda: None

    def listen(self, listener: LinkListener) -> None:
        """
        Tell C{listener} each Register and shard status from now on (one
        built after the hub, as the control plane that sends through it is).
        """
        self.listener = listener

    def redirect(self) -> str | None:
        """
        Asked at each Register.

        @return: L{None} to accept it (this server leads), else the
            leader's C{HOST:PORT} (empty: unknown), sent in a Redirect
            before the link closes.
        """
        return self._leader()

    def follow(self, leader: Callable[[], str]) -> None:
        """
        A standby: each agent that registers is sent to C{leader()}, the
        leader's agent address (C{""} while none is known).
        """
        self._leader = leader

    def lead(self) -> None:
        """
        This server leads: Registers are accepted.
        """
        self._leader = lambda: None

    def stop_leading(self) -> None:
        """
        This server no longer leads and knows no leader: each agent that
        registers is sent away with an empty Redirect.
        """
        self._leader = lambda: ""

    def registered(self, register: pb.Register) -> Node:
        """
        Record a Register in the inventory and tell the listener; a node
        known before counts as a reconnect.
        """
        if self.inventory.get(register.node_id) is not None:
            self.reconnects += 1
        node = self.inventory.register(
            register, self.wall_clock(), self.clock.seconds()
        )
        if self.listener is not None:
            self.listener.node_registered(register.node_id, register)
        return node

    def shard_status(self, node_id: str, status: pb.ShardStatus) -> None:
        """
        A shard changed state: logged, and told the listener (the control
        plane), its output cut to 50 lines of 500 characters.  A C{note}
        (the engine refused sleep mode and runs without it; its GPU memory
        after a wake is not what placement expects) is logged as a warning
        and passed on, cut to 1000 characters; its start's phases, to 20
        of 64-character names.
        """
        kept = pb.ShardStatus(
            shard_id=status.shard_id[:200],
            exit_code=status.exit_code,
            has_exit_code=status.has_exit_code,
            error=status.error[:1000],
            output_tail=[line[:500] for line in status.output_tail[-50:]],
            pid=status.pid,
            note=status.note[:1000],
            phases=[
                pb.StartPhase(name=p.name[:64], seconds=p.seconds, detail=p.detail)
                for p in status.phases[:20]
            ],
        )
        kept.state = status.state
        status = kept
        if self.listener is not None:
            self.listener.shard_status(node_id, status)
        name = ShardState.from_pb(status.state) or "unspecified"
        if status.note:
            self.log.warn(
                "shard {shard} on {node}: {note}",
                shard=status.shard_id,
                node=node_id,
                note=status.note,
            )
        if status.state == pb.SHARD_STATE_FAILED:
            self.log.warn(
                "shard {shard} on {node}: {state}: {error}; last output: {tail}",
                shard=status.shard_id,
                node=node_id,
                state=name,
                error=status.error,
                tail=" | ".join(status.output_tail[-5:]),
            )
        else:
            self.log.info(
                "shard {shard} on {node}: {state}",
                shard=status.shard_id,
                node=node_id,
                state=name,
            )

    def send(self, node_id: str, message: pb.ControlMessage) -> Deferred[Any]:
        """
        Send a command to C{node_id}'s agent.

        @return: see L{CommandingStream.send_command}; fails at once with
            L{NoLink} when the node has no link now, with L{TooOld} (never
            sent) when its agent's protocol version lacks the command's
            feature (L{versions.COMMANDS}).
        """
        link = self.links.get(node_id)
        if link is None or link.transport is None:
            return fail(NoLink(f"node {node_id} has no link"))
        feature = versions.COMMANDS.get(message.WhichOneof("kind") or "")
        if feature is not None and not versions.supports(link.protocol, feature):
            lacks = versions.lacks(link.protocol, feature, "agent")
            return fail(TooOld(f"node {node_id}: {lacks}"))
        return link.send_command(message)

    def buildProtocol(self, addr: Any) -> AgentLink:
        return AgentLink(self)

    def taken_by(self, node_id: str, link: AgentLink) -> AgentLink | None:
        """
        @return: the live link of another agent that holds C{node_id},
            which C{link} may not replace; L{None} when there is none, when
            it is C{link}'s own agent's (the same C{agent_instance}) or when
            it has been silent for C{unreachable_after}.
        """
        current = self.links.get(node_id)
        if current is None or current is link or current.closing:
            return None
        if link.instance and link.instance == current.instance:
            return None
        if self.clock.seconds() - current.heard_at >= self.unreachable_after:
            return None
        return current

    def attach(self, link: AgentLink) -> None:
        assert link.node_id is not None
        link.attached(self.clock.seconds())
        old = self.links.get(link.node_id)
        self.links[link.node_id] = link
        if old is not None and old is not link:
            silent = self.clock.seconds() - old.heard_at
            if link.instance and link.instance == old.instance:
                self.log.info(
                    "agent {node} connected again: closing its previous link",
                    node=link.node_id,
                )
            else:
                self.log.warn(
                    "agent {node} from {peer} takes over from the link from"
                    " {old_peer}, silent for {silent:.1f}s",
                    node=link.node_id,
                    peer=link._peer(),
                    old_peer=old._peer(),
                    silent=silent,
                )
                old.tell(
                    Refusal.REPLACED,
                    f"node {link.node_id!r} was silent for {silent:.1f}s: another"
                    " agent took over",
                )
            old.closing = True
            old.node_id = None
            if old.transport is not None:
                old.transport.loseConnection()

    def detach(self, link: AgentLink) -> None:
        assert link.node_id is not None
        if self.links.get(link.node_id) is link:
            del self.links[link.node_id]
            self.inventory.link_lost(link.node_id)
            self.log.info("agent {node} disconnected", node=link.node_id)
