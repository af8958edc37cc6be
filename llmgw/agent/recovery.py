"""
A restarted agent takes back the engines a previous one started
(L{llmgw.agent.supervisor.Supervisor.adopt_running}): first by their
records, then by their markers (L{llmgw.agent.records.MARKER}) those whose
record was cut short, deleted or unreadable.  Every engine taken back is
listed in the next Register, and the server adopts it when the catalog
still wants it, or stops it (L{llmgw.control.adoption}); meanwhile the
supervisor holds its port and GPUs, so no second engine starts on them.
The supervisor owns the L{Recovery} and hands it what it calls.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from typing import Any

from twisted.logger import Logger

from llmgw.agent.engines import Launch, build
from llmgw.agent.records import (
    PROOF,
    SHARD_ID,
    Marked,
    command_from_json,
    marked,
    process_start_time,
    proven,
    set_aside,
)
from llmgw.agent.shard import Shard
from llmgw.wire import agent_pb2 as pb


class Recovery:
    """
    The engines a previous agent started, taken back: by record, then by
    marker.

    @param shards_dir: where the records are (C{STATE/shards}).
    @param state_dir: the agent's state directory, as markers name it.
    @param engine_host: the interface engines listen on, for a record that
        does not name it.
    @param take: adopts a running engine: its command, launch, pid,
        process start time, whether recorded asleep, the turn recorded, and
        its secret (L{llmgw.agent.supervisor.Supervisor.take}).
    @param held: the shard of an id already held, or L{None}.
    @param record: writes a shard's record again.
    """

    log = Logger()

    def __init__(
        self,
        shards_dir: str,
        state_dir: str,
        engine_host: str,
        take: Callable[[pb.StartShard, Launch, int, int, bool, str, str], Shard],
        held: Callable[[str], Shard | None],
        record: Callable[[Shard], None],
    ) -> None:
        self._shards_dir = shards_dir
        self._state_dir = state_dir
        self._engine_host = engine_host
        self._take = take
        self._held = held
        self._record = record

    def adopt_running(self) -> list[Shard]:
        """
        @return: the shards adopted, by record and by marker.
        """
        adopted = []
        for name in sorted(os.listdir(self._shards_dir)):
            if name.endswith(".json"):
                shard = self._by_record(os.path.join(self._shards_dir, name))
                if shard is not None:
                    adopted.append(shard)
        try:
            found = list(marked(self._state_dir))
        except OSError as e:
            self.log.warn("cannot look for engines by marker: {error}", error=str(e))
            found = []
        for engine in found:
            shard = self._by_marker(engine)
            if shard is not None:
                adopted.append(shard)
        return adopted

    def _usable(self, data: Any, name: str) -> tuple[pb.StartShard, Launch]:
        """
        @param data: a record's JSON value (or a marker's C{record}).
        @param name: the record's file name, C{ID.json}.
        @raise Exception: C{data} is not a record of that shard this agent
            can launch (a bad command, shard id, engine).
        """
        command = command_from_json(data["command"])
        if not SHARD_ID.match(command.shard_id) or name != command.shard_id + ".json":
            raise ValueError(f"shard id {command.shard_id!r}")
        return command, build(command, str(data.get("host", self._engine_host)))

    def _by_record(self, path: str) -> Shard | None:
        try:
            with open(path) as f:
                data = json.load(f)
            command, launch = self._usable(data, os.path.basename(path))
            pid, start_time = int(data["pid"]), int(data["start_time"])
        except Exception as e:
            # A record this agent cannot use (cut short, foreign, from another
            # version) must not keep it from starting, nor be lost: the
            # operator finds it aside, and its engine is found by its marker.
            aside = set_aside(path)
            self.log.warn(
                "unreadable shard record {path} ({error}): kept as {aside}; its"
                " engine, if running, is found by its marker",
                path=path,
                error=str(e),
                aside=aside or "(cannot rename it)",
            )
            return None
        if process_start_time(pid) != start_time:
            self.log.info(
                "shard {shard} (pid {pid}) is gone", shard=command.shard_id, pid=pid
            )
            os.remove(path)
            return None
        turning = data.get("turning")
        secret = data.get("secret")
        shard = self._take(
            command,
            launch,
            pid,
            start_time,
            data.get("sleeping") is True,
            turning if turning in ("sleep", "wake") else "",
            secret if isinstance(secret, str) else "",
        )
        self.log.info(
            "adopted shard {shard}: engine pid {pid} still running",
            shard=shard.id,
            pid=pid,
        )
        return shard

    def _by_marker(self, engine: Marked) -> Shard | None:
        """
        Adopt an engine found by its marker that no record named, and record
        it again, once its proof shows the agent started it (see
        L{llmgw.agent.records.proven}); one without is left alone.  A second
        engine of a shard already adopted, proven, is stopped.
        """
        try:
            shard_id = str(engine.record["command"]["shardId"])
            command, launch = self._usable(engine.record, shard_id + ".json")
        except Exception as e:
            self.log.warn(
                "engine pid {pid} carries a marker this agent cannot use ({error});"
                " left alone",
                pid=engine.pid,
                error=str(e),
            )
            return None
        # The environment is anyone's to copy: only the proof the agent kept
        # when it started the engine makes it ours (never adopted nor
        # stopped otherwise).
        unproven = proven(os.path.join(self._shards_dir, shard_id + PROOF), engine)
        if unproven:
            self.log.warn(
                "pid {pid} carries the marker of shard {shard}, but this agent"
                " cannot prove it started it ({why}): left alone",
                pid=engine.pid,
                shard=shard_id,
                why=unproven,
            )
            return None
        held = self._held(command.shard_id)
        if held is not None:
            if held.pid != engine.pid:
                self.log.warn(
                    "engine pid {pid} is a second engine of shard {shard} (pid"
                    " {held}): stopping it",
                    pid=engine.pid,
                    shard=command.shard_id,
                    held=held.pid,
                )
                try:
                    os.killpg(engine.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            return None
        # Markers are written awake and not turning (Supervisor.marker).
        shard = self._take(
            command, launch, engine.pid, engine.start_time, False, "", engine.secret
        )
        self._record(shard)
        self.log.warn(
            "adopted shard {shard} of replica {replica} by its engine's marker (pid"
            " {pid}): its record was lost, and is written again",
            shard=shard.id,
            replica=command.replica_id,
            pid=engine.pid,
        )
        return shard
