"""
C{scripts/gpu-check}: what this node's agent would report about its GPUs,
read through NVML as the agent reads it (L{llmgw.agent.gpus.Nvml}), and
what a GPU node's operator wants to see beside it: the processes on each
GPU, whether it reports Xid errors, its NVLink links and fabric state where
it has them.

Exit status: 0 when everything the agent reads was read (NVML, the GPU
list, each GPU's memory, Xid events); 1 otherwise, each failure on its own
line.  The processes, NVLink and fabric lines are for the operator: the
agent does not read them, and a GPU without NVLink or fabric is not a
failure.

NVML calls (C{pynvml}, the C{nvidia-ml-py} package):
C{nvmlDeviceGetComputeRunningProcesses}, C{nvmlDeviceGetNvLinkState} (per
link, up to C{NVML_NVLINK_MAX_LINKS}), C{nvmlDeviceGetGpuFabricInfo}
(Hopper and later, in NVSwitch systems).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

from llmgw.agent.gpus import Nvml, load_nvml

_MIB = 1024 * 1024
_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
_NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED
_NVLINK_MAX_LINKS = 18


def _optional(nvml: Any, name: str, *args: Any) -> tuple[Any, str]:
    """
    @return: the call's result and C{""}, or L{None} and why not (the
        error, C{"not supported"}, or C{"not in this pynvml"}).
    """
    function: Callable[..., Any] | None = getattr(nvml, name, None)
    if function is None:
        return None, "not in this pynvml"
    try:
        return function(*args), ""
    except nvml.NVMLError as e:
        if getattr(e, "value", None) == _NOT_SUPPORTED:
            return None, "not supported"
        return None, str(e)


def _processes(nvml: Any, handle: Any) -> str:
    found, why = _optional(nvml, "nvmlDeviceGetComputeRunningProcesses", handle)
    if found is None:
        return f"processes: {why}"
    if not found:
        return "processes: none"
    listed = []
    for process in found:
        used = getattr(process, "usedGpuMemory", None)
        memory = f" {int(used) // _MIB} MiB" if isinstance(used, int) else ""
        listed.append(f"pid {process.pid}{memory}")
    return "processes: " + ", ".join(listed)


def _nvlink(nvml: Any, handle: Any) -> str:
    active = 0
    links = 0
    for link in range(_NVLINK_MAX_LINKS):
        state, why = _optional(nvml, "nvmlDeviceGetNvLinkState", handle, link)
        if state is None:
            if link == 0:
                return f"nvlink: {why}"
            break
        links += 1
        active += 1 if state else 0
    return f"nvlink: {active} of {links} links active"


def _fabric(nvml: Any, handle: Any) -> str:
    info, why = _optional(nvml, "nvmlDeviceGetGpuFabricInfo", handle)
    if info is None:
        return f"fabric: {why}"
    return f"fabric: state {info.state}, status {info.status}"


def check(nvml: Any, out: TextIO) -> int:
    """
    Print the report for the GPUs C{nvml} sees.

    @param nvml: the C{pynvml} module, or one that acts like it (tests).
    @param out: where the report goes.
    @return: the exit status: 0, or 1 when the agent could not read
        something (each such line starts with C{FAILED}).
    """
    agent = Nvml(nvml)
    try:
        gpus = agent.start()
    except RuntimeError as e:
        out.write(f"FAILED: {e}\n")
        return 1
    failures = 0
    if not gpus:
        out.write("FAILED: NVML sees no GPU\n")
        return 1
    out.write(f"{len(gpus)} GPUs, as the agent registers them:\n")
    events, why = _optional(nvml, "nvmlEventSetCreate")
    polled = agent.poll()
    for gpu in gpus:
        out.write(
            f"GPU {gpu.index}: {gpu.name}, {gpu.uuid},"
            f" {gpu.memory_total_mib} MiB, {gpu.memory_used_mib} MiB used\n"
        )
        handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
        used, problems, _ = polled.get(gpu.index, (None, [], None))
        for problem in problems:
            out.write(f"  FAILED: {problem}\n")
            failures += 1
        if events is None:
            out.write(f"  FAILED: xid events: {why}\n")
            failures += 1
        else:
            _, refused = _optional(
                nvml, "nvmlDeviceRegisterEvents", handle, _XID_CRITICAL, events
            )
            if refused:
                out.write(f"  FAILED: xid events: {refused}\n")
                failures += 1
            else:
                out.write("  xid events: yes\n")
        for line in (
            _processes(nvml, handle),
            _nvlink(nvml, handle),
            _fabric(nvml, handle),
        ):
            out.write(f"  {line}\n")
    out.write("gpu-check: " + (f"{failures} FAILED" if failures else "ok") + "\n")
    return 1 if failures else 0


def main() -> int:
    """
    The script: the real C{pynvml}.

    @return: the exit status (see L{check}).
    """
    try:
        nvml = load_nvml()
    except RuntimeError as e:
        print(f"FAILED: {e}")
        return 1
    return check(nvml, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
