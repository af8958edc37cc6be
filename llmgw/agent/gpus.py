"""
GPU discovery through NVML (the C{pynvml} module of the C{nvidia-ml-py}
package), plus GPUs simulated from the configuration.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger

from llmgw.wire import agent_pb2 as pb

log = Logger()
_MIB = 1024 * 1024


def nvml_gpus() -> list[pb.Gpu]:
    """
    @return: the GPUs NVML sees, memory in MiB; none where NVML is missing
        (no driver, no library), which is logged once by the caller.
    @raise RuntimeError: NVML is not available, with the reason.
    """
    try:
        import pynvml
    except ImportError as e:
        raise RuntimeError(f"pynvml is not installed: {e}") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise RuntimeError(f"NVML is not available: {e}") from None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory: Any = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            gpus.append(
                pb.Gpu(
                    index=index,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_total_mib=int(memory.total) // _MIB,
                    memory_used_mib=int(memory.used) // _MIB,
                )
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


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


def discover(node_id: str, specs: list[tuple[str, float]]) -> list[pb.Gpu]:
    """
    @return: NVML's GPUs (none without NVML, said in the log) followed by
        the simulated ones.
    """
    try:
        real = nvml_gpus()
    except RuntimeError as e:
        log.info("no GPUs from NVML on this machine: {reason}", reason=str(e))
        real = []
    return real + simulated_gpus(node_id, specs, len(real))
