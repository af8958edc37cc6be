"""
C{llmgw sim}: run the engine simulator until SIGINT or SIGTERM.

The only module of the simulator that touches the global reactor.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import cast

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.interfaces import IListeningPort
from twisted.logger import (
    FilteringLogObserver,
    LogLevel,
    LogLevelFilterPredicate,
    globalLogBeginner,
    textFileLogObserver,
)

from llmgw.sim.core import Core, CoreProcess
from llmgw.sim.engine import (
    SimConfig,
    Simulator,
)
from llmgw.sim.faults import (
    FaultError,
    parse_fault_option,
)
from llmgw.sim.lora import ENV, LoraConfig
from llmgw.sim.sleep import UNSUPPORTED, SleepConfig
from llmgw.sim.web import SimSite


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"seconds must be >= 0: {text!r}")
    return value


def _count(minimum: int) -> type[int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}: {text!r}")
        return value

    return parse  # type: ignore[return-value]


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _fault(text: str) -> tuple[str, object]:
    try:
        return parse_fault_option(text)
    except FaultError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _serving(p: argparse.ArgumentParser) -> None:
    """
    Where it listens and what it serves.
    """
    p.add_argument(
        "--port",
        type=_count(0),
        required=True,
        metavar="P",
        help="TCP port; 0 picks one",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface (default 127.0.0.1)")
    p.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="NAME",
        help="a served model name (repeatable)",
    )


def _timing(p: argparse.ArgumentParser) -> None:
    """
    How fast it answers, and how much.
    """
    p.add_argument(
        "--ttft",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="seconds to first token",
    )
    p.add_argument(
        "--itl",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="seconds between tokens",
    )
    p.add_argument(
        "--max-model-len",
        type=_count(0),
        metavar="TOKENS",
        default=0,
        help="context length, as vLLM's flag: a longer prompt gets a 400"
        " (default 0: none)",
    )
    p.add_argument(
        "--max-tokens",
        type=_count(0),
        metavar="N",
        default=16,
        help="completion tokens when the request sets none (default 16)",
    )
    p.add_argument(
        "--load-seconds",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="seconds before it listens, as an engine loading its weights does"
        " (vLLM opens its port once the model is loaded; default 0)",
    )


def _capacity(p: argparse.ArgumentParser) -> None:
    """
    How much it holds at once, and its prefix cache.
    """
    p.add_argument(
        "--max-concurrency",
        type=_count(1),
        metavar="N",
        default=256,
        help="concurrent sequences; more wait in a FIFO queue (default 256)",
    )
    p.add_argument(
        "--max-queue",
        type=_count(0),
        metavar="N",
        default=1024,
        help="waiting requests beyond which requests get 503 (default 1024)",
    )
    p.add_argument(
        "--speed",
        type=_factor,
        default=1.0,
        metavar="FACTOR",
        help="this replica's speed: --ttft, --itl and --prefill-per-token are "
        "divided by it (0.5: twice as slow; default 1)",
    )
    p.add_argument(
        "--prefill-per-token",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="prefill seconds per prompt token not in the prefix cache, added "
        "to --ttft (default 0)",
    )
    p.add_argument(
        "--kv-capacity",
        type=_count(0),
        default=0,
        metavar="TOKENS",
        help="tokens (prompt + completion) running sequences may hold together; "
        "more requests wait, shown in vllm:num_requests_waiting (default 0: "
        "no limit)",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=_count(0),
        default=None,
        metavar="TOKENS",
        help="tokens of 16-token blocks the LRU prefix cache keeps (default: "
        "--kv-capacity; 0: none)",
    )


def _behaviour(p: argparse.ArgumentParser) -> None:
    """
    Embeddings, faults, logging, its API key.
    """
    p.add_argument(
        "--embedding-dim",
        type=_count(1),
        metavar="N",
        default=16,
        help="floats per embedding",
    )
    p.add_argument(
        "--fault",
        type=_fault,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a process-wide fault, VALUE in JSON (repeatable): status, "
        "stall_before_first_byte, stall_after_chunks, stall_seconds, "
        "drop_after_chunks, byte_writes",
    )
    p.add_argument(
        "--reasoning-parser",
        default="",
        metavar="NAME",
        help="as vLLM's: chat answers open with reasoning, given in the message's"
        " and the deltas' 'reasoning' field (any NAME: the sim has one parser)",
    )
    p.add_argument("--verbose", action="store_true", help="log each request")
    p.add_argument(
        "--engine-core-process",
        action="store_true",
        help="run a child process standing in for vLLM's EngineCore, in this"
        " process's group: killing it makes /health answer 503 and requests"
        " 500 (EngineDeadError), and the first such request or the next look"
        " of vLLM's watchdog (every 5 s) ends the simulator; killing the"
        " simulator leaves it running (llmgw.sim.core)",
    )
    p.add_argument(
        "--api-key",
        default="",
        metavar="KEY",
        help="require Authorization: Bearer KEY on /v1 routes (401 without), as"
        " vLLM's --api-key; /health and /metrics stay open",
    )


def _gb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GB: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"GB must be >= 0: {text!r}")
    return value


def _sleeping(p: argparse.ArgumentParser) -> None:
    """
    Sleep mode, as vLLM's and SGLang's (L{llmgw.sim.sleep}).
    """
    p.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="serve vLLM's sleep routes (POST /sleep?level=N, POST /wake_up, GET "
        "/is_sleeping) and SGLang's (POST /release_memory_occupation, POST "
        "/resume_memory_occupation); without it they answer 404",
    )
    p.add_argument(
        "--sleep-mode-unsupported",
        action="store_true",
        help="with --enable-sleep-mode, exit at start as vLLM does on a CPU "
        '("Sleep mode is not supported on current platform.")',
    )
    p.add_argument(
        "--sleep-seconds",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="seconds going to sleep takes (default 0)",
    )
    p.add_argument(
        "--wake-seconds",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="seconds waking takes (default 0)",
    )
    p.add_argument(
        "--gpu-memory-gb",
        type=_gb,
        default=0.0,
        metavar="GB",
        help="GPU memory it holds on each GPU while awake, shown in /sim/stats"
        " (default 0)",
    )
    p.add_argument(
        "--sleep-gpu-memory-gb",
        type=_gb,
        default=0.0,
        metavar="GB",
        help="GPU memory it keeps on each GPU while asleep (default 0)",
    )
    p.add_argument(
        "--release-seconds",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="seconds after a sleep ends, or the process exits, before the"
        " memory it gave back shows free (a GPU's driver and NVML lag the"
        " process; default 0)",
    )


def _lora(p: argparse.ArgumentParser) -> None:
    """
    LoRA adapters, as vLLM's (L{llmgw.sim.lora}).
    """
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters; with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in"
        " the environment, POST /v1/load_lora_adapter and /v1/unload_lora_adapter"
        " as vLLM's",
    )
    p.add_argument("--max-loras", type=int, default=1, metavar="N")
    p.add_argument("--max-lora-rank", type=int, default=16, metavar="RANK")
    p.add_argument(
        "--lora-load-seconds",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="seconds a load takes (default 0)",
    )


def build_parser() -> argparse.ArgumentParser:
    """
    The C{llmgw sim} argument parser.
    """
    p = argparse.ArgumentParser(
        prog="llmgw sim",
        description="An OpenAI-compatible fake LLM engine with vLLM's metrics, "
        "for tests, benchmarks and config rehearsals.",
    )
    for add in (_serving, _timing, _capacity, _behaviour, _sleeping, _lora):
        add(p)
    return p


def sim_config(args: argparse.Namespace) -> SimConfig:
    """
    The simulator's settings from parsed arguments.

    @param args: what L{build_parser}'s parser returned.
    """
    return SimConfig(
        models=tuple(args.model),
        ttft=args.ttft,
        itl=args.itl,
        max_tokens=args.max_tokens,
        max_model_len=args.max_model_len,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        embedding_dim=args.embedding_dim,
        verbose=args.verbose,
        reasoning_parser=args.reasoning_parser,
        api_key=args.api_key,
        speed=args.speed,
        prefill_per_token=args.prefill_per_token,
        kv_capacity=args.kv_capacity,
        prefix_cache_tokens=args.kv_capacity
        if args.prefix_cache_tokens is None
        else args.prefix_cache_tokens,
        sleep=SleepConfig(
            enabled=args.enable_sleep_mode,
            unsupported=args.sleep_mode_unsupported,
            sleep_seconds=args.sleep_seconds,
            wake_seconds=args.wake_seconds,
            gpu_memory_gb=args.gpu_memory_gb,
            sleep_gpu_memory_gb=args.sleep_gpu_memory_gb,
            release_seconds=args.release_seconds,
        ),
        lora=LoraConfig(
            enabled=args.enable_lora,
            runtime=os.environ.get(ENV, "").lower() in ("true", "1"),
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            load_seconds=args.lora_load_seconds,
        ),
    )


def main(argv: list[str]) -> int:
    """
    Run the simulator until SIGINT or SIGTERM.

    Prints C{llmgw sim listening on http://HOST:PORT} to stdout once
    listening.

    @param argv: the arguments after C{sim}.
    @return: 0 after a signal, 1 when the port cannot be bound or sleep
        mode is refused (C{--sleep-mode-unsupported}); bad
        arguments exit with status 2 through argparse.
    """
    args = build_parser().parse_args(argv)
    from twisted.internet import reactor
    from twisted.internet.error import CannotListenError

    config = sim_config(args)
    if config.sleep.enabled and config.sleep.unsupported:
        # As vLLM on a CPU: its config check raises, the traceback's last
        # line names why, and the process exits 1.
        sys.stderr.write(f"{UNSUPPORTED}\n")
        return 1
    level = LogLevel.info if args.verbose else LogLevel.warn
    globalLogBeginner.beginLoggingTo(
        [
            FilteringLogObserver(
                textFileLogObserver(sys.stderr),
                [LogLevelFilterPredicate(defaultLogLevel=level)],
            )
        ],
        redirectStandardIO=False,
    )
    # Its end stops listening here first where a hung call holds it.
    ports: list[IListeningPort] = []
    core = Core(reactor, reactor.stop, lambda: [p.stopListening() for p in ports])
    sim = Simulator(config, reactor, core)
    sim.set_faults(dict(args.fault))
    # Nothing to serve while "loading": the port stays closed, as a real
    # engine's does (SIGTERM meanwhile ends the process at once).
    time.sleep(args.load_seconds)
    if args.load_seconds:
        # vLLM's line (vllm/v1/worker/gpu_model_runner.py), which an agent
        # reads for where a start spent its time (llmgw.agent.phases).
        sys.stdout.write(f"Loading weights took {args.load_seconds:.4f} seconds\n")
    try:
        port = reactor.listenTCP(
            args.port,
            SimSite(sim),  # type: ignore[arg-type]
            interface=args.host,
            # Twisted's default backlog of 50 drops connections in a burst
            # of hundreds of clients, as a gateway's pool can open.
            backlog=1024,
        )
    except CannotListenError as e:
        sys.stderr.write(f"llmgw sim: {e}\n")
        return 1
    ports.append(port)
    address = cast(IPv4Address | IPv6Address, port.getHost())
    host = f"[{address.host}]" if ":" in address.host else address.host
    if args.engine_core_process:
        child = CoreProcess(reactor, reactor, core)
        child.start()
        reactor.addSystemEventTrigger("before", "shutdown", child.stop)
    sys.stdout.write(f"llmgw sim listening on http://{host}:{address.port}\n")
    sys.stdout.flush()
    reactor.run()
    return 0
