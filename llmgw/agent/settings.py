"""
The agent's configuration: L{AgentConfig}, its TOML file's parser, and
the checks of the file and flags together (L{check_agent_config}); each
key's kind (which reads and checks it), default and meaning given with its
field.  C{twistd llmgw-agent}'s options (L{llmgw.agent.tap}) read the file
and the flags through these.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from llmgw.config_checks import (
    BOOLEAN,
    ArrayOfTables,
    ConfigError,
    Key,
    Kind,
    ListOf,
    Number,
    StringTable,
    Table,
    Text,
    parse_size,
    read_toml,
    setting,
    settings_keys,
    spelled,
    told_in,
)
from llmgw.wire.tls import client_options

DEFAULT_STATE_DIR = "~/.local/state/llmgw/agent"

_STRING = Text(empty=True)
_PATH = Text("path", empty=True)
_SHARE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class AbsolutePath(Kind[str]):
    """
    An absolute path, C{~} allowed; read with C{~} expanded.
    """

    @property
    def words(self) -> str:
        return "absolute path"

    def read(self, where: str, value: object) -> str:
        if isinstance(value, str) and os.path.isabs(os.path.expanduser(value)):
            return os.path.expanduser(value)
        raise ConfigError(f"{where}: expected an absolute path, got {spelled(value)}")


@dataclass(frozen=True)
class SleepMemory(Kind[str]):
    """
    C{sleep_memory}: a size or a share of the node's RAM, read as given:
    its syntax is checked here, its size against the node's RAM at start
    (L{sleep_memory_bytes}).
    """

    @property
    def words(self) -> str:
        return 'size ("64GiB") or share of the node\'s RAM ("50%")'

    def read(self, where: str, value: object) -> str:
        sleep_memory_bytes(value, 1 << 62)
        return str(value)


SIMULATED_GPUS_TABLE = Table(
    "[[simulated_gpus]]",
    "One simulated GPU each, in the agent's file.",
    (
        Key("name", Text(), "The GPU's name, as NVML would report it."),
        Key(
            "memory_gb",
            Number(positive=True, most=1_000_000, unit="GB"),
            "Its memory.",
        ),
    ),
)


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
        Text("HOST:PORT", empty=True),
        "The server's agent listener (--server; a flag replaces server and"
        " servers); this or servers is required.",
        shown="none",
    )
    servers: tuple[str, ...] = setting(
        (),
        ListOf(_STRING, "list of HOST:PORT"),
        "More servers (standbys on one PostgreSQL): the agent dials them in"
        " turn, stays with the one that leads, and follows the leader a"
        " standby names.",
    )
    node_id: str = setting(
        "",
        _STRING,
        "This node's id, the CN of its certificate (--node-id); required.",
        shown="none",
    )
    tls_dir: str = setting(
        "",
        _PATH,
        "A folder as llmgw certs agent writes it: ca.pem, agent.pem,"
        " agent-key.pem (--tls-dir); required unless insecure.",
        shown="none",
    )
    state_dir: str = setting(
        "",
        _PATH,
        "The agent's state, its engines' records and output in shards/ (--state-dir).",
        shown=f'"{DEFAULT_STATE_DIR}"',
    )
    insecure: bool = setting(
        False,
        BOOLEAN,
        "A plaintext link, no TLS (--insecure): trusted networks only.",
    )
    address: str = setting(
        "",
        Text("host or IP address", empty=True),
        "How engines on this node are reached, and where they listen (set"
        " the node's address for a fleet).",
        shown='"127.0.0.1"',
    )
    labels: dict[str, str] = setting(
        {}, StringTable(), "The node's labels, reported to the server."
    )
    fabrics: tuple[str, ...] = setting(
        (),
        ListOf(_STRING, "list of strings"),
        "Interconnects this node is on, for multi-node profiles' fabric.",
    )
    simulated_gpus: tuple[tuple[str, float], ...] = setting(
        (),
        ArrayOfTables(SIMULATED_GPUS_TABLE, lambda t: (t["name"], t["memory_gb"])),
        "GPUs that are not there, reported as simulated, so that the sim"
        " engine can be placed on machines without GPUs.",
    )
    weights_dirs: tuple[str, ...] = setting(
        (),
        ListOf(AbsolutePath(), "list of absolute paths"),
        "Folders of model weights the agent reports, and may delete unused"
        " ones from (llmgw ctl weights); none: it removes nothing.",
    )
    sleep_memory: str = setting(
        "50%",
        SleepMemory(),
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
    return AgentConfig(**AGENT_TABLE.read(data))


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
                f"sleep_memory: bad share {spelled(value)}: at most 100% of the"
                " node's RAM"
            )
        return int(ram_bytes * share / 100)
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise ConfigError(
            f'sleep_memory: bad value {spelled(value)}: use a size ("64GiB") or a share'
            ' of RAM ("50%")'
        )
    size = parse_size("sleep_memory", value)
    if size > ram_bytes:
        raise ConfigError(
            f"sleep_memory: {spelled(value)} is more than this node's RAM"
            f" ({ram_bytes / 1024**3:.1f} GiB)"
        )
    return size


def node_ram_bytes() -> int:
    """
    @return: this machine's RAM, bytes (C{sysconf}'s pages times page size).
    """
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def load_agent_config(path: str) -> AgentConfig:
    """
    Read and validate the agent's file.

    @raise ConfigError: the file cannot be read, is not TOML, or is invalid;
        a mistake in the file is told after its path, as in
        C{"/etc/llmgw/agent.toml: simulated_gpus[0].memory_gb: ..."}.
    """
    data = read_toml(path)
    with told_in(path):
        return parse_agent_config(data)


def server_address(value: str) -> tuple[str, int]:
    """
    @return: the host (brackets of an IPv6 address removed) and port of a
        C{HOST:PORT}.
    @raise ConfigError: C{value} is not one.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"server: bad value {spelled(value)}: expected HOST:PORT")
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
