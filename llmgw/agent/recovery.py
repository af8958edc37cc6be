"""
A restarted agent takes back the engines a previous one started
(L{llmgw.agent.supervisor.Supervisor.adopt_running}): first by their
records, then by their markers (L{llmgw.agent.records.MARKER}) those whose
record was cut short, deleted or unreadable.  Every engine taken back is
listed in the next Register, and the server adopts it when the catalog
still wants it, or stops it (L{llmgw.control.adoption}); meanwhile the
supervisor holds its port and GPUs, so no second engine starts on them.
"""

from __future__ import annotations

import json
import os
import signal
from typing import TYPE_CHECKING, Any

from twisted.logger import Logger

from llmgw.agent.engines import Launch, build
from llmgw.agent.records import (
    SHARD_ID,
    Marked,
    command_from_json,
    marked,
    process_start_time,
    set_aside,
)
from llmgw.wire import agent_pb2 as pb

if TYPE_CHECKING:
    from llmgw.agent.shard import Shard
    from llmgw.agent.supervisor import Supervisor

log = Logger()


def adopt_running(
    supervisor: Supervisor, shards_dir: str, state_dir: str
) -> list[Shard]:
    """
    @param shards_dir: where the records are (C{STATE/shards}).
    @param state_dir: the agent's state directory, as markers name it.
    @return: the shards adopted, by record and by marker.
    """
    adopted = []
    for name in sorted(os.listdir(shards_dir)):
        if name.endswith(".json"):
            shard = _by_record(supervisor, os.path.join(shards_dir, name))
            if shard is not None:
                adopted.append(shard)
    try:
        found = list(marked(state_dir))
    except OSError as e:
        log.warn("cannot look for engines by marker: {error}", error=str(e))
        found = []
    for engine in found:
        shard = _by_marker(supervisor, engine)
        if shard is not None:
            adopted.append(shard)
    return adopted


def usable(
    supervisor: Supervisor, data: Any, name: str
) -> tuple[pb.StartShard, Launch]:
    """
    @param data: a record's JSON value (or a marker's C{record}).
    @param name: the record's file name, C{ID.json}.
    @raise Exception: C{data} is not a record of that shard this agent can
        launch (a bad command, shard id, engine).
    """
    command = command_from_json(data["command"])
    if not SHARD_ID.match(command.shard_id) or name != command.shard_id + ".json":
        raise ValueError(f"shard id {command.shard_id!r}")
    return command, build(command, str(data.get("host", supervisor.engine_host)))


def _by_record(supervisor: Supervisor, path: str) -> Shard | None:
    try:
        with open(path) as f:
            data = json.load(f)
        command, launch = usable(supervisor, data, os.path.basename(path))
        pid, start_time = int(data["pid"]), int(data["start_time"])
    except Exception as e:
        # A record this agent cannot use (cut short, foreign, from another
        # version) must not keep it from starting, nor be lost: the
        # operator finds it aside, and its engine is found by its marker.
        aside = set_aside(path)
        log.warn(
            "unreadable shard record {path} ({error}): kept as {aside}; its"
            " engine, if running, is found by its marker",
            path=path,
            error=str(e),
            aside=aside or "(cannot rename it)",
        )
        return None
    if process_start_time(pid) != start_time:
        log.info("shard {shard} (pid {pid}) is gone", shard=command.shard_id, pid=pid)
        os.remove(path)
        return None
    turning = data.get("turning")
    shard = supervisor.take(
        command,
        launch,
        pid,
        start_time,
        data.get("sleeping") is True,
        turning if turning in ("sleep", "wake") else "",
    )
    log.info(
        "adopted shard {shard}: engine pid {pid} still running", shard=shard.id, pid=pid
    )
    return shard


def _by_marker(supervisor: Supervisor, engine: Marked) -> Shard | None:
    """
    Adopt an engine found by its marker that no record named, and record
    it again.  A second engine of a shard already adopted is stopped.
    """
    try:
        shard_id = str(engine.record["command"]["shardId"])
        command, launch = usable(supervisor, engine.record, shard_id + ".json")
    except Exception as e:
        log.warn(
            "engine pid {pid} carries a marker this agent cannot use ({error});"
            " left alone",
            pid=engine.pid,
            error=str(e),
        )
        return None
    held = supervisor.shards.get(command.shard_id)
    if held is not None:
        if held.pid != engine.pid:
            log.warn(
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
    shard = supervisor.take(command, launch, engine.pid, engine.start_time)
    supervisor.record(shard)
    log.warn(
        "adopted shard {shard} of replica {replica} by its engine's marker (pid"
        " {pid}): its record was lost, and is written again",
        shard=shard.id,
        replica=command.replica_id,
        pid=engine.pid,
    )
    return shard
