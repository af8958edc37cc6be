"""
C{twistd llmgw-agent}: its configuration, options and C{makeService} (the
service itself is L{llmgw.agent.service}).  The only module of the agent
that touches the global reactor.
"""

from __future__ import annotations

import os
import sys
import tomllib
from dataclasses import dataclass, field, replace
from typing import Any

from twisted.application.service import IService
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.logger import Logger
from twisted.python import usage

from llmgw.agent.service import agent_state_dir, build_agent
from llmgw.config_checks import ConfigError, check_keys
from llmgw.reactors import global_reactor
from llmgw.wire.tls import client_options

log = Logger(namespace="llmgw.agent")


@dataclass(frozen=True)
class AgentConfig:
    """
    The agent's configuration: file keys and flags of the same names.

    @ivar server: C{HOST:PORT} of the server's agent listener.
    @ivar servers: more servers' C{HOST:PORT} (standbys on one PostgreSQL):
        the agent dials them in turn and stays with the one that leads.
    @ivar tls_dir: a folder as C{llmgw certs agent} writes it (C{ca.pem},
        C{agent.pem}, C{agent-key.pem}).
    @ivar simulated_gpus: C{(name, memory_gb)} per simulated GPU.
    """

    server: str = ""
    servers: tuple[str, ...] = ()
    node_id: str = ""
    tls_dir: str = ""
    state_dir: str = ""
    insecure: bool = False
    address: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    fabrics: tuple[str, ...] = ()
    simulated_gpus: tuple[tuple[str, float], ...] = ()
    weights_dirs: tuple[str, ...] = ()

    def all_servers(self) -> tuple[str, ...]:
        """
        @return: C{server} then C{servers}, each once, in order.
        """
        listed = ((self.server,) if self.server else ()) + self.servers
        return tuple(dict.fromkeys(listed))


def _parse(data: dict[str, Any]) -> AgentConfig:
    known = {
        "server",
        "servers",
        "node_id",
        "tls_dir",
        "state_dir",
        "insecure",
        "address",
        "labels",
        "fabrics",
        "simulated_gpus",
        "weights_dirs",
    }
    check_keys("", data, known)
    values: dict[str, Any] = {}
    for key in ("server", "node_id", "tls_dir", "state_dir", "address"):
        if key in data:
            if not isinstance(data[key], str):
                raise ConfigError(f"{key}: expected a string, got {data[key]!r}")
            values[key] = data[key]
    if "insecure" in data:
        if not isinstance(data["insecure"], bool):
            raise ConfigError(
                f"insecure: expected true or false, got {data['insecure']!r}"
            )
        values["insecure"] = data["insecure"]
    servers = data.get("servers", [])
    if not isinstance(servers, list) or not all(isinstance(v, str) for v in servers):
        raise ConfigError(f"servers: expected a list of HOST:PORT, got {servers!r}")
    values["servers"] = tuple(servers)
    labels = data.get("labels", {})
    if not isinstance(labels, dict) or not all(
        isinstance(v, str) for v in labels.values()
    ):
        raise ConfigError(f"labels: expected a table of strings, got {labels!r}")
    values["labels"] = dict(labels)
    fabrics = data.get("fabrics", [])
    if not isinstance(fabrics, list) or not all(isinstance(f, str) for f in fabrics):
        raise ConfigError(f"fabrics: expected a list of strings, got {fabrics!r}")
    values["fabrics"] = tuple(fabrics)
    dirs = data.get("weights_dirs", [])
    if not isinstance(dirs, list) or not all(
        isinstance(d, str) and os.path.isabs(os.path.expanduser(d)) for d in dirs
    ):
        raise ConfigError(
            f"weights_dirs: expected a list of absolute paths, got {dirs!r}"
        )
    values["weights_dirs"] = tuple(os.path.expanduser(d) for d in dirs)
    gpus = []
    tables = data.get("simulated_gpus", [])
    if not isinstance(tables, list):
        raise ConfigError(
            f"simulated_gpus: expected an array of tables ([[simulated_gpus]]),"
            f" got {tables!r}"
        )
    for i, table in enumerate(tables):
        where = f"simulated_gpus[{i}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: expected a table, got {table!r}")
        check_keys(where, table, ("name", "memory_gb"))
        name, memory = table.get("name"), table.get("memory_gb")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}.name: expected a name, got {name!r}")
        if (
            isinstance(memory, bool)
            or not isinstance(memory, (int, float))
            or not 0 < memory <= 1_000_000
        ):
            raise ConfigError(
                f"{where}.memory_gb: expected a number of GB, 0 to 1000000,"
                f" got {memory!r}"
            )
        gpus.append((name, float(memory)))
    values["simulated_gpus"] = tuple(gpus)
    return AgentConfig(**values)


def _server_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"server: bad value {value!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


class Options(usage.Options):
    """
    Command line of C{twistd llmgw-agent}; flags override the file.
    """

    optParameters = [
        ["config", "c", None, "TOML configuration file."],
        ["node-id", None, None, "This node's id; the CN of its certificate."],
        ["tls-dir", None, None, "Folder from `llmgw certs agent` (ca, agent, key)."],
        ["state-dir", None, None, "Folder for the agent's state."],
    ]
    optFlags = [["insecure", None, "Plaintext link (no TLS): trusted networks only."]]

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self["server"] = []

    def opt_server(self, value: str) -> None:
        """
        HOST:PORT of a server's agent listener; repeatable (standbys):
        replaces the file's server and servers.
        """
        self["server"].append(value)

    def postOptions(self) -> None:
        try:
            self.config = self._config()
        except ConfigError as e:
            sys.stderr.write(f"llmgw-agent: config error: {e}\n")
            sys.stderr.flush()
            raise SystemExit(2) from None

    def _config(self) -> AgentConfig:
        config = AgentConfig()
        if self["config"] is not None:
            try:
                with open(self["config"], "rb") as f:
                    config = _parse(tomllib.load(f))
            except OSError as e:
                raise ConfigError(
                    f"--config: cannot read {self['config']!r}: {e.strerror}"
                ) from None
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"--config: not valid TOML: {e}") from None
        if self["server"]:
            config = replace(
                config, server=self["server"][0], servers=tuple(self["server"][1:])
            )
        for flag, key in (
            ("node-id", "node_id"),
            ("tls-dir", "tls_dir"),
            ("state-dir", "state_dir"),
        ):
            if self[flag] is not None:
                config = replace(config, **{key: self[flag]})
        if self["insecure"]:
            config = replace(config, insecure=True)
        if not config.all_servers():
            raise ConfigError("server: missing: give --server HOST:PORT")
        for server in config.all_servers():
            _server_address(server)
        if not config.node_id:
            raise ConfigError("node_id: missing: give --node-id ID")
        if not config.insecure:
            if not config.tls_dir:
                raise ConfigError(
                    "tls_dir: missing: give --tls-dir (from llmgw certs agent),"
                    " or --insecure on a trusted network"
                )
            for name in ("ca.pem", "agent.pem", "agent-key.pem"):
                if not os.path.isfile(os.path.join(config.tls_dir, name)):
                    raise ConfigError(
                        f"tls_dir: {config.tls_dir!r} has no {name}"
                        " (make it with llmgw certs agent)"
                    )
            host, _ = _server_address(config.all_servers()[0])
            try:
                _tls_options(config, host)
            except Exception as e:
                raise ConfigError(
                    f"tls_dir: cannot load the certificates in {config.tls_dir!r}: {e}"
                ) from None
        try:
            os.makedirs(os.path.join(agent_state_dir(config), "shards"), exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"state_dir: cannot use {agent_state_dir(config)!r}: {e.strerror}"
            ) from None
        return config


def _tls_options(config: AgentConfig, host: str) -> Any:
    tls = config.tls_dir
    return client_options(
        host,
        os.path.join(tls, "ca.pem"),
        os.path.join(tls, "agent.pem"),
        os.path.join(tls, "agent-key.pem"),
    )


def makeService(options: Options) -> IService:
    """
    Build the agent: one uplink to the server (see
    L{llmgw.agent.service.build_agent}).
    """
    reactor = global_reactor()
    config: AgentConfig = options.config

    def dial(server: str) -> Any:
        # At each attempt: a standby may name a leader not in the list.
        host, port = _server_address(server)
        endpoint: Any = HostnameEndpoint(reactor, host, port, timeout=10)
        if not config.insecure:
            endpoint = wrapClientTLS(_tls_options(config, host), endpoint)
        return endpoint

    service, _ = build_agent(reactor, config, dial)
    log.info(
        "link security: {security}",
        security="PLAINTEXT" if config.insecure else "mutual TLS",
    )
    return service
