"""
GPU discovery through NVML (the C{pynvml} module of the C{nvidia-ml-py}
package), plus GPUs simulated from the configuration; and the GPUs' state
for the heartbeats: memory in use, and problems.

NVML is initialised once, at start (L{Nvml.start}), and every later call is
made in a thread (L{GpuMonitor}): an NVML call can block for seconds on a
GPU in trouble, and the reactor thread sends the heartbeats.

A GPU's problems are what makes the server's placement avoid it (they stay
on its record until the agent registers again): an NVML call that fails
for that GPU (C{"nvml memory info: GPU is lost"}) and the Xid errors NVML
reports as critical events (C{"xid 79"}), but for the Xids an application
causes on a healthy GPU (L{APPLICATION_XIDS}).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from llmgw.wire import agent_pb2 as pb

log = Logger()
_MIB = 1024 * 1024

MAX_PROBLEMS = 16
"""
Problems an agent keeps per GPU; later ones are dropped.
"""

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})
"""
Xids that a faulty program causes, not the GPU (graphics exception, memory
page fault, stopped processing, preemptive cleanup, video decoder
exception): not problems of the GPU.
"""

_MAX_EVENTS = 64
_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
_ERROR_TIMEOUT = 10  # NVML_ERROR_TIMEOUT
_NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED
_PROCESS_CALLS = (
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
)

MAX_PROCESSES = 64
"""
Processes an agent reports per GPU; the MiB of those left out still count.
"""


def load_nvml() -> Any:
    """
    @return: the C{pynvml} module.
    @raise RuntimeError: it is not installed.
    """
    try:
        import pynvml
    except ImportError as e:
        raise RuntimeError(f"pynvml is not installed: {e}") from None
    return pynvml


def _in(pid: int, sessions: frozenset[int]) -> bool:
    try:
        return os.getsid(pid) in sessions
    except OSError:
        # Gone, or of another pid namespace (a container): not ours.
        return False


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()[:64]
    except OSError:
        return ""


def foreign_mib(processes: list[pb.GpuProcess]) -> int:
    """
    @return: the MiB that processes llmgw does not manage hold.
    """
    return sum(p.used_mib for p in processes if not p.managed)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """
    NVML for one agent: initialised once by L{start}, read by L{poll}.
    L{poll} blocks: call it in a thread, one call at a time.

    @param module: the C{pynvml} module, or one that acts like it (tests).
    """

    def __init__(self, module: Any) -> None:
        self._nvml = module
        self._handles: dict[int, Any] = {}
        self._events: Any = None
        # Written by poll() in its thread, logged from the reactor thread
        # (twisted.logger's observers are not for other threads).
        self._warnings: list[str] = []
        self._warned: set[str] = set()

    def take_warnings(self) -> list[str]:
        """
        @return: the warnings L{poll} found since the last call, to be
            logged from the reactor thread; forgotten here.
        """
        warnings, self._warnings = self._warnings, []
        return warnings

    def start(self) -> list[pb.Gpu]:
        """
        Initialise NVML, and listen for critical Xid events where the GPUs
        allow it.

        @return: the GPUs NVML sees, memory in MiB.
        @raise RuntimeError: NVML is not available, with the reason.
        """
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise RuntimeError(f"NVML is not available: {e}") from None
        try:
            gpus = []
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                memory: Any = nvml.nvmlDeviceGetMemoryInfo(handle)
                gpus.append(
                    pb.Gpu(
                        index=index,
                        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                        name=_text(nvml.nvmlDeviceGetName(handle)),
                        memory_total_mib=int(memory.total) // _MIB,
                        memory_used_mib=int(memory.used) // _MIB,
                    )
                )
                self._handles[index] = handle
        except nvml.NVMLError as e:
            nvml.nvmlShutdown()
            raise RuntimeError(f"NVML cannot list the GPUs: {e}") from None
        self._listen_for_xids()
        return gpus

    def _listen_for_xids(self) -> None:
        nvml = self._nvml
        try:
            self._events = nvml.nvmlEventSetCreate()
        except (nvml.NVMLError, AttributeError) as e:
            log.info("no Xid events from NVML: {reason}", reason=str(e))
            return
        for index, handle in self._handles.items():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, _XID_CRITICAL, self._events)
            except nvml.NVMLError as e:
                log.info(
                    "no Xid events from NVML for GPU {index}: {reason}",
                    index=index,
                    reason=str(e),
                )

    def poll(
        self, sessions: frozenset[int] = frozenset()
    ) -> dict[int, tuple[int | None, list[str], list[pb.GpuProcess] | None]]:
        """
        Blocking: read each GPU's memory in use, its processes, and the Xid
        events that came since the last call.

        @param sessions: the session ids of the agent's engines (each runs
            in a session of its own, its workers with it): a process in one
            of them is managed, any other is not (a notebook, another
            tool's engine, a pid of another pid namespace).
        @return: per GPU index, its memory used in MiB (L{None} when NVML
            could not tell), its problems seen now (each NVML call that
            failed for it, C{"nvml memory info: REASON"}, and C{"xid N"}),
            and its processes (L{None} when NVML could not list them).
        """
        nvml = self._nvml
        found: dict[int, tuple[int | None, list[str], list[pb.GpuProcess] | None]]
        found = {}
        for index, handle in self._handles.items():
            try:
                memory: Any = nvml.nvmlDeviceGetMemoryInfo(handle)
                used: int | None = int(memory.used) // _MIB
                problems: list[str] = []
            except nvml.NVMLError as e:
                used, problems = None, [f"nvml memory info: {e}"]
            found[index] = (used, problems, self._processes(handle, sessions))
        for index, problem in self._xids():
            found.setdefault(index, (None, [], None))[1].append(problem)
        return found

    def _processes(
        self, handle: Any, sessions: frozenset[int]
    ) -> list[pb.GpuProcess] | None:
        nvml = self._nvml
        seen: dict[int, pb.GpuProcess] = {}
        for name in _PROCESS_CALLS:
            call = getattr(nvml, name, None)
            if call is None:
                continue
            try:
                listed = call(handle)
            except nvml.NVMLError as e:
                if getattr(e, "value", None) == _NOT_SUPPORTED:
                    continue
                warning = f"{name}: {e}"
                if warning not in self._warned:
                    # Once: a GPU that cannot list its processes would
                    # otherwise log a line per heartbeat.
                    self._warned.add(warning)
                    self._warnings.append(warning)
                return None
            for process in listed:
                pid = int(process.pid)
                used = getattr(process, "usedGpuMemory", None)
                mib = int(used) // _MIB if isinstance(used, int) else 0
                if pid in seen:
                    seen[pid].used_mib = max(seen[pid].used_mib, mib)
                    continue
                seen[pid] = pb.GpuProcess(
                    pid=pid, used_mib=mib, managed=_in(pid, sessions), name=_comm(pid)
                )
        return list(seen.values())

    def engine_memory_gb(self, session: int, indices: list[int]) -> float | None:
        """
        Blocking: the GPU memory an engine's processes hold (NVML's compute
        processes whose session is the engine's: it runs in a session of
        its own, its workers with it).

        @param session: the engine's pid, its session's id.
        @param indices: its GPUs.
        @return: GB per GPU, averaged over C{indices}; L{None} when NVML
            cannot tell.
        """
        nvml = self._nvml
        total = 0
        try:
            for index in indices:
                handle = self._handles[index]
                for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    try:
                        ours = os.getsid(int(process.pid)) == session
                    except OSError:
                        continue
                    if ours and process.usedGpuMemory is not None:
                        total += int(process.usedGpuMemory)
        except (KeyError, nvml.NVMLError):
            return None
        return total / max(len(indices), 1) / 1024**3 if indices else None

    def _xids(self) -> list[tuple[int, str]]:
        if self._events is None:
            return []
        nvml = self._nvml
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        seen = []
        for _ in range(_MAX_EVENTS):
            try:
                data = wait(self._events, 0)
            except nvml.NVMLError as e:
                if getattr(e, "value", None) != _ERROR_TIMEOUT:
                    self._warnings.append(f"reading NVML events: {e}")
                break
            xid = int(data.eventData)
            if xid in APPLICATION_XIDS:
                continue
            try:
                index = int(nvml.nvmlDeviceGetIndex(data.device))
            except nvml.NVMLError:
                continue
            seen.append((index, f"xid {xid}"))
        return seen


def simulated_gpus(
    node_id: str, specs: list[tuple[str, float]], first_index: int
) -> list[pb.Gpu]:
    """
    @param specs: C{(name, memory_gb)} per simulated GPU, from
        C{[[simulated_gpus]]}.
    @param first_index: the index after the real GPUs.
    @return: GPUs marked simulated, so the sim engine can be placed on
        machines without GPUs.
    """
    return [
        pb.Gpu(
            index=first_index + i,
            uuid=f"sim-{node_id}-{first_index + i}",
            name=name,
            memory_total_mib=int(memory_gb * 1024),
            memory_used_mib=0,
            simulated=True,
        )
        for i, (name, memory_gb) in enumerate(specs)
    ]


def discover(
    node_id: str,
    specs: list[tuple[str, float]],
    load: Callable[[], Any] = load_nvml,
) -> tuple[list[pb.Gpu], Nvml | None]:
    """
    Blocking (call it at start, before the reactor runs).

    @param load: returns the C{pynvml} module (tests give another one).
    @return: NVML's GPUs (none without NVML, said in the log) followed by
        the simulated ones; and NVML, started, if it is there.
    """
    try:
        nvml = Nvml(load())
        real = nvml.start()
    except RuntimeError as e:
        log.info("no GPUs from NVML on this machine: {reason}", reason=str(e))
        return simulated_gpus(node_id, specs, 0), None
    return real + simulated_gpus(node_id, specs, len(real)), nvml


class GpuMonitor:
    """
    The GPUs' part of the heartbeats.  L{heartbeat} answers at once from
    the last reading and asks NVML again in a thread, so a heartbeat is
    never late for NVML; the memory it tells is one heartbeat old.

    @param gpus: the GPUs the agent registered with; their C{problems}
        grow with those found, so that a later Register carries them.
    @param nvml: started, or L{None} without NVML (simulated GPUs only).
    @param in_thread: runs a blocking call in a thread; returns a Deferred
        of its result (L{twisted.internet.threads.deferToThread}).
    @param simulated: per simulated GPU's index, the MiB its sim engines
        hold now
        (L{llmgw.agent.supervisor.Supervisor.simulated_memory_mib}): what
        the heartbeats report for it.
    @param sessions: the pids of the agent's engines now (each its
        session's id): NVML's processes in those sessions are managed.
    """

    def __init__(
        self,
        gpus: list[pb.Gpu],
        nvml: Nvml | None,
        in_thread: Callable[[Callable[[], Any]], Deferred[Any]],
        simulated: Callable[[], dict[int, int]] = dict,
        sessions: Callable[[], frozenset[int]] = frozenset,
    ) -> None:
        self._simulated = simulated
        self._sessions = sessions
        self._processes: dict[int, list[pb.GpuProcess]] = {}
        self._gpus = {g.index: g for g in gpus}
        self._nvml = nvml
        self._in_thread = in_thread
        self._new: dict[int, list[str]] = {}
        self._reading: Deferred[None] | None = None

    def heartbeat(self) -> pb.Heartbeat:
        """
        @return: each GPU's memory in use and its problems new since the
            last heartbeat; a new reading is asked for.
        """
        new, self._new = self._new, {}
        held = self._simulated()
        for gpu in self._gpus.values():
            if gpu.simulated:
                gpu.memory_used_mib = held.get(gpu.index, 0)
        message = pb.Heartbeat(
            gpus=[
                pb.GpuUsage(
                    index=g.index,
                    memory_used_mib=g.memory_used_mib,
                    new_problems=new.get(g.index, []),
                    processes=self._processes.get(g.index, [])[:MAX_PROCESSES],
                    foreign_used_mib=foreign_mib(self._processes.get(g.index, [])),
                )
                for g in self._gpus.values()
            ]
        )
        self.refresh()
        return message

    def refresh(self) -> Deferred[None] | None:
        """
        Read NVML in a thread, unless a reading is under way.

        @return: fires once the reading is applied; L{None} when there is
            nothing to read or a reading is under way.
        """
        if self._nvml is None or self._reading is not None:
            return None
        nvml, sessions = self._nvml, self._sessions()
        reading: Deferred[None] = self._in_thread(
            lambda: nvml.poll(sessions)
        ).addCallbacks(
            self._apply,
            lambda failure: log.failure("reading NVML", failure),
        )
        self._reading = reading

        def done(result: object) -> None:
            self._reading = None

        reading.addBoth(done)
        return reading

    def _apply(
        self,
        found: dict[int, tuple[int | None, list[str], list[pb.GpuProcess] | None]],
    ) -> None:
        if self._nvml is not None:
            for warning in self._nvml.take_warnings():
                log.warn("{reason}", reason=warning)
        for index, (used, problems, processes) in found.items():
            gpu = self._gpus.get(index)
            if gpu is None:
                continue
            if used is not None:
                gpu.memory_used_mib = used
            if processes is not None:
                self._processes[index] = processes
            for problem in problems:
                if problem in gpu.problems or len(gpu.problems) >= MAX_PROBLEMS:
                    continue
                log.warn("GPU {index}: {problem}", index=index, problem=problem)
                gpu.problems.append(problem)
                self._new.setdefault(index, []).append(problem)
