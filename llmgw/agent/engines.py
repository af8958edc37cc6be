"""
Engine adapters: a shard's profile, port and GPUs turned into the command
line, environment and health URL of an inference engine.

Command lines follow each engine's documentation: C{vllm serve MODEL
--served-model-name --port --tensor-parallel-size} (vLLM), C{python -m
sglang.launch_server --model-path --served-model-name --port --tp --nnodes
--node-rank --dist-init-addr} (SGLang), C{llama-server -m --alias --port}
(llama.cpp) or C{python -m llama_cpp.server --model --model_alias --port}
(llama-cpp-python), and C{llmgw sim}.

The engine's own secret (C{StartShard.api_key}) goes to each engine's flag:
C{--api-key} for vLLM, SGLang, llama-server and C{llmgw sim},
C{--api_key} for C{python -m llama_cpp.server} (its settings' field name).
What it protects, from each engine's source: vLLM's
C{AuthenticationMiddleware} checks only paths under C{/v1}; SGLang's
C{add_api_key_middleware} all but C{/health*} and C{/metrics*};
llama-server all but C{/health}, C{/v1/health}, C{/models}, C{/v1/models};
llama-cpp-python every route it has, C{/v1/models} (its health probe here)
included.  The probe sends the key every time: harmless where not needed.
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

    @ivar code: a failure the server acts on (C{"port_in_use"}), or C{""}.
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
class Launch:
    """
    How to run one shard.

    @ivar argv: the command line; C{argv[0]} is an executable path or name.
    @ivar env: variables added to the agent's environment.
    @ivar health_url: answers 200 once the engine serves.
    @ivar headers: sent with every probe of C{health_url} (the engine's
        C{Authorization}); not shown in the launch's repr.
    """

    argv: list[str] = field(repr=False)
    env: dict[str, str] = field(repr=False)
    health_url: str
    headers: dict[str, str] = field(default_factory=dict, repr=False)


def _cuda(gpus: list[int]) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)} if gpus else {}


def build(command: pb.StartShard, host: str = "127.0.0.1") -> Launch:
    """
    @param command: what to start: engine, source, args, env, port, GPUs,
        rank, world size, leader address.
    @param host: the interface engines listen on.
    @return: the launch, with the catalog name as the served model name,
        and the engine's secret (C{command.api_key}, when set) on its
        command line and in its probe's headers.
    @raise ProfileError: an unknown engine.
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
        launch.health_url,
        {"Authorization": f"Bearer {key}"},
    )


def _build(command: pb.StartShard, host: str) -> Launch:
    port = str(command.port)
    gpus = list(command.gpu_indices)
    args = list(command.args)
    env = {**_cuda(gpus), **dict(command.env)}
    # Probed where it listens (a wildcard address is reached on loopback).
    probe = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in probe:
        probe = f"[{probe}]"
    base = f"http://{probe}:{command.port}"
    engine = command.engine
    if engine == "vllm":
        argv = ["vllm", "serve", command.source, "--served-model-name", command.model]
        argv += ["--host", host, "--port", port]
        if len(gpus) > 1 and "--tensor-parallel-size" not in args:
            argv += ["--tensor-parallel-size", str(len(gpus))]
        return Launch(argv + args, env, base + "/health")
    if engine == "sglang":
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path"]
        argv += [command.source, "--served-model-name", command.model]
        argv += ["--host", host, "--port", port]
        if len(gpus) > 1:
            argv += ["--tp", str(len(gpus) * max(command.world_size, 1))]
        if command.world_size > 1:
            argv += ["--nnodes", str(command.world_size)]
            argv += ["--node-rank", str(command.rank)]
            argv += ["--dist-init-addr", command.leader_address]
        return Launch(argv + args, env, base + "/health")
    if engine == "llamacpp":
        if shutil.which("llama-server"):
            argv = ["llama-server", "-m", command.source, "--alias", command.model]
            argv += ["--host", host, "--port", port]
            return Launch(argv + args, env, base + "/health")
        # python -m llama_cpp.server has no /health: /v1/models answers once
        # the model is loaded.
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", command.source]
        argv += ["--model_alias", command.model, "--host", host, "--port", port]
        return Launch(argv + args, env, base + "/v1/models")
    if engine == "sim":
        argv = [sys.executable, "-m", "llmgw.cli.main", "sim", "--port", port]
        argv += ["--host", host, "--model", command.model]
        return Launch(argv + args, env, base + "/health")
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
