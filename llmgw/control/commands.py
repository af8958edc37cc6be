"""
Commands to agents about shards: C{StartShard} for a placed replica,
C{StopShard}, and what a refused or unanswered start means for the
shard's record.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any, Protocol

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from llmgw.control.agents import NoLink, TooOld
from llmgw.control.placement import Plan
from llmgw.control.records import ReplicaRecord, ShardRecord
from llmgw.control.snapshot import Strays, SuspectPorts
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.engines import SLEEP_LEVELS, share_args
from llmgw.wire.protocol import CommandFailed
from llmgw.wire.states import ShardState

STOP_GRACE = 30
"""
Seconds between SIGTERM and SIGKILL when the control plane stops a shard.
"""

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _safe(text: str, limit: int = 40) -> str:
    return _UNSAFE.sub("-", text).strip("-._")[:limit] or "model"


class Commands(Protocol):
    """
    How the control plane reaches agents: L{llmgw.control.agents.AgentHub}.
    """

    def send(self, node_id: str, message: pb.ControlMessage) -> Deferred[Any]:
        """
        Send a command to a node's agent.

        @return: fires when the agent answers ok; fails when it refuses, or
            when the node has no link.
        """


class ShardCommands:
    """
    Sends shard commands and records what their answers say.

    @param clock: the reactor's clock, for L{SuspectPorts}.
    @param commands: the agents.
    @param suspect: where a port found in use is marked.
    @param changed: called when a record changed (a start failed): kicks
        a pass.
    @param engine_key: a shard id's engine secret (C{StartShard.api_key},
        the router's C{Endpoint.api_key}); C{""} for none.
    @param strays: where engines that may run on unrecorded are kept.
    """

    log = Logger()

    def __init__(
        self,
        clock: IReactorTime,
        commands: Commands,
        suspect: SuspectPorts,
        changed: Callable[[], None],
        engine_key: Callable[[str], str] = lambda shard_id: "",
        strays: Strays | None = None,
    ) -> None:
        self.clock = clock
        self.commands = commands
        self.suspect = suspect
        self.changed = changed
        self.engine_key = engine_key
        self.strays = strays if strays is not None else Strays()

    def start(
        self, model: str, plan: Plan, now: float, leader_address: str
    ) -> ReplicaRecord:
        """
        Make a replica of C{model} as C{plan} says, and send each of its
        shards its start.

        @param now: reactor seconds.
        @param leader_address: C{host:port} where a gang's ranks meet, on
            rank 0's address; C{""} when unknown.
        @return: the new replica, its shards C{pending}.
        """
        profile = plan.profile
        replica = ReplicaRecord(
            f"{_safe(model)}-{secrets.token_hex(4)}",
            model,
            profile,
            [],
            now,
            rendezvous_port=plan.rendezvous_port,
        )
        for shard_plan in plan.shards:
            shard = ShardRecord(
                id=f"{replica.id}-{shard_plan.rank}",
                node=shard_plan.node,
                gpus=shard_plan.gpus,
                port=shard_plan.port,
                rank=shard_plan.rank,
                share=shard_plan.share,
            )
            replica.shards.append(shard)
            command = pb.StartShard(
                shard_id=shard.id,
                replica_id=replica.id,
                model=replica.model,
                profile=profile.name,
                engine=profile.engine,
                source=profile.source,
                # Its share first: the profile's own args may say otherwise.
                args=(
                    share_args(profile.engine, shard_plan.share)
                    if shard_plan.share
                    else ()
                )
                + profile.args,
                env=dict(profile.env),
                port=shard.port,
                gpu_indices=shard.gpus,
                rank=shard.rank,
                world_size=len(plan.shards),
                leader_address=leader_address,
                api_key=self.engine_key(shard.id),
                sleep_level=SLEEP_LEVELS.get(profile.sleep, 0),
                gpu_memory_gb=profile.gpu_memory_gb,
                sleep_gpu_memory_gb=profile.sleep_gpu_memory_gb,
                gpu_share=shard_plan.share,
            )
            d = self.commands.send(shard.node, pb.ControlMessage(start_shard=command))
            shard.sent_at = self.clock.seconds()
            d.addErrback(self._start_refused, shard)
        self.log.info(
            "placed replica {replica} of {model} with profile {profile} on {where}",
            replica=replica.id,
            model=model,
            profile=profile.name,
            where=", ".join(
                f"{s.node} GPUs {list(s.gpus)} port {s.port}" for s in plan.shards
            ),
        )
        return replica

    def _start_refused(self, reason: Failure, shard: ShardRecord) -> None:
        if shard.state.gone:
            return
        if isinstance(reason.value, CommandFailed):
            result = reason.value.result
            if result.code == "port_in_use":
                # Something else holds the port on that node: the next
                # try gets another.
                self.suspect.mark(shard.node, shard.port, self.clock.seconds())
            elif result.code == "gpus_in_use":
                # An engine the server does not know of holds them: left
                # alone until it is gone (or for as long as it may live).
                now = self.clock.seconds()
                self.strays.add(shard.node, shard.id, shard.gpus, 0, now)
            # A port or GPUs found taken are facts for placement, not the
            # model's failure: tried again at once, elsewhere.
            shard.misplaced = result.code in ("port_in_use", "gpus_in_use")
            shard.error = result.error
        elif reason.check(NoLink):
            # Never sent: nothing runs.
            shard.error = f"not started: {reason.getErrorMessage()}"
        else:
            # The link went down with the command unanswered: the engine may
            # run.  The node's next Register says (listed: kept; not listed:
            # gone), and start_timeout bounds the wait.
            self.log.info(
                "start of shard {shard} on {node} unanswered: {why}; waiting for"
                " the node to register again",
                shard=shard.id,
                node=shard.node,
                why=reason.getErrorMessage(),
            )
            return
        shard.state = ShardState.FAILED
        self.changed()

    def stop(
        self, node_id: str, shard_id: str, forgotten: ShardRecord | None = None
    ) -> None:
        """
        Send C{StopShard}: SIGTERM, SIGKILL after L{STOP_GRACE}.  A stop
        not done is logged; a lost node's shards are stopped when its
        agent registers again and finds them unclaimed.

        @param forgotten: the record of the shard, when the records drop
            it now: its GPUs and port stay taken (L{Strays}) until it is
            gone.
        """
        if forgotten is not None:
            now = self.clock.seconds()
            self.strays.add(node_id, shard_id, forgotten.gpus, forgotten.port, now)
        d = self.commands.send(
            node_id,
            pb.ControlMessage(
                stop_shard=pb.StopShard(shard_id=shard_id, grace_seconds=STOP_GRACE)
            ),
        )

        def failed(reason: Failure) -> None:
            if not reason.check(CancelledError):
                self.log.info(
                    "stop of shard {shard} on {node} not done: {why}",
                    shard=shard_id,
                    node=node_id,
                    why=reason.getErrorMessage(),
                )

        d.addErrback(failed)

    def sleep(
        self, node_id: str, shard_id: str, level: int, shard: ShardRecord | None = None
    ) -> Deferred[pb.CommandResult]:
        """
        Send C{SleepShard}: the agent calls the engine's sleep route
        (vLLM C{POST /sleep?level=N}, SGLang C{/release_memory_occupation})
        and reports the shard C{sleeping} once the engine answered.

        @param level: 1 (weights kept in host memory) or 2 (discarded), as
            L{SLEEP_LEVELS} numbers a profile's C{sleep}.
        @param shard: the shard's record: once the agent answers C{ok} it
            is C{sleeping} (as the agent's C{ShardStatus}, sent before its
            answer, says), unless it is gone by then.
        @return: fires with the agent's C{pb.CommandResult}, never fails:
            C{ok}; or not, with C{code} C{"sleep_refused"} (the engine
            refused: C{error} is its answer), C{"no_link"} (never sent),
            C{"too_old"} (never sent: the agent's protocol lacks sleep,
            L{llmgw.wire.versions.SLEEP}),
            C{"unanswered"} (the link went down first), or another code
            the agent gave.
        @raise ValueError: C{level} is not 1 or 2.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        message = pb.ControlMessage(
            sleep_shard=pb.SleepShard(shard_id=shard_id, level=level)
        )
        return self._answered(
            "sleep", node_id, shard_id, message, shard, ShardState.SLEEPING
        )

    def wake(
        self, node_id: str, shard_id: str, shard: ShardRecord | None = None
    ) -> Deferred[pb.CommandResult]:
        """
        Send C{WakeShard}: the agent reports the shard C{waking}, calls the
        engine's wake route (vLLM C{POST /wake_up}, SGLang
        C{/resume_memory_occupation}), and reports it C{ready} once the
        engine answered.

        @param shard: the shard's record: C{ready} once the agent answers
            C{ok}, unless it is gone by then.
        @return: as for L{sleep} (a refusal's C{code} is the agent's).
        """
        message = pb.ControlMessage(wake_shard=pb.WakeShard(shard_id=shard_id))
        return self._answered(
            "wake", node_id, shard_id, message, shard, ShardState.READY
        )

    def _answered(
        self,
        what: str,
        node_id: str,
        shard_id: str,
        message: pb.ControlMessage,
        shard: ShardRecord | None,
        after: ShardState,
    ) -> Deferred[pb.CommandResult]:
        d: Deferred[pb.CommandResult] = self.commands.send(node_id, message)

        def done(result: pb.CommandResult) -> pb.CommandResult:
            if shard is not None and not shard.state.gone:
                shard.state = after
            return result

        def failed(reason: Failure) -> pb.CommandResult:
            if isinstance(reason.value, CommandFailed):
                result: pb.CommandResult = reason.value.result
            elif reason.check(NoLink):
                result = pb.CommandResult(
                    ok=False, code="no_link", error=reason.getErrorMessage()
                )
            elif reason.check(TooOld):
                result = pb.CommandResult(
                    ok=False, code="too_old", error=reason.getErrorMessage()
                )
            else:
                result = pb.CommandResult(
                    ok=False,
                    code="unanswered",
                    error=f"{what} unanswered: {reason.getErrorMessage()}",
                )
            self.log.info(
                "{what} of shard {shard} on {node} not done: {code}: {why}",
                what=what,
                shard=shard_id,
                node=node_id,
                code=result.code or "error",
                why=result.error,
            )
            return result

        d.addCallbacks(done, failed)
        return d
