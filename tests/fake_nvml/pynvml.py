"""
A fake C{pynvml} for a real C{twistd llmgw-agent} (no GPU here): found
first on the agent's C{PYTHONPATH} (L{tests.support.fake_nvml_env}), it
answers the calls llmgw makes as NVML does on a machine with the GPUs
that the JSON file named by C{FAKE_NVML_STATE} describes, read again at
every call so that a test can change them while the agent runs::

    {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "total_mib": 81559,
               "reserved_mib": 500,
               "processes": [{"pid": 1234, "used_mib": 30720}]}]}

As the real one: C{nvmlDeviceGetMemoryInfo} in bytes, C{used} being the
processes' memory plus what the driver reserves; the running processes'
C{usedGpuMemory} in bytes (L{None} where the file says C{null}, as in a
container without the rights); the names as C{str} (nvidia-ml-py 12 and
later); Xid events not supported (C{NVML_ERROR_NOT_SUPPORTED}), as on a
GPU without them.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

NVML_ERROR_NOT_SUPPORTED = 3
_MIB = 1024 * 1024


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__({3: "Not Supported"}.get(value, f"error {value}"))
        self.value = value


def _gpus() -> list[dict[str, Any]]:
    with open(os.environ["FAKE_NVML_STATE"]) as f:
        gpus: list[dict[str, Any]] = json.load(f)["gpus"]
    return gpus


def nvmlInit() -> None:
    _gpus()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    return index


def nvmlDeviceGetIndex(handle: int) -> int:
    return handle


def nvmlDeviceGetName(handle: int) -> str:
    return str(_gpus()[handle]["name"])


def nvmlDeviceGetUUID(handle: int) -> str:
    return f"GPU-fake-{handle}"


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    gpu = _gpus()[handle]
    used = gpu.get("reserved_mib", 0) + sum(
        p["used_mib"] or 0 for p in gpu.get("processes", ())
    )
    total = gpu["total_mib"] * _MIB
    return SimpleNamespace(total=total, used=used * _MIB, free=total - used * _MIB)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(
            pid=p["pid"],
            usedGpuMemory=None if p["used_mib"] is None else p["used_mib"] * _MIB,
        )
        for p in _gpus()[handle].get("processes", ())
    ]


def nvmlDeviceGetGraphicsRunningProcesses(handle: int) -> list[SimpleNamespace]:
    return []


def nvmlEventSetCreate() -> Any:
    raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
