"""
Where an engine's start spends its time, as its agent sees it: the phases
C{launched} (the command received until the process runs), C{port_open}
(until its port answers HTTP), C{model_listed} (until C{GET /v1/models}
names the model) and C{ready} (until every probe passes), on the reactor's
clock; and what vLLM's log says of loading the weights and compiling, as
details inside those phases.  Sent with the shard's first C{READY}
(C{ShardStatus.phases}).
"""

from __future__ import annotations

import json
import re

from twisted.internet.interfaces import IReactorTime

from llmgw.wire import agent_pb2 as pb

PHASES = ("launched", "port_open", "model_listed", "ready")
"""
The phases of a start on the agent, in order.
"""

LOG_DETAILS = (
    ("vllm_load_weights", re.compile(rb"Loading weights took ([\d.]+) ?s")),
    (
        "vllm_model_loading",
        re.compile(rb"Model loading took [\d.]+ \w+ and ([\d.]+) ?s"),
    ),
    ("vllm_compile", re.compile(rb"torch\.compile takes ([\d.]+) ?s in total")),
    ("vllm_cuda_graphs", re.compile(rb"Graph capturing finished in ([\d.]+) ?sec")),
    ("vllm_engine_init", re.compile(rb"init engine \(.*?\) took ([\d.]+) ?s")),
)
"""
vLLM's log lines about its start (C{vllm/v1/worker/gpu_model_runner.py}:
"Loading weights took %.4f seconds", "Model loading took %.4f GiB and %.6f
seconds", "Graph capturing finished in %.0f secs"; C{vllm/compilation}:
"torch.compile takes %.2f s in total"; C{vllm/v1/engine/core.py}: "init
engine (profile, create kv cache, warmup model) took %.2f seconds"), each
a detail's name and the pattern of its seconds.
"""

LOG_READ_LIMIT = 4 * 1024 * 1024
"""
Bytes of an engine's log read for the details: its start is at the top.
"""


class StartPhases:
    """
    The marks of one start, each phase once, on C{clock}.
    """

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self.began = clock.seconds()
        self.marks: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """
        Note that C{phase} (one of L{PHASES}) ended now; a phase marked
        again keeps its first time.
        """
        self.marks.setdefault(phase, self._clock.seconds())

    def report(self, log_path: str) -> list[pb.StartPhase]:
        """
        @param log_path: the engine's log, for vLLM's details.
        @return: each phase's seconds in order (a phase not marked, such as
            C{model_listed} for an engine probed without the model list,
            ends with the next one marked: 0 s), then the details found in
            the log.
        """
        out: list[pb.StartPhase] = []
        last = self.began
        for phase in PHASES:
            at = self.marks.get(phase)
            if at is None:
                later = [self.marks[p] for p in PHASES if p in self.marks]
                at = min((t for t in later if t >= last), default=last)
            out.append(pb.StartPhase(name=phase, seconds=max(0.0, at - last)))
            last = max(last, at)
        out.extend(
            pb.StartPhase(name=name, seconds=seconds, detail=True)
            for name, seconds in log_details(log_path)
        )
        return out


def log_details(log_path: str) -> list[tuple[str, float]]:
    """
    @return: the (name, seconds) of each of L{LOG_DETAILS} in the first
        L{LOG_READ_LIMIT} bytes of the log, the first of each; none when
        the log cannot be read.
    """
    try:
        with open(log_path, "rb") as f:
            text = f.read(LOG_READ_LIMIT)
    except OSError:
        return []
    found = []
    for name, pattern in LOG_DETAILS:
        match = pattern.search(text)
        if match is not None:
            try:
                found.append((name, float(match.group(1))))
            except ValueError:
                continue
    return found


def lists_model(body: bytes, model: str) -> bool:
    """
    @return: whether C{body} is an OpenAI model list (C{{"data": [{"id":
        ...}]}}, the answer to C{GET /v1/models}) naming C{model}.
    """
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError):
        return False
    return isinstance(data, list) and any(
        isinstance(m, dict) and m.get("id") == model for m in data
    )
