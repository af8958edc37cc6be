"""
The simulator's stand-in for vLLM's engine core process (with
C{--engine-core-process}): a child process in the simulator's own process
group, as vLLM's C{EngineCore} is a child of its API server.  What vLLM
does, from its code (vLLM 0.32, installed by C{scripts/setup-vllm}):

  - Its API server (C{vllm serve}) spawns the engine core as a child
    process with Python's multiprocessing, in the same process group and
    session, and does not end it when killed with SIGKILL: the engine core
    lives on, its parent now 1 (C{vllm/v1/engine/utils.py},
    C{CoreEngineProcManager}).
  - When the engine core ends, the API server's monitor thread logs
    C{"[shutdown] MPClient: engine core exited unexpectedly; starting
    cleanup"} and marks the engine dead (C{vllm/v1/engine/core_client.py},
    C{start_engine_core_monitor}).
  - From then C{GET /health} answers 503 with an empty body
    (C{vllm/entrypoints/serve/instrumentator/health.py}); a request
    answers 500 with C{{"error": {"message": "EngineCore encountered an
    issue. See stack trace (above) for the root cause.", "type":
    "InternalServerError", "param": null, "code": 500}}}
    (C{vllm/v1/engine/exceptions.py}, C{EngineDeadError};
    C{vllm/entrypoints/serve/exception_handling/handlers/vllm_error.py}
    and C{error_response.py}), logging only its access line (its
    traceback too with C{--log-error-stack}, on by default with
    C{VLLM_SERVER_DEV_MODE=1}, C{vllm/entrypoints/launchers/cli_args.py}).
    A request running then gets the same: a stream ends with that error
    object as an event and C{data: [DONE]}
    (C{vllm/entrypoints/openai/chat_completion/serving.py} and
    C{completion/serving.py} catch it), an answer not begun is that 500;
    here at its next event (L{llmgw.sim.exchange}).
  - At its death it logs C{"AsyncLLM output_handler failed."} and a
    traceback whose last line is C{ENGINE_DEAD_LOG}
    (C{vllm/v1/engine/async_llm.py}, C{output_handler}), no request
    needed.
  - Its server ends itself once the engine is dead: a request answered
    with that 500 sets uvicorn's C{should_exit} (C{terminate_if_errored},
    C{vllm/entrypoints/launchers/launcher.py}, called by
    C{vllm/entrypoints/serve/exception_handling/handlers/vllm_error.py}),
    and so does its watchdog, which looks every 5 s from the server's
    start (C{watchdog_loop}): the end comes 0 to 5 s after the death,
    on a real vLLM here once 0.7 s (no C{/health} answered 503 to an
    asker once a second) and once 4.6 s.  uvicorn looks at
    C{should_exit} every 0.1 s.  It ends with code 0, printing uvicorn's
    four shutdown lines and, from vLLM's CPU build, the leak report of
    triton's nanobind bindings: 35 lines after its engine's last word.
  - Its sleep routes are calls to the engine core (C{call_utility_async}):
    after the death they fail as a request does (the 500, and the end);
    one in flight at the death never answers, C{core_client.py} failing
    only the generation queue, and the server's end then waits for it for
    ever (uvicorn waits for its requests in flight): the port closed, the
    process alive.  Seen on a real vLLM with C{GET /is_sleeping} in
    flight (alive 40 s on); here a C{/sleep} or C{/wake_up} within its
    C{--sleep-seconds} or C{--wake-seconds}.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import (
    IProcessTransport,
    IReactorProcess,
    IReactorTime,
)
from twisted.internet.protocol import ProcessProtocol
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

T = TypeVar("T")

ENGINE_DEAD_MESSAGE = (
    "EngineCore encountered an issue. See stack trace (above) for the root cause."
)
"""
vLLM's C{EngineDeadError} message (C{vllm/v1/engine/exceptions.py}).
"""

ENGINE_DEAD_LOG = "vllm.v1.engine.exceptions.EngineDeadError: " + ENGINE_DEAD_MESSAGE
"""
The last line of the traceback vLLM logs when its engine core dies.
"""

CORE_EXITED_LOG = (
    "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup"
)
"""
vLLM's warning when its engine core process ends
(C{vllm/v1/engine/core_client.py}).
"""

WATCHDOG_SECONDS = 5.0
"""
Seconds between two looks of vLLM's watchdog at its engine
(C{VLLM_WATCHDOG_TIME_S} in C{watchdog_loop}).
"""

SHOULD_EXIT_SECONDS = 0.1
"""
Seconds at most before uvicorn acts on C{should_exit} (its main loop's
tick).
"""

OUTPUT_HANDLER_LOG = (
    "ERROR [async_llm.py:906] AsyncLLM output_handler failed.",
    "ERROR [async_llm.py:906] Traceback (most recent call last):",
    'ERROR [async_llm.py:906]   File "vllm/v1/engine/async_llm.py", line 849,'
    " in output_handler",
    "ERROR [async_llm.py:906]     outputs = await engine_core.get_output_async()",
    "ERROR [async_llm.py:906] " + ENGINE_DEAD_LOG,
)
"""
What vLLM logs when its engine core dies, no request needed.
"""


SHUTTING_DOWN = "INFO:     Shutting down"
WAITING_FOR_CONNECTIONS = (
    "INFO:     Waiting for connections to close. (CTRL+C to force quit)"
)
"""
uvicorn's lines as its shutdown begins, and while requests in flight hold
it.
"""


def exit_output(pid: int) -> list[str]:
    """
    @param pid: the server's process id.
    @return: what vLLM 0.32's CPU build prints as its server ends: uvicorn's
        shutdown lines, then the report of triton's nanobind bindings on
        leaks at the interpreter's exit (its names left out here, its
        shape and length kept).
    """
    lines = [
        SHUTTING_DOWN,
        "INFO:     Waiting for application shutdown.",
        "INFO:     Application shutdown complete.",
        f"INFO:     Finished server process [{pid}]",
        "nanobind: leaked 4 instances!",
    ]
    lines += [
        f' - leaked instance 0x7faedff5cc{i:02x} of type "triton._C.libtriton.ir.'
        'attribute"'
        for i in range(4)
    ]
    for kind, count in (("type", 64), ("function", 514)):
        lines.append(f"nanobind: leaked {count} {kind}s!")
        lines += [f' - leaked {kind} "{kind}_{i}"' for i in range(10)]
        lines.append(" - ... skipped remainder")
    lines += [
        "nanobind: this is likely caused by a reference counting issue in the"
        " binding code.",
        "See https://nanobind.readthedocs.io/en/latest/refleaks.html",
    ]
    return lines


_CORE_PROGRAM = "import time\nwhile True:\n    time.sleep(3600)\n"


def engine_dead_body() -> bytes:
    """
    @return: vLLM's 500 answer body once its engine core is dead.
    """
    return json.dumps(
        {
            "error": {
                "message": ENGINE_DEAD_MESSAGE,
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }
    ).encode("ascii")


class Core:
    """
    Whether the simulated engine core lives (without
    C{--engine-core-process} it always does), and what vLLM's server does
    once it does not: it logs the death, and ends itself when a request
    or its watchdog finds it (see the module's docstring).

    @ivar dead: the engine core process has ended.
    """

    def __init__(
        self,
        clock: IReactorTime,
        end: Callable[[], None],
        close: Callable[[], object] = lambda: None,
    ) -> None:
        """
        @param clock: times the end.
        @param end: ends the simulator (its reactor's C{stop}).
        @param close: stops its listening (its end waiting for ever on a
            hung call).
        """
        self.dead = False
        self._clock = clock
        self._end = end
        self._close = close
        self._ending = False
        # Calls to the core not answered yet: at the death, never.
        self._pending = 0

    def utility(self, done: Deferred[T]) -> Deferred[T]:
        """
        A call to the engine core (vLLM's utility calls: C{/sleep},
        C{/wake_up}, C{/is_sleeping}, C{/collective_rpc}), answered when
        C{done} fires: unless the core died meanwhile, when, as vLLM's, it
        never is (C{vllm/v1/engine/core_client.py} fails only the
        generation queue at the death) and the server's end waits for it
        for ever.

        @return: fires with C{done}'s result, or never.
        """
        answered: Deferred[T] = Deferred()
        self._pending += 1

        def back(result: T) -> None:
            if self.dead:
                return  # pending for ever
            self._pending -= 1
            answered.callback(result)

        done.addCallback(back)
        return answered

    def died(self) -> None:
        """
        The engine core process ended: log what vLLM logs.
        """
        self.dead = True
        _write([f"WARNING [core_client.py:817] {CORE_EXITED_LOG}", *OUTPUT_HANDLER_LOG])

    def terminate_if_errored(self) -> None:
        """
        As vLLM's function of that name: a dead engine ends the server,
        within L{SHOULD_EXIT_SECONDS}, once.
        """
        if self.dead and not self._ending:
            self._ending = True
            self._clock.callLater(SHOULD_EXIT_SECONDS, self._exit)

    def _exit(self) -> None:
        if self._pending:
            # uvicorn stops listening, then waits for every request in
            # flight: a hung utility call's, for ever.
            _write([SHUTTING_DOWN, WAITING_FOR_CONNECTIONS])
            self._close()
            return
        _write(exit_output(os.getpid()))
        self._end()


def _write(lines: list[str]) -> None:
    sys.stderr.write("".join(f"{line}\n" for line in lines))
    sys.stderr.flush()


class _CoreProtocol(ProcessProtocol):
    def __init__(self, ended: Callable[[], None]) -> None:
        self._ended = ended

    def processExited(self, reason: Failure) -> None:
        self._ended()


class CoreProcess:
    """
    The child process standing in for vLLM's engine core: started with the
    simulator, its end makes L{Core} dead; and vLLM's watchdog, looking
    every L{WATCHDOG_SECONDS} from the start.

    @param spawner: spawns the child.
    @param clock: times the watchdog.
    @param core: told when the child ends, looked at by the watchdog.
    """

    def __init__(
        self, spawner: IReactorProcess, clock: IReactorTime, core: Core
    ) -> None:
        self._spawner = spawner
        self._clock = clock
        self._core = core
        self._process: IProcessTransport | None = None
        self._watchdog = LoopingCall(core.terminate_if_errored)
        self._watchdog.clock = clock
        self._stopping = False

    def start(self) -> int:
        """
        Spawn the child (in this process's group: no new session), its
        output on this process's, and start the watchdog.

        @return: its pid.
        """
        self._process = self._spawner.spawnProcess(
            _CoreProtocol(self._ended),
            sys.executable,
            [sys.executable, "-c", _CORE_PROGRAM],
            env=None,
            childFDs={0: "w", 1: 1, 2: 2},
        )
        self._watchdog.start(WATCHDOG_SECONDS, now=False)
        return int(self._process.pid)

    def stop(self) -> None:
        """
        End the child with the simulator (vLLM's shutdown ends its engine
        core).
        """
        self._stopping = True
        if self._watchdog.running:
            self._watchdog.stop()
        if self._process is not None:
            try:
                self._process.signalProcess("KILL")
            except (ProcessExitedAlready, OSError):
                pass

    def _ended(self) -> None:
        if not self._stopping:
            self._core.died()
