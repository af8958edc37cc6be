"""
C{twistd llmgw-agent}: its options and C{makeService} (the service itself
is L{llmgw.agent.service}, the configuration L{llmgw.agent.settings}).  The
only module of the agent that touches the global reactor.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from twisted.application.service import IService
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.logger import Logger
from twisted.python import usage

from llmgw.agent.service import build_agent
from llmgw.agent.settings import (
    AgentConfig,
    check_agent_config,
    load_agent_config,
    server_address,
    tls_options,
)
from llmgw.config_checks import ConfigError, told_in
from llmgw.daemon.wiring import check_twistd_files
from llmgw.reactors import global_reactor
from llmgw.wire.certs import NODE_ID

log = Logger(namespace="llmgw.agent")


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
            config = load_agent_config(self["config"])
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
        # Checked with the flags merged in: the file named all the same.
        with told_in(self["config"], " with the flags"):
            if config.node_id and not NODE_ID.match(config.node_id):
                # It names a folder and is a certificate's CN.
                raise ConfigError(
                    f"node_id: bad value {config.node_id[:100]!r}: expected 1 to"
                    " 63 letters, digits, '.', '_' or '-', starting with a letter"
                    " or digit"
                )
            return check_agent_config(config)


def makeService(options: Options) -> IService:
    """
    Build the agent: one uplink to the server (see
    L{llmgw.agent.service.build_agent}).
    """
    reactor = global_reactor()
    config: AgentConfig = options.config

    def dial(server: str) -> Any:
        # At each attempt: a standby may name a leader not in the list.
        host, port = server_address(server)
        endpoint: Any = HostnameEndpoint(reactor, host, port, timeout=10)
        if not config.insecure:
            endpoint = wrapClientTLS(tls_options(config, host), endpoint)
        return endpoint

    check_twistd_files("llmgw-agent", getattr(options, "parent", None))
    try:
        service, _ = build_agent(reactor, config, dial)
    except ConfigError as e:
        # Another agent holds the state directory: told as any config error.
        sys.stderr.write(f"llmgw-agent: config error: {e}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None
    log.info(
        "link security: {security}",
        security="PLAINTEXT" if config.insecure else "mutual TLS",
    )
    return service
