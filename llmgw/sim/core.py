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
    and C{error_response.py}), its traceback's last line naming
    C{vllm.v1.engine.exceptions.EngineDeadError} in the log.  Not
    modelled here: a stream already answering, which vLLM ends with that
    error object as its last event and C{data: [DONE]}
    (C{vllm/entrypoints/openai/chat_completion/serving.py}), runs to its
    end.
  - Its watchdog ends the server within 5 s of the engine's death
    (C{vllm/entrypoints/launchers/launcher.py}, C{VLLM_WATCHDOG_TIME_S}).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

from twisted.internet.error import ProcessExitedAlready
from twisted.internet.interfaces import (
    IProcessTransport,
    IReactorProcess,
    IReactorTime,
)
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

ENGINE_DEAD_MESSAGE = (
    "EngineCore encountered an issue. See stack trace (above) for the root cause."
)
"""
vLLM's C{EngineDeadError} message (C{vllm/v1/engine/exceptions.py}).
"""

ENGINE_DEAD_LOG = "vllm.v1.engine.exceptions.EngineDeadError: " + ENGINE_DEAD_MESSAGE
"""
The last line of the traceback vLLM logs for a request its dead engine
failed.
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
Seconds after the engine's death at most before vLLM's server ends
(C{VLLM_WATCHDOG_TIME_S}).
"""

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


@dataclass
class Core:
    """
    Whether the simulated engine core lives; without
    C{--engine-core-process} it always does.

    @ivar dead: the engine core process has ended.
    """

    dead: bool = False


class _CoreProtocol(ProcessProtocol):
    def __init__(self, ended: Callable[[], None]) -> None:
        self._ended = ended

    def processExited(self, reason: Failure) -> None:
        self._ended()


class CoreProcess:
    """
    The child process standing in for vLLM's engine core: started with the
    simulator, its end marks L{Core} dead, logs what vLLM logs, and ends
    the simulator L{WATCHDOG_SECONDS} later.

    @param spawner: spawns the child.
    @param clock: times the watchdog.
    @param core: marked dead when the child ends.
    @param end: ends the simulator (its reactor's C{stop}).
    """

    def __init__(
        self,
        spawner: IReactorProcess,
        clock: IReactorTime,
        core: Core,
        end: Callable[[], None],
    ) -> None:
        self._spawner = spawner
        self._clock = clock
        self._core = core
        self._end = end
        self._process: IProcessTransport | None = None
        self._stopping = False

    def start(self) -> int:
        """
        Spawn the child (in this process's group: no new session), its
        output on this process's.

        @return: its pid.
        """
        self._process = self._spawner.spawnProcess(
            _CoreProtocol(self._ended),
            sys.executable,
            [sys.executable, "-c", _CORE_PROGRAM],
            env=None,
            childFDs={0: "w", 1: 1, 2: 2},
        )
        return int(self._process.pid)

    def stop(self) -> None:
        """
        End the child with the simulator (vLLM's shutdown ends its engine
        core).
        """
        self._stopping = True
        if self._process is not None:
            try:
                self._process.signalProcess("KILL")
            except (ProcessExitedAlready, OSError):
                pass

    def _ended(self) -> None:
        if self._stopping:
            return
        self._core.dead = True
        sys.stderr.write(f"WARNING {CORE_EXITED_LOG}\n")
        sys.stderr.flush()
        self._clock.callLater(WATCHDOG_SECONDS, self._end)
