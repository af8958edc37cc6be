"""
Sleep mode on a real GPU: one small vLLM started with C{--enable-sleep-mode}
(and C{VLLM_SERVER_DEV_MODE=1}, for its sleep routes), put to sleep and
woken at levels 1 and 2 the way llmgw's agent does it
(L{llmgw.agent.sleep}), each step timed and the GPU's used memory read
from NVML after it; then the figures beside the ones llmgw's simulator
and swap benchmark assume.

    .venv/bin/python bench/gpu_sleep_check.py [--model PATH_OR_NAME]
        [--vllm vllm] [--gpu 0] [--port 8200] [--json FILE]
    .venv/bin/python bench/gpu_sleep_check.py --sim   # the script itself, no GPU

Steps: cold start (spawn to C{/health} 200 and a first answer), level 1
(C{POST /sleep?level=1}, C{POST /wake_up}), level 2 (C{POST
/sleep?level=2}, then C{/wake_up?tags=weights}, C{POST /collective_rpc}
C{reload_weights}, C{/wake_up?tags=kv_cache}), and level 2 again woken
with a plain C{/wake_up}, to see whether the answer is still the model's
(llmgw's simulator says it is not: L{llmgw.sim.sleep}); the weights are
reloaded after.  Every answer is a greedy chat completion (temperature 0)
compared with the first.  NVML's used memory on the GPU is read after
each step (C{nvmlDeviceGetMemoryInfo}, MiB), and at the end after the
engine stopped.

C{--sim} runs the same calls against C{llmgw sim --enable-sleep-mode}
instead, without NVML (memory "n/a"): a check of this script on a machine
without a GPU, not a measurement.

Needs a GPU, vLLM with CUDA, and C{nvidia-ml-py} (C{pynvml}); the model's
weights local or in the Hugging Face cache.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

SIM_ASSUMES = {
    "cold start": 20.0,
    "sleep": 1.0,
    "wake": 2.0,
}
"""
Seconds the swap benchmark's simulated engines take (C{bench/swap_bench.py},
C{Shape}); the simulator's own defaults are 0 (C{--sleep-seconds},
C{--wake-seconds}).
"""

SLEEP_GPU_MEMORY_GB = 1.0
"""
GB a sleeping engine keeps on each GPU when a profile does not say
(C{sleep_gpu_memory_gb}'s default in the catalog).
"""

RELOAD = json.dumps({"method": "reload_weights"}).encode()


def call(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """
    @return: the status and the JSON answer (L{None} when empty or not
        JSON) of C{method path}.
    """
    data = body if isinstance(body, bytes) or body is None else json.dumps(body)
    raw = data.encode() if isinstance(data, str) else data
    headers = {"Content-Type": "application/json"} if raw is not None else {}
    request = urllib.request.Request(base + path, raw, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=900) as response:
            code, text = response.status, response.read()
    except urllib.error.HTTPError as e:
        code, text = e.code, e.read()
    try:
        return code, json.loads(text) if text else None
    except ValueError:
        return code, None


class Memory:
    """
    The used memory of one GPU, from NVML; L{None} without it.
    """

    def __init__(self, index: int, enabled: bool) -> None:
        self._handle = None
        if not enabled:
            return
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def used_mib(self) -> int | None:
        if self._handle is None:
            return None
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used) // 2**20


class Check:
    """
    The steps, each timed and followed by a memory reading.
    """

    def __init__(self, base: str, model: str, memory: Memory) -> None:
        self.base = base
        self.model = model
        self.memory = memory
        self.rows: list[dict[str, Any]] = []

    def step(self, name: str, method: str, path: str, body: Any = None) -> float:
        started = time.monotonic()
        code, answer = call(self.base, method, path, body)
        seconds = time.monotonic() - started
        if code != 200:
            raise SystemExit(f"{name}: {method} {path} answered {code}: {answer}")
        self.note(name, seconds)
        return seconds

    def note(self, name: str, seconds: float, **extra: Any) -> None:
        _, sleeping = call(self.base, "GET", "/is_sleeping")
        row = {
            "step": name,
            "seconds": round(seconds, 3),
            "used_mib": self.memory.used_mib(),
            "is_sleeping": (sleeping or {}).get("is_sleeping"),
            **extra,
        }
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def answer(self) -> str:
        code, body = call(
            self.base,
            "POST",
            "/v1/chat/completions",
            {
                "model": self.model,
                "messages": [{"role": "user", "content": "Name three colours."}],
                "max_tokens": 16,
                "temperature": 0,
            },
        )
        if code != 200:
            raise SystemExit(f"chat answered {code}: {body}")
        return str(body["choices"][0]["message"]["content"])

    def run(self, started: float, process: subprocess.Popen[bytes]) -> None:
        while call_or_none(self.base + "/health") != 200:
            if process.poll() is not None:
                raise SystemExit(f"the engine ended with {process.returncode}")
            time.sleep(0.5)
        reference = self.answer()
        self.note("cold start", time.monotonic() - started)
        self.step("level 1: sleep", "POST", "/sleep?level=1")
        self.step("level 1: wake", "POST", "/wake_up")
        self.rows[-1]["same answer"] = self.answer() == reference
        self.step("level 2: sleep", "POST", "/sleep?level=2")
        total = self.step("level 2: wake weights", "POST", "/wake_up?tags=weights")
        total += self.step("level 2: reload", "POST", "/collective_rpc", RELOAD)
        total += self.step("level 2: wake kv_cache", "POST", "/wake_up?tags=kv_cache")
        self.note("level 2: wake (the three)", total)
        self.rows[-1]["same answer"] = self.answer() == reference
        self.step("level 2 again: sleep", "POST", "/sleep?level=2")
        self.step("level 2 again: plain wake", "POST", "/wake_up")
        self.rows[-1]["same answer"] = self.answer() == reference
        self.step("level 2 again: reload", "POST", "/collective_rpc", RELOAD)
        self.rows[-1]["same answer"] = self.answer() == reference


def call_or_none(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except (OSError, urllib.error.URLError):
        return None


def command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """
    @return: the engine's command line and environment.
    """
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    port = ["--host", "127.0.0.1", "--port", str(args.port)]
    if args.sim:
        sim = [sys.executable, "-m", "llmgw.cli.main", "sim", "--model", args.model]
        timing = ["--sleep-seconds", "0.2", "--wake-seconds", "0.3"]
        return [*sim, *port, "--enable-sleep-mode", *timing], env
    env["CUDA_VISIBLE_DEVICES"] = str(args.gpu)
    serve = [args.vllm, "serve", args.model, "--served-model-name", args.model]
    flags = ["--enable-sleep-mode", "--max-model-len", "2048"]
    return [*serve, *port, *flags], env


def assumed(step: str) -> str:
    """
    @return: what the simulator's benchmark assumes for C{step}, or C{""}.
    """
    if step == "cold start":
        return f"{SIM_ASSUMES['cold start']:g} s"
    if step.endswith(": sleep"):
        return f"{SIM_ASSUMES['sleep']:g} s, {SLEEP_GPU_MEMORY_GB:g} GB kept"
    if step in ("level 1: wake", "level 2: wake (the three)"):
        return f"{SIM_ASSUMES['wake']:g} s"
    return ""


def summary(rows: list[dict[str, Any]], baseline: int | None) -> None:
    print("\nstep | seconds | used MiB over the start | same answer | sim assumes")
    for row in rows:
        used = row["used_mib"]
        over = "n/a" if used is None or baseline is None else used - baseline
        same = row.get("same answer", "")
        step = row["step"]
        print(f"{step} | {row['seconds']} | {over} | {same} | {assumed(step)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--vllm", default="vllm", help="the vllm command")
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--sim", action="store_true", help="llmgw sim, no NVML")
    args = parser.parse_args()
    memory = Memory(args.gpu, not args.sim)
    baseline = memory.used_mib()
    argv, env = command(args)
    started = time.monotonic()
    process = subprocess.Popen(argv, env=env, start_new_session=True)
    check = Check(f"http://127.0.0.1:{args.port}", args.model, memory)
    try:
        check.run(started, process)
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    time.sleep(2)
    check.rows.append({"step": "stopped", "seconds": 0, "used_mib": memory.used_mib()})
    summary(check.rows, baseline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline_mib": baseline, "rows": check.rows}, f, indent=1)


if __name__ == "__main__":
    main()
