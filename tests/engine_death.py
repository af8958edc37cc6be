"""
The last probe of L{tests.test_e2e_vllm_sim}: an engine whose engine core
is killed with SIGKILL (vLLM's C{EngineCore}; the sim's stand-in,
C{llmgw sim --engine-core-process}), and what it does then, seen the same
way on each (L{DyingEngine}) and compared (L{differences}).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.parse
from http.client import HTTPConnection
from typing import Any

from tests.support import Process, http

View = tuple[Any, ...]
"""
What one engine did (L{DyingEngine.observe}).
"""


def _comm(pid: int) -> str:
    """
    @return: the name of process C{pid} (vLLM's engine core sets its own,
        C{VLLM::EngineCore} cut to 15 characters), or C{""} once gone.
    """
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class DyingEngine:
    """
    One engine serving C{model} at C{base}: its core killed while a long
    stream runs, then a completion for a model it does not serve and one
    for its own asked once it knows.

    @param process: the engine's API server.
    @param base: its base URL.
    @param model: the model name it serves.
    """

    def __init__(self, process: Process, base: str, model: str) -> None:
        self._process = process
        self._base = base
        self._model = model
        self._events: list[str] = []
        self._begun = threading.Event()

    def _core(self) -> int:
        """
        @return: the pid of its engine core, its one child of that name
            (the sim's, its only child).
        @raise AssertionError: none, or more than one.
        """
        pid = self._process.popen.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(p) for p in f.read().split()]
        cores = [c for c in children if "EngineCor" in _comm(c)] or children
        if len(cores) != 1:
            raise AssertionError(f"no one engine core among {children}")
        return cores[0]

    def _stream(self) -> None:
        """
        Stream a long completion, keeping each event's C{data:} field and
        setting C{_begun} at the first, until the stream ends or breaks.
        """
        url = urllib.parse.urlsplit(self._base)
        connection = HTTPConnection(url.hostname or "", url.port, timeout=60)
        body = {
            "model": self._model,
            "prompt": "Count",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            connection.request(
                "POST",
                "/v1/completions",
                json.dumps(body),
                {"Content-Type": "application/json"},
            )
            for line in connection.getresponse():
                if line.startswith(b"data: "):
                    self._events.append(line[6:].strip().decode())
                    self._begun.set()
        except OSError:
            pass
        finally:
            connection.close()

    def _until_unhealthy(self, seconds: float = 5.0) -> None:
        """
        Wait until its C{/health} answers other than 200 (503 once its
        engine core is dead) or nothing answers, at most C{seconds}: each
        engine learns of the death a moment after the kill, and a request
        quicker than that is answered as before.
        """
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if http("GET", self._base + "/health", timeout=2)[0] != 200:
                    return
            except OSError:
                return
            time.sleep(0.02)

    def _answer(self, model: str) -> tuple[int, Any] | None:
        """
        @return: the status of its answer to a completion for C{model} and
            the answer's error C{param} (a refusal as the probes see one:
            the engines' types and codes differ by design) or, for its 500,
            the whole body; L{None} when nothing listens any more.
        """
        body = {"model": model, "prompt": "hi", "max_tokens": 3}
        try:
            status, _, answer = http(
                "POST",
                self._base + "/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
                timeout=10,
            )
        except OSError:
            return None
        found = json.loads(answer)
        return status, found if status == 500 else found["error"]["param"]

    def observe(self) -> View:
        """
        Kill its core and watch.

        @return: its answers to a model it does not serve and to its own,
            its exit status (within 30 s), whether it ended within 3 s of
            answering (vLLM's in 0.6 s here, idle), whether its output
            named C{EngineDeadError} after the kill, and the last two
            events of the stream running at the kill.
        """
        core = self._core()
        streaming = threading.Thread(target=self._stream, daemon=True)
        streaming.start()
        if not self._begun.wait(60):
            raise AssertionError("no stream event")
        before = len(self._process.output())
        os.kill(core, signal.SIGKILL)
        self._until_unhealthy()
        wrong = self._answer("no-such-model")
        answer = self._answer(self._model)
        answered = time.monotonic()
        code = self._process.popen.wait(timeout=30)
        soon = answer is None or time.monotonic() - answered < 3
        said = "EngineDeadError" in self._process.output()[before:]
        streaming.join(10)
        tail = [e if e == "[DONE]" else json.loads(e) for e in self._events[-2:]]
        return wrong, answer, code, soon, said, tail


def differences(vllm: View, sim: View) -> list[str]:
    """
    @return: one line when the two differ.  A vLLM whose watchdog ended it
        before its own model's request came (0 to 5 s after the death) has
        no answer: then neither answer is compared, only how each ended.
    """
    print(f"probe engine core killed: vllm {vllm!r}")
    if vllm[1] is None:
        sim = (vllm[0], None, *sim[2:])
    if vllm != sim:
        return [f"engine core killed: vllm {vllm!r}, sim {sim!r}"]
    return []
