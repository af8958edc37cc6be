"""
Models of mixed sizes on shared GPUs (issue 36 items 2 and 4): one node
with 2 simulated 80 GB GPUs, six models from 10 to 60 GB, two of them
sleepers that keep memory asleep (45 GB and 2 GB), and the swap bench's
moving workload (as L{swap_bench.workload}) over them, served with GPUs taken
whole and with GPUs shared, the same requests for each.

    .venv/bin/python bench/mixed_bench.py [--minutes 10] [--compress 6]
        [--policies whole,shared] [--json results.json]

The policies, as configuration (both evict, the sleepers sleep, as the
swap bench's C{sleep} policy):

- C{whole}: no profile says C{share_gpu}: every replica takes a GPU whole,
  as before issue 36;
- C{shared}: every profile says C{share_gpu = true}: replicas go where
  their C{gpu_memory_gb} fits beside others, eviction frees only what a
  newcomer needs.

Reported per policy, besides the swap bench's figures (time to first token
p50, p95, p99 in simulated seconds, requests failed, swaps per simulated
minute, cold starts, wakes): the most replicas awake at once, and
placements over a GPU's memory: the sets of replicas on one GPU that the
GPU (the sim's memory report, as the agent tells it) reported using more
memory than it has, sampled every 0.25 s of wall time; 0 is the target,
with sleepers that keep memory as here.  The sims give memory back
C{--release} simulated seconds after a sleep or an exit (their
C{--release-seconds}), as a real GPU shows it free only a moment later.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from children import BenchError, Children
from swap_bench import (
    AGENT_CONFIG,
    BIN,
    REQUEST_TIMEOUT,
    Outcome,
    Shape,
    Tally,
    _certs,
    _free_port,
    _get,
    _kill_engines,
    _metric_sum,
    _percentile,
    _stream,
)

SIZES = {
    # name: (GB awake, GB kept asleep, or None: it stops when evicted)
    "s10": (10.0, None),
    "s20a": (20.0, None),
    "s20b": (20.0, None),
    "big60": (60.0, None),
    "xb47": (47.0, 45.0),
    "yb30": (30.0, 2.0),
}

POLICIES = ("whole", "shared")


def workload(
    seed: int, minutes: float, rate: float, burst: float
) -> list[tuple[float, str]]:
    """
    The swap bench's workload (L{swap_bench.workload}) over these models:
    Poisson arrivals at C{rate} a simulated second, a hot model changing
    after a mean C{burst} seconds taking 70 %, the rest spread over all.

    @return: C{(simulated seconds from the start, model)} per request.
    """
    rng = random.Random(seed)
    names = list(SIZES)
    out: list[tuple[float, str]] = []
    now, hot = 0.0, names[0]
    switch = rng.expovariate(1 / burst)
    while True:
        now += rng.expovariate(rate)
        if now >= minutes * 60:
            return out
        while now >= switch:
            hot = rng.choice([m for m in names if m != hot])
            switch += rng.expovariate(1 / burst)
        out.append((now, hot if rng.random() < 0.7 else rng.choice(names)))


def _config(
    ca: str, shared: bool, shape: Shape, compress: float, ports: int, release: float
) -> str:
    def d(seconds: float) -> str:
        return f'"{seconds / compress:.3f}s"'

    sim = [
        "--load-seconds",
        f"{shape.cold / compress:.3f}",
        "--ttft",
        f"{shape.ttft / compress:.4f}",
        "--itl",
        f"{shape.itl / compress:.4f}",
        "--wake-seconds",
        f"{shape.wake / compress:.3f}",
        "--sleep-seconds",
        f"{shape.sleep / compress:.3f}",
    ]
    if release:
        # Memory given back shows free this much later, as on a real GPU.
        sim += ["--release-seconds", f"{release / compress:.3f}"]
    models = ""
    for name, (gb, kept) in SIZES.items():
        models += f"""
[[models]]
name = "{name}"
min_replicas = 0
max_replicas = 1
idle_timeout = {d(shape.idle_timeout)}
min_resident = {d(10.0)}
[[models.profiles]]
name = "p"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = {gb}
{"share_gpu = true" if shared else ""}
sleep = "{"weights" if kept is not None else "off"}"
sleep_gpu_memory_gb = {kept if kept is not None else 1.0}
sleep_host_memory_gb = 1
args = {json.dumps(sim)}
"""
    return (
        f'[agent_tls]\nca = "{ca}/ca.pem"\ncert = "{ca}/server.pem"\n'
        f'key = "{ca}/server-key.pem"\n'
        f"[router]\nactivation_timeout = {d(shape.activation_timeout)}\n"
        "activation_queue = 1000\n[control]\nevict = true\n"
        'interval = "100ms"\nstartup_grace = "0s"\n'
        f'swap_max_wait = "0s"\nport_range = [{ports}, {ports + 40}]\n' + models
    )


class Watch:
    """
    What the sampler saw: each set of replicas on one GPU reported over
    its memory, the most used over total, the most replicas awake.
    """

    def __init__(self) -> None:
        self.over: set[tuple[str, int, frozenset[str]]] = set()
        self.most_used = 0.0
        self.most_awake = 0


def _look(admin: str, watch: Watch) -> None:
    nodes = _get(admin + "/api/v1/nodes")["nodes"]
    replicas = _get(admin + "/api/v1/replicas")["replicas"]
    on: dict[tuple[str, int], set[str]] = {}
    awake = 0
    for r in replicas:
        if r["state"] in ("ready", "starting", "waking", "draining"):
            awake += 1
        for s in r["shards"]:
            if s["state"] not in ("stopped", "failed", "lost"):
                for g in s["gpus"]:
                    on.setdefault((s["node"], g), set()).add(r["id"])
    watch.most_awake = max(watch.most_awake, awake)
    for node in nodes:
        for gpu in node["gpus"]:
            used, total = gpu["memory_used_mib"], gpu["memory_total_mib"]
            watch.most_used = max(watch.most_used, used / total)
            if used > total:
                held = frozenset(on.get((node["id"], gpu["index"]), ()))
                watch.over.add((node["id"], gpu["index"], held))


async def _drive(
    port: int,
    admin: str,
    requests: list[tuple[float, str]],
    compress: float,
    shape: Shape,
) -> tuple[Tally, Watch]:
    tally, watch = Tally(), Watch()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def sample() -> None:
        while not stop.is_set():
            try:
                await loop.run_in_executor(None, _look, admin, watch)
            except (OSError, ValueError, KeyError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except TimeoutError:
                pass

    sampler = asyncio.ensure_future(sample())
    start = time.monotonic()

    async def one(at: float, model: str) -> None:
        await asyncio.sleep(max(0.0, start + at / compress - time.monotonic()))
        outcome = Outcome(model)
        tally.outcomes.append(outcome)
        try:
            await asyncio.wait_for(
                _stream(port, model, outcome, compress, shape), REQUEST_TIMEOUT
            )
        except TimeoutError:
            outcome.failed = "timed out"

    await asyncio.gather(*(one(at, model) for at, model in requests))
    stop.set()
    await sampler
    return tally, watch


def _start(children: Children, directory: str, ca: str, config: str) -> tuple[int, str]:
    """
    Start the server and the agent.

    @return: the client API's port and the admin API's URL, once the node
        registered.
    """
    api, admin, agents = _free_port(), _free_port(), _free_port()
    twistd = os.path.join(BIN, "twistd")
    server = children.start(
        "server",
        "0",
        [twistd, "-n", "--pidfile=", "llmgw-server", "--config", config]
        + ["--state-dir", os.path.join(directory, "server-state")]
        + ["--listen", f"tcp:{api}:interface=127.0.0.1"]
        + ["--admin-listen", f"tcp:{admin}:interface=127.0.0.1"]
        + ["--agent-listen", f"tcp:{agents}:interface=127.0.0.1"],
    )
    server.wait_for(r"client API listening")
    agent_config = os.path.join(directory, "agent.toml")
    with open(agent_config, "w") as f:
        f.write(AGENT_CONFIG)
    agent = children.start(
        "agent",
        "0",
        [twistd, "-n", "--pidfile=", "llmgw-agent", "--config", agent_config]
        + ["--server", f"127.0.0.1:{agents}", "--node-id", "node-1"]
        + ["--tls-dir", os.path.join(ca, "agents", "node-1")]
        + ["--state-dir", os.path.join(directory, "agent-state")],
    )
    agent.wait_for(r"GPUs \(2 simulated\)")
    url = f"http://127.0.0.1:{admin}"
    deadline = time.monotonic() + 30
    while not _get(url + "/api/v1/nodes")["nodes"]:
        if time.monotonic() > deadline:
            raise BenchError("the agent did not register in 30 s")
        time.sleep(0.2)
    return api, url


def run_policy(
    name: str,
    requests: list[tuple[float, str]],
    compress: float,
    shape: Shape,
    keep: bool,
    release: float = 0.0,
) -> dict[str, Any]:
    """
    Start a server and an agent with the policy's configuration, send the
    requests, and measure.
    """
    directory = tempfile.mkdtemp(prefix=f"llmgw-mixed-{name}-")
    children = Children(directory, pin=False)
    try:
        ca = _certs(directory)
        config = os.path.join(directory, "server.toml")
        ports = random.randrange(21000, 30000)
        with open(config, "w") as f:
            f.write(_config(ca, name == "shared", shape, compress, ports, release))
        api, admin = _start(children, directory, ca, config)
        started = time.monotonic()
        tally, watch = asyncio.run(_drive(api, admin, requests, compress, shape))
        wall = time.monotonic() - started
        swaps = _metric_sum(admin, "llmgw_swaps_total", 'reason="idle_sleep"')
        starts = _metric_sum(admin, "llmgw_engine_starts_total")
        wakes = _metric_sum(admin, "llmgw_engine_wake_seconds_count")
    finally:
        children.stop_all()
        _kill_engines(os.path.join(directory, "agent-state", "shards"))
        if not keep:
            subprocess.run(["rm", "-rf", directory], check=False)
    minutes = wall * compress / 60
    ttfts = sorted(
        o.ttft for o in tally.outcomes if o.ttft is not None and not o.failed
    )
    failures: dict[str, int] = {}
    for o in tally.outcomes:
        if o.failed:
            failures[o.failed[:60]] = failures.get(o.failed[:60], 0) + 1
    return {
        "policy": name,
        "requests": len(tally.outcomes),
        "failed": sum(failures.values()),
        "failures": failures,
        "ttft_p50": _percentile(ttfts, 0.50),
        "ttft_p95": _percentile(ttfts, 0.95),
        "ttft_p99": _percentile(ttfts, 0.99),
        "swaps_per_minute": swaps / minutes if minutes else 0.0,
        "cold_starts": starts,
        "wakes": wakes,
        "over_memory": len(watch.over),
        "most_used": watch.most_used,
        "most_awake": watch.most_awake,
        "simulated_minutes": minutes,
        "wall_seconds": wall,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="simulated minutes")
    p.add_argument("--compress", type=float, default=6.0, help="time compression")
    p.add_argument("--rate", type=float, default=0.5, help="requests per sim second")
    p.add_argument("--burst", type=float, default=60.0, help="mean hot-model seconds")
    p.add_argument("--seed", type=int, default=36)
    p.add_argument("--policies", default=",".join(POLICIES), help="whole, shared")
    p.add_argument(
        "--release",
        type=float,
        default=1.0,
        help="simulated seconds before memory given back shows free (0: the"
        " flag is left out, for a server before it)",
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--keep", action="store_true", help="keep the logs' folder")
    args = p.parse_args(argv)
    shape = Shape()
    requests = workload(args.seed, args.minutes, args.rate, args.burst)
    results = []
    for name in args.policies.split(","):
        if name not in POLICIES:
            p.error(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
        print(f"policy {name}: {len(requests)} requests...", file=sys.stderr)
        results.append(
            run_policy(name, requests, args.compress, shape, args.keep, args.release)
        )
    print(
        f"{'policy':<7} {'requests':>8} {'failed':>6} {'ttft p50':>9} {'p95':>8}"
        f" {'p99':>8} {'swaps/min':>9} {'cold':>5} {'wakes':>5} {'awake':>5}"
        f" {'over mem':>8} {'most used':>9}"
    )
    for r in results:
        print(
            f"{r['policy']:<7} {r['requests']:>8} {r['failed']:>6}"
            f" {r['ttft_p50']:>9.2f} {r['ttft_p95']:>8.2f} {r['ttft_p99']:>8.2f}"
            f" {r['swaps_per_minute']:>9.2f} {r['cold_starts']:>5.0f}"
            f" {r['wakes']:>5.0f} {r['most_awake']:>5} {r['over_memory']:>8}"
            f" {r['most_used']:>9.2f}"
        )
    for r in results:
        if r["failures"]:
            print(f"{r['policy']} failures: {r['failures']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
