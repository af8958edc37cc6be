"""
The agent's configuration: L{AgentConfig}, its TOML file's parser, and
the checks of the file and flags together (L{check_agent_config}); each
key's kind, default and meaning given with its field.  C{twistd
llmgw-agent}'s options (L{llmgw.agent.tap}) read the file and the flags
through these.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from typing import Any

from llmgw.config_checks import (
    ConfigError,
    Key,
    Table,
    check_keys,
    parse_size,
    setting,
    settings_keys,
)
from llmgw.wire.tls import client_options

DEFAULT_STATE_DIR = "~/.local/state/llmgw/agent"


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

    server: str = setting(
        "",
        "HOST:PORT",
        "The server's agent listener (--server; a flag replaces server and"
        " servers); this or servers is required.",
        shown="none",
    )
    servers: tuple[str, ...] = setting(
        (),
        "list of HOST:PORT",
        "More servers (standbys on one PostgreSQL): the agent dials them in"
        " turn, stays with the one that leads, and follows the leader a"
        " standby names.",
    )
    node_id: str = setting(
        "",
        "string",
        "This node's id, the CN of its certificate (--node-id); required.",
        shown="none",
    )
    tls_dir: str = setting(
        "",
        "path",
        "A folder as llmgw certs agent writes it: ca.pem, agent.pem,"
        " agent-key.pem (--tls-dir); required unless insecure.",
        shown="none",
    )
    state_dir: str = setting(
        "",
        "path",
        "The agent's state, its engines' records and output in shards/ (--state-dir).",
        shown=f'"{DEFAULT_STATE_DIR}"',
    )
    insecure: bool = setting(
        False,
        "boolean",
        "A plaintext link, no TLS (--insecure): trusted networks only.",
    )
    address: str = setting(
        "",
        "host or IP address",
        "How engines on this node are reached, and where they listen (set"
        " the node's address for a fleet).",
        shown='"127.0.0.1"',
    )
    labels: dict[str, str] = setting(
        {}, "table of strings", "The node's labels, reported to the server."
    )
    fabrics: tuple[str, ...] = setting(
        (),
        "list of strings",
        "Interconnects this node is on, for multi-node profiles' fabric.",
    )
    simulated_gpus: tuple[tuple[str, float], ...] = setting(
        (),
        "[[simulated_gpus]] tables",
        "GPUs that are not there, reported as simulated, so that the sim"
        " engine can be placed on machines without GPUs.",
    )
    weights_dirs: tuple[str, ...] = setting(
        (),
        "list of absolute paths",
        "Folders of model weights the agent reports, and may delete unused"
        " ones from (llmgw ctl weights); none: it removes nothing.",
    )
    sleep_memory: str = setting(
        "50%",
        'size ("64GiB") or share of the node\'s RAM ("50%")',
        "Host memory sleeping engines may hold on this node (weights kept by"
        ' vLLM\'s sleep level 1), reported to the server; "0%": nothing'
        " sleeps here; more than the node's RAM is refused at start.",
    )

    def all_servers(self) -> tuple[str, ...]:
        """
        @return: C{server} then C{servers}, each once, in order.
        """
        listed = ((self.server,) if self.server else ()) + self.servers
        return tuple(dict.fromkeys(listed))


AGENT_TABLE = Table(
    "",
    "The top level of the agent's file.  A flag named in a key's meaning"
    " (such as --node-id) wins over the file.",
    settings_keys(AgentConfig),
)

SIMULATED_GPUS_TABLE = Table(
    "[[simulated_gpus]]",
    "One simulated GPU each, in the agent's file.",
    (
        Key("name", "string", "The GPU's name, as NVML would report it."),
        Key("memory_gb", "number of GB, up to 1000000", "Its memory (more than 0)."),
    ),
)


def agent_state_dir(config: AgentConfig) -> str:
    """
    @return: the agent's state directory, C{~} expanded.
    """
    return os.path.expanduser(config.state_dir or DEFAULT_STATE_DIR)


def parse_agent_config(data: dict[str, Any]) -> AgentConfig:
    """
    Validate a parsed agent file.

    @raise ConfigError: an unknown key or a bad value, named.
    """
    check_keys("", data, AGENT_TABLE.names)
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
    values["simulated_gpus"] = _simulated_gpus(data.get("simulated_gpus", []))
    if "sleep_memory" in data:
        # Its syntax now; its size against the node's RAM at start.
        sleep_memory_bytes(data["sleep_memory"], 1 << 62)
        values["sleep_memory"] = str(data["sleep_memory"])
    return AgentConfig(**values)


_SHARE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def sleep_memory_bytes(value: object, ram_bytes: int) -> int:
    """
    The C{sleep_memory} budget in bytes.

    @param value: a size (C{"64GiB"}, bytes as an integer) or a share of
        the node's RAM (C{"50%"}).
    @param ram_bytes: the node's RAM.
    @return: bytes, at most C{ram_bytes}.
    @raise ConfigError: not a size or share, a share over 100 %, or more
        than the node's RAM, in one line naming the key.
    """
    if isinstance(value, str) and (match := _SHARE.match(value)) is not None:
        share = float(match.group(1))
        if share > 100:
            raise ConfigError(
                f"sleep_memory: bad share {value!r}: at most 100% of the node's RAM"
            )
        return int(ram_bytes * share / 100)
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise ConfigError(
            f'sleep_memory: bad value {value!r}: use a size ("64GiB") or a share'
            ' of RAM ("50%")'
        )
    size = parse_size("sleep_memory", value)
    if size > ram_bytes:
        raise ConfigError(
            f"sleep_memory: {value!r} is more than this node's RAM"
            f" ({ram_bytes / 1024**3:.1f} GiB)"
        )
    return size


def node_ram_bytes() -> int:
    """
    @return: this machine's RAM, bytes (C{sysconf}'s pages times page size).
    """
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _simulated_gpus(tables: object) -> tuple[tuple[str, float], ...]:
    """
    @return: C{(name, memory_gb)} per C{[[simulated_gpus]]} table.
    @raise ConfigError: not an array of tables, or a bad table, named.
    """
    if not isinstance(tables, list):
        raise ConfigError(
            f"simulated_gpus: expected an array of tables ([[simulated_gpus]]),"
            f" got {tables!r}"
        )
    gpus = []
    for i, table in enumerate(tables):
        where = f"simulated_gpus[{i}]"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: expected a table, got {table!r}")
        check_keys(where, table, SIMULATED_GPUS_TABLE.names)
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
    return tuple(gpus)


def load_agent_config(path: str) -> AgentConfig:
    """
    Read and validate the agent's file.

    @raise ConfigError: the file cannot be read, is not TOML, or is invalid.
    """
    try:
        with open(path, "rb") as f:
            return parse_agent_config(tomllib.load(f))
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: not valid TOML: {e}") from None


def server_address(value: str) -> tuple[str, int]:
    """
    @return: the host (brackets of an IPv6 address removed) and port of a
        C{HOST:PORT}.
    @raise ConfigError: C{value} is not one.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"server: bad value {value!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def tls_options(config: AgentConfig, host: str) -> Any:
    """
    @return: the client TLS options of the link to C{host}, from the
        certificates in C{config.tls_dir}.
    @raise Exception: they cannot be loaded.
    """
    tls = config.tls_dir
    return client_options(
        host,
        os.path.join(tls, "ca.pem"),
        os.path.join(tls, "agent.pem"),
        os.path.join(tls, "agent-key.pem"),
    )


def check_agent_config(config: AgentConfig) -> AgentConfig:
    """
    Check what can only be checked once file and flags are merged: a
    server, a node id, the certificates (unless insecure), the
    C{sleep_memory} budget against the node's RAM, and make the state
    directory.

    @raise ConfigError: one of them is missing or unusable, named.
    """
    if not config.all_servers():
        raise ConfigError("server: missing: give --server HOST:PORT")
    for server in config.all_servers():
        server_address(server)
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
        host, _ = server_address(config.all_servers()[0])
        try:
            tls_options(config, host)
        except Exception as e:
            raise ConfigError(
                f"tls_dir: cannot load the certificates in {config.tls_dir!r}: {e}"
            ) from None
    sleep_memory_bytes(config.sleep_memory, node_ram_bytes())
    try:
        os.makedirs(os.path.join(agent_state_dir(config), "shards"), exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"state_dir: cannot use {agent_state_dir(config)!r}: {e.strerror}"
        ) from None
    return config


AGENT_TABLES: tuple[Table, ...] = (AGENT_TABLE, SIMULATED_GPUS_TABLE)
"""
Every table the agent's file takes, in the reference's order.
"""
