"""
Helpers for the fault suite (L{tests.test_e2e_faults}): a stand-in engine
that fails, loads slowly or prints an out-of-memory error as a real one
would, agents that find it on their C{PATH}, the engines running counted
from C{/proc}, and the suite's figures written where the lead can quote
them.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from typing import Any

from tests.support import BIN, TWISTD, Process, hermetic_env

# A stand-in for vLLM's "vllm serve": the agent runs it by that name from
# its PATH with vLLM's arguments; the profile's args steer it.
#   --oom             print a CUDA out-of-memory error and 4 more lines, exit 1
#   --counter F --fail-times N   fail (exit 1) the first N starts, counted in F
#   --load S          load for S seconds before serving
#   --itl S           passed to llmgw sim
_STAND_IN = """#!{python}
import os, sys, time
a = sys.argv[1:]

def get(name, default=None):
    return a[a.index(name) + 1] if name in a else default

if "--oom" in a:
    print("INFO loading weights", flush=True)
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"
          " (GPU 0; 79.11 GiB total capacity)", flush=True)
    for step in range(4):
        print(f"INFO shutdown step {{step}}", flush=True)
    sys.exit(1)
counter = get("--counter")
if counter:
    n = int(open(counter).read()) if os.path.exists(counter) else 0
    with open(counter, "w") as f:
        f.write(str(n + 1))
    if n < int(get("--fail-times", "0")):
        print(f"start {{n + 1}}: RuntimeError: NCCL error", flush=True)
        sys.exit(1)
if get("--load"):
    print("INFO loading weights", flush=True)
time.sleep(float(get("--load", "0")))
argv = ["{llmgw}", "sim", "--port", get("--port"), "--host", get("--host"),
        "--model", get("--served-model-name")]
if get("--itl"):
    argv += ["--itl", get("--itl")]
os.execv(argv[0], argv)
"""


def stand_in_engine(directory: str) -> str:
    """
    Write the stand-in C{vllm} into C{directory/bin}.

    @return: that folder, for an agent's C{PATH}.
    """
    folder = os.path.join(directory, "bin")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "vllm")
    with open(path, "w") as f:
        f.write(
            _STAND_IN.format(python=sys.executable, llmgw=os.path.join(BIN, "llmgw"))
        )
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return folder


def spawn_agent_with_path(
    directory: str,
    config: str,
    agent_port: int,
    node_id: str,
    tls_dir: str,
    path: str,
) -> Process:
    """
    L{tests.support.spawn_agent} with C{path} first on the agent's
    C{PATH}, where it finds the stand-in engine.
    """
    conf = os.path.join(directory, f"agent-{node_id}-{time.monotonic_ns()}.toml")
    with open(conf, "w") as f:
        f.write(config)
    env = hermetic_env()
    env["PATH"] = path + os.pathsep + env.get("PATH", "")
    log_path = os.path.join(directory, f"agent-{node_id}-{time.monotonic_ns()}.log")
    argv = [TWISTD, "-n", "--pidfile=", "llmgw-agent", "--config", conf]
    argv += ["--server", f"127.0.0.1:{agent_port}", "--node-id", node_id]
    argv += ["--tls-dir", tls_dir]
    argv += ["--state-dir", os.path.join(directory, f"state-{node_id}")]
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=directory,
            env=env,
        )
    return Process(popen, log_path)


def engines_running(directory: str) -> list[int]:
    """
    @return: the pids of the C{llmgw sim} engines alive (not zombies) that
        run in C{directory} (agents' engines inherit their folder).
    """
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{name}/cwd") != directory:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"sim" in argv and b"--port" in argv and state != "Z":
            found.append(int(name))
    return sorted(found)


def report(fault: str, **figures: Any) -> None:
    """
    Record one fault's figures: a JSON line appended to
    C{fault-suite.jsonl} in the test's working folder (C{_trial_temp}),
    and printed.
    """
    line = json.dumps({"fault": fault, **figures}, sort_keys=True)
    with open("fault-suite.jsonl", "a") as f:
        f.write(line + "\n")
    print(line)
