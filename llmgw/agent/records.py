"""
How the agent finds its engines again after a restart: by the record it
wrote in the state directory (C{shards/ID.json}), and, should that record
be cut short, deleted or unreadable, by the marker every engine carries in
its environment (L{MARKER}), read back from C{/proc/PID/environ}.

A record is written atomically (a temporary file, fsync, rename, fsync of
the folder): after a crash or a full disk it is the old one or the new
one, never half.  One that cannot be used anyway is kept aside as
C{ID.json.unreadable} for the operator, with one warning, not dropped.
"""

from __future__ import annotations

import hmac
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from llmgw.wire import agent_pb2 as pb

MARKER = "LLMGW_ENGINE"
"""
The environment variable every engine the agent starts carries: a JSON
object C{{"node_id", "state_dir", "shard_id", "replica_id", "secret",
"record"}}, C{record} the fields of the shard's record but its pid and
start time, C{secret} the engine's own random secret, which the agent also
keeps in the engine's proof (L{write_proof}).  The marker alone proves
nothing (any process may carry a copy): an engine is the agent's when its
marker's secret, its pid and its process start time are those of its proof.
Like the record (0600), it holds the engine's secret; C{/proc/PID/environ}
is readable by the engine's user (and root) only.
"""

SHARD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""
A shard id the agent accepts: it names files in the state directory.
"""

UNREADABLE = ".unreadable"
"""
The suffix a record the agent cannot use is renamed with.
"""


def process_start_time(pid: int) -> int | None:
    """
    @return: the process's start time in clock ticks since boot (field 22
        of C{/proc/PID/stat}, proc(5)), which with the pid names a process
        uniquely; L{None} when there is no such process.
    """
    fields = _stat(pid)
    return int(fields[19]) if fields is not None else None


def _stat(pid: int) -> list[bytes] | None:
    """
    @return: the fields of C{/proc/PID/stat} from the third (state) on,
        or L{None} when there is no such process.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name, field 2, is in parentheses and may hold spaces.
    return stat[stat.rindex(b")") + 2 :].split()


def command_json(command: pb.StartShard) -> Any:
    """
    @return: C{command} as JSON values (protobuf's JSON mapping).
    """
    return json.loads(json_format.MessageToJson(command))


def command_from_json(value: Any) -> pb.StartShard:
    """
    @raise json_format.ParseError: not a C{StartShard}.
    """
    return json_format.Parse(json.dumps(value), pb.StartShard())


def write_record(path: str, data: dict[str, Any]) -> None:
    """
    Write C{data} as JSON to C{path} atomically, mode 0600.

    @raise OSError: it could not be written (the old record, if any, stays).
    """
    temporary = path + ".tmp"
    # 0600: the command holds the engine's secret.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def set_aside(path: str) -> str:
    """
    Rename an unusable record to C{PATH.unreadable} (replacing an older one).

    @return: the new path, or C{""} when it could not be renamed.
    """
    try:
        os.replace(path, path + UNREADABLE)
    except OSError:
        return ""
    return path + UNREADABLE


@dataclass(frozen=True)
class Marked:
    """
    An engine found by its marker.

    @ivar pid: its process (the leader of its own session).
    @ivar start_time: see L{process_start_time}.
    @ivar record: the record fields of the marker (C{command}, C{host}).
    @ivar secret: the marker's secret (C{""} in a marker without one).
    """

    pid: int
    start_time: int
    record: dict[str, Any]
    secret: str = ""


def marker(
    node_id: str, state_dir: str, record: dict[str, Any], secret: str = ""
) -> str:
    """
    @param record: the shard's record but its pid and start time.
    @param secret: the engine's secret (see L{write_proof}).
    @return: the value of L{MARKER} for an engine started with C{record}
        by the agent of C{node_id} keeping its state in C{state_dir}.
    """
    command = record["command"]
    return json.dumps(
        {
            "node_id": node_id,
            "state_dir": os.path.realpath(state_dir),
            "shard_id": command.get("shardId", ""),
            "replica_id": command.get("replicaId", ""),
            "secret": secret,
            "record": record,
        }
    )


def marked(state_dir: str, proc: str = "/proc") -> Iterator[Marked]:
    """
    Every engine running whose marker names C{state_dir}: those an agent
    on this state directory started.  Only session leaders count (the
    launcher calls C{setsid}): workers an engine forks inherit its
    environment, marker included.

    @param proc: the proc(5) file system.
    """
    folder = os.path.realpath(state_dir)
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        pid = int(name)
        fields = _stat(pid)
        # Field 6 (the fourth here) is the session id.
        if fields is None or int(fields[3]) != pid:
            continue
        try:
            with open(os.path.join(proc, name, "environ"), "rb") as f:
                environ = f.read()
        except OSError:
            # Another user's process, or gone.
            continue
        prefix = MARKER.encode() + b"="
        for entry in environ.split(b"\0"):
            if not entry.startswith(prefix):
                continue
            try:
                value = json.loads(entry[len(prefix) :])
                if value.get("state_dir") != folder:
                    break
                record = value["record"]
                secret = value.get("secret", "")
                if not isinstance(record, dict) or not isinstance(secret, str):
                    break
            except (ValueError, AttributeError, KeyError):
                break
            yield Marked(pid, int(fields[19]), record, secret)
            break


PROOF = ".proof"
"""
The suffix of an engine's proof in the state directory (L{write_proof}).
"""


def write_proof(path: str, secret: str, pid: int, start_time: int | None) -> None:
    """
    Keep the proof that the agent started an engine: its secret (also in
    its marker, L{MARKER}), its pid and its process start time (see
    L{process_start_time}), written atomically, mode 0600, beside its
    record but apart from it, so that an engine whose record is lost is
    still proven the agent's.

    @raise OSError: it could not be written.
    """
    write_record(path, {"secret": secret, "pid": pid, "start_time": start_time})


def proven(path: str, engine: Marked) -> str:
    """
    @param path: the proof the agent wrote for the shard C{engine}'s
        marker names.
    @return: C{""} when the proof names C{engine}: the same secret, pid
        and process start time; else why not (for a warning).
    """
    try:
        with open(path) as f:
            proof = json.load(f)
        secret, pid = proof["secret"], proof["pid"]
        start_time = proof["start_time"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no proof of its start ({e})"
    if not engine.secret or not hmac.compare_digest(str(secret), engine.secret):
        return "its marker's secret is not the one the agent keeps"
    if (pid, start_time) != (engine.pid, engine.start_time):
        return (
            f"the agent started pid {pid} (start time {start_time}), not this process"
        )
    return ""


OUTPUT_LINES = 50
"""
Lines of an engine's output file sent with its status.
"""

PROBE_LINE = re.compile(
    r'"GET /(?:health|is_sleeping|metrics|v1/models)(?:\?[^ "]*)? HTTP/[0-9.]+" \d{3}'
)
"""
An access line of the agent's own questions to its engine (health and
sleep once a second, its metrics, llama-cpp-python's C{/v1/models} as its
health), as uvicorn logs each for vLLM, SGLang and llama-cpp-python:
C{INFO:     127.0.0.1:39352 - "GET /health HTTP/1.1" 200 OK}.  Two a second,
they pushed what the engine said out of its last lines.
"""


def tail(path: str, lines: int | None = OUTPUT_LINES) -> list[str]:
    """
    @return: the last C{lines} lines of the file at C{path} (all of them
        for C{None}; whole lines of at most its last 64 KiB), less the
        access lines of the agent's own questions (L{PROBE_LINE}), or none
        when it cannot be read.
    """
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - 65536)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    if start:
        # The read began inside a line (or a character): from the next.
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else data
    text = [
        line
        for line in data.decode("utf-8", "replace").splitlines()
        if not PROBE_LINE.search(line)
    ]
    if lines is not None:
        text = text[-lines:]
    return [line.rstrip("\r") for line in text]
