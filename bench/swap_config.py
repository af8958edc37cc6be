"""
The swap bench's configuration (L{swap_bench}): the simulated durations,
the server's file for a policy, the agent's file, and the price of the
simulated GPUs (for the cost check, L{cost_check}).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MODELS = ("m0", "m1", "m2", "m3")

GPU_HOUR = 2.0
"""
The price per GPU-hour of the simulated A100s (C{[cost] gpu_hour}).
"""


@dataclass(frozen=True)
class Shape:
    """
    The simulated durations, seconds.
    """

    cold: float = 20.0
    wake: float = 2.0
    sleep: float = 1.0
    ttft: float = 0.3
    itl: float = 0.03
    tokens: int = 16
    activation_timeout: float = 120.0
    idle_timeout: float = 600.0


def server_config(
    ca: str, policy: dict[str, Any], shape: Shape, compress: float, ports: int
) -> str:
    def d(seconds: float) -> str:
        return f'"{seconds / compress:.3f}s"'

    control = [
        f"evict = {'true' if policy['evict'] else 'false'}",
        'interval = "100ms"',
        'startup_grace = "0s"',
        f"port_range = [{ports}, {ports + 40}]",
    ]
    if policy["swap_max_wait"] is not None:
        control.append(f"swap_max_wait = {d(policy['swap_max_wait'])}")
    if policy.get("in_use"):
        control.append(f"swap_in_use = {d(policy['in_use'])}")
    sim_args = [
        "--load-seconds",
        f"{shape.cold / compress:.3f}",
        "--ttft",
        f"{shape.ttft / compress:.4f}",
        "--itl",
        f"{shape.itl / compress:.4f}",
    ]
    if policy["sleep"] != "off":
        sim_args += [
            "--wake-seconds",
            f"{shape.wake / compress:.3f}",
            "--sleep-seconds",
            f"{shape.sleep / compress:.3f}",
        ]
    models = "".join(
        f"""
[[models]]
name = "{name}"
min_replicas = 0
max_replicas = 1
idle_timeout = {d(shape.idle_timeout)}
min_resident = {d(policy["resident"])}
[[models.profiles]]
name = "one-gpu"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 60
sleep = "{policy["sleep"]}"
sleep_host_memory_gb = 1
args = {json.dumps(sim_args)}
"""
        for name in MODELS
    )
    return (
        f'[agent_tls]\nca = "{ca}/ca.pem"\ncert = "{ca}/server.pem"\n'
        f'key = "{ca}/server-key.pem"\n'
        f"[router]\nactivation_timeout = {d(shape.activation_timeout)}\n"
        "activation_queue = 1000\n"
        "[control]\n" + "\n".join(control) + "\n"
        f'[cost]\ngpu_hour = [{{gpu = "*", price = {GPU_HOUR}}}]\n' + models
    )


AGENT_CONFIG = """
address = "127.0.0.1"
sleep_memory = "8GiB"
[[simulated_gpus]]
name = "A100-80GB"
memory_gb = 80
[[simulated_gpus]]
name = "A100-80GB"
memory_gb = 80
"""
