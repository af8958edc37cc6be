"""
The server's configuration file, composed out of its tables' parsers, and
the command-line flags over it.

Each table is read next to the code that uses it: C{[router]}, C{[cors]}
and C{[[endpoints]]} by L{llmgw.router.settings_toml}, C{[control]} by
L{llmgw.control.settings}, C{[[models]]} by L{llmgw.control.catalog},
C{[standby]} and C{[agent_tls]} by L{llmgw.server.settings}, C{[store]},
C{[limits]} and C{[auth]} by L{llmgw.accounts.settings}, C{[batches]} by
L{llmgw.batches.settings}; the top-level keys
are L{ServerConfig}'s own.  Every table says its keys as a
L{llmgw.config_checks.Table}, each key declared once with the kind that
reads and checks it: L{llmgw.config_checks.Table.read} parses every table
with them, and L{llmgw.config_docs} prints them as the configuration
reference.

A configuration error is raised as L{llmgw.config_checks.ConfigError} carrying one
line that names the key and the offending value, so that C{twistd} can print
it and exit without a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from llmgw.accounts.settings import (
    AUTH_TABLE,
    LIMITS_TABLE,
    STORE_TABLE,
    AuthConfig,
    LimitsConfig,
    StoreConfig,
    parse_auth,
    parse_limits,
    parse_store,
)
from llmgw.batches.settings import BATCHES_TABLE, BatchesConfig, parse_batches
from llmgw.config_checks import (
    BOOLEAN,
    Choice,
    ConfigError,
    Table,
    Text,
    check_choice,
    read_toml,
    setting,
    settings_keys,
    told_in,
)
from llmgw.control.catalog import MODELS_TABLE, PROFILES_TABLE, Model, parse_models
from llmgw.control.settings import CONTROL_TABLE, ControlConfig, parse_control
from llmgw.router.interfaces import Endpoint
from llmgw.router.settings import RouterConfig
from llmgw.router.settings_toml import (
    CORS_TABLE,
    ENDPOINTS_TABLE,
    ROUTER_TABLE,
    TRACING_TABLE,
    TracingConfig,
    parse_cors,
    parse_endpoint,
    parse_endpoints,
    parse_router,
    parse_tracing,
)
from llmgw.server.settings import (
    AGENT_TLS_TABLE,
    STANDBY_TABLE,
    AgentTLSConfig,
    StandbyConfig,
    parse_agent_tls,
    parse_standby,
)
from llmgw.tier.settings import ROUTER_WORKERS

LOG_FORMATS = ("text", "json")

_ENDPOINT = Text("Twisted server endpoint")


@dataclass(frozen=True)
class ServerConfig:
    """
    The whole C{llmgw-server} configuration (and C{llmgw-router}'s, which
    reads the same file): the top-level keys, then each table's settings.

    @ivar agent_tls: certificates for the agent listener; without them (and
        without C{insecure_agents}) the server accepts no agents.
    @ivar local: C{--local}: an agent for this machine runs inside the
        server.
    @ivar simulated_gpus: C{--simulated-gpus}: C{(name, memory_gb)} per
        GPU the local agent reports as simulated.
    @ivar store_url: C{[store] url}.
    @ivar usage_flush_interval: C{[store] flush_interval}, seconds.
    @ivar record_usage: C{[store] record_usage}.
    @ivar usage_retention: C{[store] usage_retention}, seconds.
    @ivar responses_retention: C{[store] responses_retention}, seconds.
    @ivar limits_url: C{[limits] url}.
    @ivar limits_routers: C{[limits] routers}.
    @ivar require_api_key: C{[auth] require_api_key}.
    """

    listen: str = setting(
        "tcp:8080",
        _ENDPOINT,
        "The client API (--listen); ssl:PORT:privateKey=...:certKey=... serves"
        " TLS and offers HTTP/2 over ALPN; a backlog of 1024 unless the string"
        " sets backlog=.",
    )
    admin_listen: str = setting(
        "tcp:9090:interface=127.0.0.1",
        _ENDPOINT,
        "The admin API, dashboard, /metrics and /healthz (--admin-listen).",
    )
    metrics_listen: str = setting(
        "",
        _ENDPOINT,
        "A listener serving GET /metrics only, safe to open to a Prometheus"
        " server on another machine (--metrics-listen); by default none.",
        shown="none",
    )
    log_format: str = setting(
        "text",
        Choice(LOG_FORMATS),
        'Log lines (--log-format): "text" (twistd\'s) or "json" (one JSON'
        " object a line).",
    )
    router_workers: int = setting(
        0,
        ROUTER_WORKERS,
        "llmgw-router children serving the client API on the listen port"
        " (SO_REUSEPORT, a tcp: listener only) (--router-workers); 0: this"
        " process serves it.",
    )
    agent_listen: str = setting(
        "tcp:7443",
        _ENDPOINT,
        "The agent listener (--agent-listen), with [agent_tls] or insecure_agents.",
    )
    agent_tls: AgentTLSConfig | None = None
    insecure_agents: bool = setting(
        False,
        BOOLEAN,
        "Instead of [agent_tls]: agents over plaintext, any node id accepted;"
        " trusted networks only.",
    )
    local: bool = False
    simulated_gpus: tuple[tuple[str, float], ...] = ()
    state_dir: str = setting(
        "~/.local/state/llmgw",
        Text("path"),
        "Where the server keeps its state: the SQLite store by default, the"
        " engines' secret, --local's certificates and engines (--state-dir).",
    )
    store_url: str = StoreConfig.url
    usage_flush_interval: float = StoreConfig.flush_interval
    record_usage: bool = StoreConfig.record_usage
    usage_retention: float = StoreConfig.usage_retention
    responses_retention: float = StoreConfig.responses_retention
    limits_url: str = LimitsConfig.url
    limits_routers: int = LimitsConfig.routers
    require_api_key: bool = AuthConfig.require_api_key
    endpoints: tuple[Endpoint, ...] = ()
    router: RouterConfig = field(default_factory=RouterConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    standby: StandbyConfig = field(default_factory=StandbyConfig)
    models: tuple[Model, ...] = ()
    tracing: TracingConfig = field(default_factory=TracingConfig)
    batches: BatchesConfig = field(default_factory=BatchesConfig)

    @property
    def leader_lock_url(self) -> str:
        """
        The PostgreSQL that chooses the leader (C{[standby] url}, else a
        PostgreSQL C{[store] url}); empty: this server leads alone.
        """
        if self.standby.url:
            return self.standby.url
        if self.store_url.startswith(("postgresql://", "postgres://")):
            return self.store_url
        return ""

    @property
    def accepts_agents(self) -> bool:
        """
        Whether an agent listener runs.
        """
        return self.agent_tls is not None or self.insecure_agents


SERVER_TABLE = Table(
    "",
    "The top level of the server's file, before any table.  A flag named"
    " in a key's meaning (such as --listen) wins over the file.",
    settings_keys(ServerConfig),
)

SERVER_TABLES: tuple[Table, ...] = (
    SERVER_TABLE,
    ROUTER_TABLE,
    CORS_TABLE,
    ENDPOINTS_TABLE,
    MODELS_TABLE,
    PROFILES_TABLE,
    CONTROL_TABLE,
    AGENT_TLS_TABLE,
    STORE_TABLE,
    LIMITS_TABLE,
    AUTH_TABLE,
    STANDBY_TABLE,
    TRACING_TABLE,
    BATCHES_TABLE,
)
"""
Every table the server's file takes, in the reference's order.
"""


def _store(config: ServerConfig, table: object) -> ServerConfig:
    store = parse_store(table)
    return replace(
        config,
        store_url=store.url,
        usage_flush_interval=store.flush_interval,
        record_usage=store.record_usage,
        usage_retention=store.usage_retention,
        responses_retention=store.responses_retention,
    )


def _limits(config: ServerConfig, table: object) -> ServerConfig:
    limits = parse_limits(table)
    return replace(config, limits_url=limits.url, limits_routers=limits.routers)


def _cors(config: ServerConfig, table: object) -> ServerConfig:
    origins = parse_cors(table)
    return replace(config, router=replace(config.router, cors_allow_origins=origins))


_TABLES: dict[str, Callable[[ServerConfig, Any], ServerConfig]] = {
    # In this order, so that of two mistakes the same one is told first.
    "standby": lambda c, v: replace(c, standby=parse_standby(v)),
    "control": lambda c, v: replace(c, control=parse_control(v)),
    "store": _store,
    "limits": _limits,
    "auth": lambda c, v: replace(c, require_api_key=parse_auth(v).require_api_key),
    "models": lambda c, v: replace(c, models=parse_models(v)),
    "agent_tls": lambda c, v: replace(c, agent_tls=parse_agent_tls(v)),
    "router": lambda c, v: replace(c, router=parse_router(v)),
    "cors": _cors,
    "endpoints": lambda c, v: replace(c, endpoints=parse_endpoints(v)),
    "tracing": lambda c, v: replace(c, tracing=parse_tracing(v)),
    "batches": lambda c, v: replace(c, batches=parse_batches(v)),
}
"""
What each table of the server's file sets, by its parser.
"""


def parse_config(data: Mapping[str, Any]) -> ServerConfig:
    """
    Validate a parsed TOML document: the top-level keys (L{SERVER_TABLE}),
    then each table.

    @raise ConfigError: an unknown key, a missing field or a bad value.
    """
    config = ServerConfig(**SERVER_TABLE.read(dict(data), others=_TABLES))
    for key, read in _TABLES.items():
        if key in data:
            config = read(config, data[key])
    return config


def parse_endpoint_flag(spec: str) -> Endpoint:
    """
    Parse C{--endpoint id=URL=model[,model]}.

    @raise ConfigError: the value does not have that shape.
    """
    endpoint_id, sep, rest = spec.partition("=")
    url, sep2, models = rest.rpartition("=")
    if not (sep and sep2 and endpoint_id and url and models):
        raise ConfigError(
            f"--endpoint: bad value {spec!r}: expected id=URL=model[,model]"
        )
    return parse_endpoint(
        f"--endpoint {endpoint_id}",
        {"id": endpoint_id, "url": url, "models": models.split(",")},
    )


def shared_flags(config: ServerConfig, flags: Mapping[str, Any]) -> ServerConfig:
    """
    The command-line flags both C{llmgw-server} and C{llmgw-router} take,
    over the file's values: C{--listen}, C{--log-format}, C{--state-dir}
    (L{None}: not given).

    @raise ConfigError: an unknown log format.
    """
    if flags["listen"] is not None:
        config = replace(config, listen=flags["listen"])
    if flags["log-format"] is not None:
        log_format = check_choice("--log-format", flags["log-format"], LOG_FORMATS)
        config = replace(config, log_format=log_format)
    if flags["state-dir"] is not None:
        config = replace(config, state_dir=flags["state-dir"])
    return config


def load_config(path: str | None) -> ServerConfig:
    """
    Read and validate the configuration file, or the defaults when C{path}
    is L{None}.

    @raise ConfigError: the file cannot be read, is not TOML, or is invalid;
        a mistake in the file is told after its path, as in
        C{"/etc/llmgw/server.toml: control.lost_after: ..."}, since the
        server, its router workers and a tier's routers may each read
        another file.
    """
    if path is None:
        return ServerConfig()
    data = read_toml(path)
    with told_in(path):
        return parse_config(data)


def finish_config(config: ServerConfig) -> ServerConfig:
    """
    Check what can only be checked once file and flags are merged.

    @raise ConfigError: duplicate endpoint ids, or nothing to serve.
    """
    seen: set[str] = set()
    for endpoint in config.endpoints:
        if endpoint.id in seen:
            raise ConfigError(f"endpoints: duplicate id {endpoint.id!r}")
        seen.add(endpoint.id)
    if config.simulated_gpus and not config.local:
        raise ConfigError(
            "--simulated-gpus: only with --local (an agent's own GPUs are its"
            " file's [[simulated_gpus]])"
        )
    if config.local and config.leader_lock_url:
        raise ConfigError(
            "standby: a server with --local leads alone; remove [standby] url"
        )
    if not config.endpoints and not config.accepts_agents and not config.local:
        raise ConfigError(
            "nothing to serve: add --endpoint id=URL=model[,model], or"
            " [[endpoints]] tables (id, url, models) to the --config file,"
            " or [agent_tls] (ca, cert, key) to accept agents, or run with"
            " --local"
        )
    return config
