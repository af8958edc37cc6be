"""
Engine adapters: a shard's profile, port and GPUs turned into the command
line, environment and readiness probes of an inference engine.

Command lines follow each engine's documentation: C{vllm serve MODEL
--served-model-name --port --tensor-parallel-size} (vLLM), C{python -m
sglang.launch_server --model-path --served-model-name --port --tp-size --nnodes
--node-rank --dist-init-addr} (SGLang), C{llama-server -m --alias --port}
(llama.cpp) or C{python -m llama_cpp.server --model --model_alias --port}
(llama-cpp-python), and C{llmgw sim}; with C{StartShard.sleep_level} set,
each engine's sleep-mode flags (L{sleep_flags}, L{llmgw.agent.sleep}).

The engine's own secret (C{StartShard.api_key}) goes to each engine's flag:
C{--api-key} for vLLM, SGLang, llama-server and C{llmgw sim},
C{--api_key} for C{python -m llama_cpp.server} (its settings' field name).
What it protects, from each engine's source: vLLM's
C{AuthenticationMiddleware} checks only paths under C{/v1}; SGLang's
C{add_api_key_middleware} all but C{/health*} and C{/metrics*};
llama-server all but C{/health}, C{/v1/health}, C{/models}, C{/v1/models};
llama-cpp-python every route it has, C{/v1/models} (its health probe here)
included.  The probe sends the key every time: harmless where not needed.

Where an engine listens is decided here only (L{engine_url}): the launch,
the adoption of an engine a previous agent started, and every probe use
it.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from dataclasses import dataclass, field

from llmgw.wire import agent_pb2 as pb
from llmgw.wire.engines import ENGINES


class CommandRefused(Exception):
    """
    The agent refuses a command from the server; the message says why, and
    goes back in the command's C{CommandResult.error}.

    @ivar code: a failure the server acts on (C{"port_in_use"},
        C{"gpus_in_use"}), or C{""}.
    """

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class ProfileError(CommandRefused):
    """
    A shard cannot be launched as asked by its profile (engine, command
    line, environment, model source, port); the message says which check
    failed.
    """


@dataclass(frozen=True)
class Probe:
    """
    One readiness check: C{GET url} answers 200 and, when C{lists} is set,
    a JSON body whose C{data} holds an object with that C{id} (the
    OpenAI model list, C{GET /v1/models}).
    """

    url: str
    lists: str = ""


@dataclass(frozen=True)
class Launch:
    """
    How to run one shard.

    @ivar argv: the command line; C{argv[0]} is an executable path or name.
    @ivar env: variables added to the agent's environment.
    @ivar host: the interface the engine listens on.
    @ivar probes: all pass, in order, once the engine serves the model; none
        for a gang's follower that serves no HTTP (the leader's readiness
        waits for it).
    @ivar headers: sent with every probe (the engine's C{Authorization});
        not shown in the launch's repr, nor are C{argv} and C{env}.
    """

    argv: list[str] = field(repr=False)
    env: dict[str, str] = field(repr=False)
    host: str
    probes: tuple[Probe, ...]
    headers: dict[str, str] = field(default_factory=dict, repr=False)


def engine_url(host: str, port: int) -> str:
    """
    The one place that knows where an engine listening on C{host} is
    reached from its own node: a wildcard address on loopback.

    @param host: the interface the engine listens on (the node's
        C{address}).
    @param port: its port.
    @return: C{http://HOST:PORT}, an IPv6 host in brackets.
    """
    probe = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in probe:
        probe = f"[{probe}]"
    return f"http://{probe}:{port}"


def _cuda(gpus: list[int]) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)} if gpus else {}


def _leader(command: pb.StartShard) -> tuple[str, str]:
    host, _, port = command.leader_address.rpartition(":")
    return host.strip("[]"), port


def _serves(base: str, model: str) -> tuple[Probe, ...]:
    # vLLM and SGLang answer /health once the engine runs; the model list
    # names what a request may ask for (vLLM docs, "OpenAI-Compatible
    # Server"; SGLang docs, "Native APIs").
    return (Probe(base + "/health"), Probe(base + "/v1/models", model))


def _vllm(
    command: pb.StartShard, host: str, base: str
) -> tuple[list[str], tuple[Probe, ...]]:
    gpus = len(command.gpu_indices)
    args = list(command.args)
    argv = ["vllm", "serve", command.source, "--served-model-name", command.model]
    argv += ["--host", host, "--port", str(command.port)]
    if command.world_size <= 1:
        if gpus > 1 and "--tensor-parallel-size" not in args:
            argv += ["--tensor-parallel-size", str(gpus)]
        return argv, _serves(base, command.model)
    # A gang with vLLM's multiprocessing backend, as vLLM's docs give it
    # (docs/serving/parallelism_scaling.md, "Running vLLM with
    # MultiProcessing", vllm-project/vllm#30509): TP within a node, PP
    # across nodes, --nnodes/--node-rank/--master-addr (and --master-port:
    # ours, not its default 29501, so that two gangs on one leader do not
    # clash) on every node; followers run --headless (no API server).
    leader_host, leader_port = _leader(command)
    if "--tensor-parallel-size" not in args:
        argv += ["--tensor-parallel-size", str(max(gpus, 1))]
    if "--pipeline-parallel-size" not in args:
        argv += ["--pipeline-parallel-size", str(command.world_size)]
    argv += ["--nnodes", str(command.world_size), "--node-rank", str(command.rank)]
    argv += ["--master-addr", leader_host, "--master-port", leader_port]
    if command.rank > 0:
        return argv + ["--headless"], ()
    return argv, _serves(base, command.model)


def _sglang(
    command: pb.StartShard, host: str, base: str
) -> tuple[list[str], tuple[Probe, ...]]:
    gpus = len(command.gpu_indices)
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path"]
    argv += [command.source, "--served-model-name", command.model]
    argv += ["--host", host, "--port", str(command.port)]
    if gpus > 1 or command.world_size > 1:
        # --tp-size, SGLang's option (sglang/srt/server_args.py; alias
        # --tensor-parallel-size): the docs' --tp is only argparse's
        # abbreviation of it, which a new option sharing the prefix would
        # make ambiguous (tests/test_engine_parsers.py).
        tp = max(gpus, 1) * max(command.world_size, 1)
        argv += ["--tp-size", str(tp)]
    if command.world_size <= 1:
        return argv, _serves(base, command.model)
    # SGLang docs, "Multi-Node Deployment" (docs.sglang.io, references/
    # multi_node_deployment): the TP size over all the gang's GPUs, and on every
    # node --nnodes, --node-rank and --dist-init-addr HOST:PORT on rank 0;
    # only rank 0 serves the API.
    argv += ["--nnodes", str(command.world_size)]
    argv += ["--node-rank", str(command.rank)]
    argv += ["--dist-init-addr", command.leader_address]
    return argv, _serves(base, command.model) if command.rank == 0 else ()


def sleep_flags(command: pb.StartShard) -> tuple[list[str], dict[str, str]]:
    """
    @return: the arguments and environment variables that turn the
        engine's sleep mode on for C{command}: none when its
        C{sleep_level} is 0 or its engine has no sleep mode.
    """
    if not command.sleep_level:
        return [], {}
    if command.engine == "vllm":
        return ["--enable-sleep-mode"], {"VLLM_SERVER_DEV_MODE": "1"}
    if command.engine == "sglang":
        return ["--enable-memory-saver"], {}
    if command.engine == "sim":
        return ["--enable-sleep-mode"], {}
    return [], {}


def sim_memory_args(command: pb.StartShard) -> list[str]:
    """
    @return: for a sim engine, the GPU memory it holds awake and asleep
        as placement expects (C{StartShard.gpu_memory_gb},
        C{sleep_gpu_memory_gb}), before the profile's args, which may say
        otherwise.
    """
    if command.engine != "sim":
        return []
    args = ["--gpu-memory-gb", f"{command.gpu_memory_gb:g}"]
    return args + ["--sleep-gpu-memory-gb", f"{command.sleep_gpu_memory_gb:g}"]


def build(command: pb.StartShard, host: str = "127.0.0.1") -> Launch:
    """
    @param command: what to start: engine, source, args, env, port, GPUs,
        rank, world size, and for a gang the rendezvous C{HOST:PORT} of
        rank 0 (C{leader_address}).
    @param host: the interface the engine listens on: the node's address.
    @return: the launch, with the catalog name as the served model name,
        and the engine's secret (C{command.api_key}, when set) on its
        command line and in its probes' headers.
    @raise ProfileError: an unknown engine, or a gang of an engine that
        cannot form one (llama.cpp).
    """
    launch = _build(command, host)
    key = command.api_key
    if not key:
        return launch
    flag = "--api_key" if "llama_cpp.server" in launch.argv else "--api-key"
    # Last, after the profile's args: the engines' parsers keep the last
    # value, and the secret is not the profile's to change.
    return Launch(
        [*launch.argv, flag, key],
        launch.env,
        launch.host,
        launch.probes,
        {"Authorization": f"Bearer {key}"},
    )


def _build(command: pb.StartShard, host: str) -> Launch:
    port = str(command.port)
    gpus = list(command.gpu_indices)
    flags, sleep_env = sleep_flags(command)
    # The sleep flags and a sim's memory before the profile's args, which
    # may say otherwise (the engines' parsers keep the last value).
    args = [*flags, *sim_memory_args(command), *command.args]
    env = {**_cuda(gpus), **sleep_env, **dict(command.env)}
    base = engine_url(host, command.port)
    engine = command.engine
    if engine == "vllm":
        argv, probes = _vllm(command, host, base)
        return Launch(argv + args, env, host, probes)
    if engine == "sglang":
        argv, probes = _sglang(command, host, base)
        return Launch(argv + args, env, host, probes)
    if engine == "llamacpp":
        if command.world_size > 1:
            raise ProfileError("engine: llamacpp runs on one node (nodes = 1)")
        if shutil.which("llama-server"):
            # llama.cpp's server answers /health 503 while it loads the
            # model and 200 once it serves (tools/server/README.md).
            argv = ["llama-server", "-m", command.source, "--alias", command.model]
            argv += ["--host", host, "--port", port]
            return Launch(argv + args, env, host, (Probe(base + "/health"),))
        # python -m llama_cpp.server has no /health, and lists no model (an
        # empty list) while it loads: ready once the alias is listed.
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", command.source]
        argv += ["--model_alias", command.model, "--host", host, "--port", port]
        probes = (Probe(base + "/v1/models", command.model),)
        # Its server reads HOST and PORT from the environment over its
        # flags (llama_cpp/server/__main__.py: os.getenv("PORT", ...)): the
        # agent's own (a shell's PORT, make run's empty one) must not win.
        env = {**env, "HOST": host, "PORT": port}
        return Launch(argv + args, env, host, probes)
    if engine == "sim":
        # Each rank of a simulated gang is a whole simulator: all probed.
        argv = [sys.executable, "-m", "llmgw.cli.main", "sim", "--port", port]
        argv += ["--host", host, "--model", command.model]
        return Launch(argv + args, env, host, _serves(base, command.model))
    raise ProfileError(f"engine: unknown {engine!r} (known: {', '.join(ENGINES)})")


def check(command: pb.StartShard, launch: Launch, host: str = "127.0.0.1") -> None:
    """
    What can be checked before launching: the executable is present, a
    local model path exists, the port is free.

    @raise ProfileError: the first check that failed, named.
    """
    if not 0 < command.port < 65536:
        raise ProfileError(f"port: bad value {command.port}: expected 1 to 65535")
    for name, value in launch.env.items():
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise ProfileError(f"env: bad variable {name!r}")
    if any("\0" in arg for arg in launch.argv):
        raise ProfileError("args: an argument holds a NUL byte")
    if sum(len(arg) + 1 for arg in launch.argv) > 100_000:
        raise ProfileError("args: the command line is over 100000 bytes")
    executable = launch.argv[0]
    if not (os.path.isabs(executable) and os.access(executable, os.X_OK)):
        if shutil.which(executable) is None:
            raise ProfileError(f"executable {executable!r} not found on PATH")
    source = command.source
    if command.engine != "sim" and source.startswith(("/", "./", "../", "~")):
        if not os.path.exists(os.path.expanduser(source)):
            raise ProfileError(f"source: local model path {source!r} does not exist")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        # As engines' servers do: connections of an engine that ended,
        # still in TIME_WAIT, do not keep a new one from listening there.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, command.port))
        except OSError as e:
            raise ProfileError(
                f"port {command.port} is not free: {e.strerror}", "port_in_use"
            ) from None
