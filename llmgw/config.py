"""
Server configuration: the TOML file, the command-line overrides, validation.

A configuration error is raised as L{llmgw.config_checks.ConfigError} carrying one
line that names the key and the offending value, so that C{twistd} can print
it and exit without a traceback.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from llmgw.config_checks import (
    ConfigError,
    check_bool,
    check_choice,
    check_keys,
    check_string,
    check_url,
    parse_duration,
)
from llmgw.config_router import parse_cors, parse_router
from llmgw.control.catalog import Model, parse_models
from llmgw.router.interfaces import Endpoint
from llmgw.router.settings import RouterConfig


@dataclass(frozen=True)
class ControlConfig:
    """
    The C{[control]} table: the reconciler's timers and limits (their use:
    L{llmgw.control.plane}).  Durations in seconds.

    @ivar unreachable_after: a node silent this long gets no new placements.
    @ivar lost_after: a node silent this long has its replicas placed
        elsewhere.
    @ivar base_backoff: the wait after a model's first failed replica;
        doubled per failure in a row up to C{max_backoff}.
    @ivar port_range: ports engines may listen on, C{(first, last)}.
    @ivar start_timeout: a shard not ready this long after it was placed is
        stopped and counted as failed.
    @ivar startup_grace: after the server starts, no placements and no
        scale-down for this long, while agents reconnect and their shards
        are adopted (so a restart makes no duplicates).
    @ivar drain_timeout: a draining replica's requests in flight get this
        long before its engines are stopped.
    @ivar interval: seconds between reconciler passes when nothing kicks.
    @ivar scale_up_in_flight: requests in flight per ready replica above
        which a model gets one more replica (up to C{max_replicas}).
    """

    unreachable_after: float = 15.0
    lost_after: float = 60.0
    base_backoff: float = 5.0
    max_backoff: float = 300.0
    port_range: tuple[int, int] = (20000, 20999)
    start_timeout: float = 900.0
    startup_grace: float = 10.0
    drain_timeout: float = 60.0
    interval: float = 1.0
    scale_up_in_flight: float = 8.0


@dataclass(frozen=True)
class AgentTLSConfig:
    """
    The C{[agent_tls]} table: PEM paths, as C{llmgw certs} writes them.
    """

    ca: str
    cert: str
    key: str


@dataclass(frozen=True)
class StandbyConfig:
    """
    The C{[standby]} table: leadership among servers on one PostgreSQL
    (L{llmgw.server.standby}).

    @ivar url: the PostgreSQL whose advisory lock chooses the leader;
        empty for C{[store] url} when that is PostgreSQL (else no standby:
        this server leads alone).
    @ivar advertise: C{HOST:PORT} agents dial to reach this server's agent
        listener, recorded for the standbys to name; empty for the bound
        address (the host name in place of a wildcard).
    @ivar retry: seconds between a standby's tries of the lock, and the
        leader's checks of its connection.
    @ivar lease: a leader that cannot show its connection alive this long
        stops leading (and its process ends).
    """

    url: str = ""
    advertise: str = ""
    retry: float = 1.0
    lease: float = 5.0


def _standby(table: object) -> StandbyConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"standby: expected a table, got {table!r}")
    check_keys("standby", table, {"url", "advertise", "retry", "lease"})
    standby = StandbyConfig()
    if "url" in table:
        url = check_string("standby.url", table["url"])
        if not url.startswith(("postgresql://", "postgres://")):
            raise ConfigError(
                f"standby.url: {url!r}: expected postgresql://user@host:port/db"
            )
        standby = replace(standby, url=url)
    if "advertise" in table:
        address = check_string("standby.advertise", table["advertise"])
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"standby.advertise: bad value {address!r}: expected HOST:PORT"
            )
        standby = replace(standby, advertise=address)
    if "retry" in table:
        standby = replace(
            standby, retry=parse_duration("standby.retry", table["retry"])
        )
    if "lease" in table:
        standby = replace(
            standby, lease=parse_duration("standby.lease", table["lease"])
        )
    if not 0.1 <= standby.retry <= 60:
        raise ConfigError(f"standby.retry: {standby.retry:g}s is not 100ms to 60s")
    if standby.lease < 2 * standby.retry:
        raise ConfigError(
            f"standby.lease: {standby.lease:g}s is under twice retry"
            f" ({standby.retry:g}s)"
        )
    return standby


@dataclass(frozen=True)
class ServerConfig:
    """
    The whole C{llmgw-server} configuration.

    @ivar agent_tls: certificates for the agent listener; without them (and
        without C{insecure_agents}) the server accepts no agents.
    """

    listen: str = "tcp:8080"
    admin_listen: str = "tcp:9090:interface=127.0.0.1"
    # A listener serving /metrics only; empty for none.
    metrics_listen: str = ""
    # Server log lines: "text" (twistd's) or "json" (one object a line).
    log_format: str = "text"
    # --router-workers: llmgw-router children on the client API's port
    # (SO_REUSEPORT); 0 serves clients in the server's own process.
    router_workers: int = 0
    agent_listen: str = "tcp:7443"
    agent_tls: AgentTLSConfig | None = None
    insecure_agents: bool = False
    # --local: an agent for this machine runs inside the server.
    local: bool = False
    state_dir: str = "~/.local/state/llmgw"
    # [store] url: empty for STATE_DIR/llmgw.db.
    store_url: str = ""
    # [store] flush_interval: seconds between usage batch writes.
    usage_flush_interval: float = 1.0
    # [store] record_usage: false keeps only the log line per request.
    record_usage: bool = True
    # [limits] url: Redis counting requests, tokens and budgets for every
    # router together; empty to count in each router.
    limits_url: str = ""
    # [limits] routers: routers sharing the keys' limits; without Redis
    # (or while it is away) each admits ceil(limit / routers).
    limits_routers: int = 1
    # [auth] require_api_key: keys needed even before any exists.
    require_api_key: bool = False
    endpoints: tuple[Endpoint, ...] = ()
    router: RouterConfig = field(default_factory=RouterConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    standby: StandbyConfig = field(default_factory=StandbyConfig)
    models: tuple[Model, ...] = ()

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


MAX_ROUTER_WORKERS = 64


def check_router_workers(value: object) -> int:
    """
    @return: C{router_workers}, a whole number from 0 to L{MAX_ROUTER_WORKERS}.
    @raise ConfigError: it is not.
    """
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not 0 <= value <= MAX_ROUTER_WORKERS
    ):
        raise ConfigError(
            f"router_workers: expected a whole number from 0 to {MAX_ROUTER_WORKERS},"
            f" got {value!r}"
        )
    return value


def _endpoint(where: str, table: object) -> Endpoint:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {table!r}")
    check_keys(where, table, {"id", "url", "models", "weight", "api_key"})
    for required in ("id", "url", "models"):
        if required not in table:
            raise ConfigError(f"{where}.{required}: missing")
    endpoint_id = check_string(f"{where}.id", table["id"])
    url = check_url(f"{where}.url", table["url"])
    models = table["models"]
    if isinstance(models, str):
        models = [models]
    if (
        not isinstance(models, list)
        or not models
        or not all(isinstance(m, str) and m for m in models)
    ):
        raise ConfigError(
            f"{where}.models: expected a non-empty list of model names, got {models!r}"
        )
    weight = table.get("weight", 1.0)
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not weight > 0
    ):
        raise ConfigError(f"{where}.weight: expected a positive number, got {weight!r}")
    api_key = table.get("api_key", "")
    if not isinstance(api_key, str) or not all(" " < c < "\x7f" for c in api_key):
        # Sent in a header: visible ASCII only, nothing to split it.
        raise ConfigError(
            f"{where}.api_key: expected a string of visible ASCII characters"
            " (the engine's --api-key)"
        )
    return Endpoint(endpoint_id, url, tuple(models), float(weight), api_key)


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
    return _endpoint(
        f"--endpoint {endpoint_id}",
        {"id": endpoint_id, "url": url, "models": models.split(",")},
    )


def _control(table: object) -> ControlConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"control: expected a table, got {table!r}")
    durations = {
        "unreachable_after",
        "lost_after",
        "base_backoff",
        "max_backoff",
        "start_timeout",
        "startup_grace",
        "drain_timeout",
        "interval",
    }
    check_keys("control", table, durations | {"port_range", "scale_up_in_flight"})
    values: dict[str, Any] = {}
    if "scale_up_in_flight" in table:
        level = table["scale_up_in_flight"]
        if (
            isinstance(level, bool)
            or not isinstance(level, (int, float))
            or not 1 <= level <= 100_000
        ):
            raise ConfigError(
                f"control.scale_up_in_flight: expected a number from 1, got {level!r}"
            )
        values["scale_up_in_flight"] = float(level)
    for key, value in table.items():
        if key in durations:
            values[key] = parse_duration(f"control.{key}", value)
    if "port_range" in table:
        ports = table["port_range"]
        if (
            not isinstance(ports, list)
            or len(ports) != 2
            or not all(isinstance(p, int) and not isinstance(p, bool) for p in ports)
            or not 1024 <= ports[0] <= ports[1] < 65536
        ):
            raise ConfigError(
                f"control.port_range: expected [first, last], ports 1024 to 65535,"
                f" got {ports!r}"
            )
        values["port_range"] = (ports[0], ports[1])
    control = replace(ControlConfig(), **values)
    if control.interval < 0.01:
        raise ConfigError(
            f"control.interval: {control.interval:g}s is under the least, 10ms"
        )
    for key in ("unreachable_after", "start_timeout", "base_backoff"):
        if getattr(control, key) <= 0:
            raise ConfigError(f"control.{key}: must be more than 0s")
    if control.lost_after < control.unreachable_after:
        raise ConfigError(
            f"control.lost_after: {control.lost_after:g}s is shorter than"
            f" unreachable_after = {control.unreachable_after:g}s"
        )
    if control.max_backoff < control.base_backoff:
        raise ConfigError(
            f"control.max_backoff: {control.max_backoff:g}s is shorter than"
            f" base_backoff = {control.base_backoff:g}s"
        )
    return control


LOG_FORMATS = ("text", "json")


def _limits(config: ServerConfig, table: object) -> ServerConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"limits: expected a table, got {table!r}")
    check_keys("limits", table, {"url", "routers"})
    if "url" in table:
        url = check_string("limits.url", table["url"])
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 (parses the port)
        except ValueError:
            raise ConfigError(f"limits.url: bad URL {url!r}") from None
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise ConfigError(
                f"limits.url: bad URL {url!r}: expected redis://host:port/db"
                " or rediss://host:port/db"
            )
        config = replace(config, limits_url=url)
    if "routers" in table:
        routers = table["routers"]
        if isinstance(routers, bool) or not isinstance(routers, int) or routers < 1:
            raise ConfigError(
                "limits.routers: expected a whole number of at least 1,"
                f" got {routers!r}"
            )
        config = replace(config, limits_routers=routers)
    return config


def parse_config(data: Mapping[str, Any]) -> ServerConfig:
    """
    Validate a parsed TOML document.

    @raise ConfigError: an unknown key, a missing field or a bad value.
    """
    check_keys(
        "",
        data,
        {
            "listen",
            "admin_listen",
            "metrics_listen",
            "log_format",
            "router_workers",
            "agent_listen",
            "agent_tls",
            "insecure_agents",
            "endpoints",
            "router",
            "control",
            "models",
            "state_dir",
            "store",
            "limits",
            "auth",
            "cors",
            "standby",
        },
    )
    config = ServerConfig()
    if "standby" in data:
        config = replace(config, standby=_standby(data["standby"]))
    if "router_workers" in data:
        config = replace(
            config, router_workers=check_router_workers(data["router_workers"])
        )
    if "state_dir" in data:
        config = replace(config, state_dir=check_string("state_dir", data["state_dir"]))
    if "control" in data:
        config = replace(config, control=_control(data["control"]))
    if "store" in data:
        table = data["store"]
        if not isinstance(table, dict):
            raise ConfigError(f"store: expected a table, got {table!r}")
        check_keys("store", table, {"url", "flush_interval", "record_usage"})
        if "record_usage" in table:
            record = check_bool("store.record_usage", table["record_usage"])
            config = replace(config, record_usage=record)
        if "url" in table:
            config = replace(config, store_url=check_string("store.url", table["url"]))
        if "flush_interval" in table:
            interval = parse_duration("store.flush_interval", table["flush_interval"])
            if interval <= 0:
                raise ConfigError("store.flush_interval: must be positive")
            config = replace(config, usage_flush_interval=interval)
    if "limits" in data:
        config = _limits(config, data["limits"])
    if "auth" in data:
        table = data["auth"]
        if not isinstance(table, dict):
            raise ConfigError(f"auth: expected a table, got {table!r}")
        check_keys("auth", table, {"require_api_key"})
        config = replace(
            config,
            require_api_key=check_bool(
                "auth.require_api_key", table.get("require_api_key", False)
            ),
        )
    if "models" in data:
        config = replace(config, models=parse_models(data["models"]))
    if "agent_listen" in data:
        config = replace(
            config, agent_listen=check_string("agent_listen", data["agent_listen"])
        )
    if "insecure_agents" in data:
        insecure = check_bool("insecure_agents", data["insecure_agents"])
        config = replace(config, insecure_agents=insecure)
    if "agent_tls" in data:
        table = data["agent_tls"]
        if not isinstance(table, dict):
            raise ConfigError(f"agent_tls: expected a table, got {table!r}")
        check_keys("agent_tls", table, {"ca", "cert", "key"})
        for required in ("ca", "cert", "key"):
            if required not in table:
                raise ConfigError(f"agent_tls.{required}: missing")
        config = replace(
            config,
            agent_tls=AgentTLSConfig(
                *(
                    check_string(f"agent_tls.{k}", table[k])
                    for k in ("ca", "cert", "key")
                )
            ),
        )
    if "listen" in data:
        config = replace(config, listen=check_string("listen", data["listen"]))
    if "admin_listen" in data:
        config = replace(
            config, admin_listen=check_string("admin_listen", data["admin_listen"])
        )
    if "metrics_listen" in data:
        config = replace(
            config,
            metrics_listen=check_string("metrics_listen", data["metrics_listen"]),
        )
    if "log_format" in data:
        config = replace(
            config,
            log_format=check_choice("log_format", data["log_format"], LOG_FORMATS),
        )
    if "router" in data:
        config = replace(config, router=parse_router(data["router"]))
    if "cors" in data:
        origins = parse_cors(data["cors"])
        config = replace(
            config, router=replace(config.router, cors_allow_origins=origins)
        )
    if "endpoints" in data:
        tables = data["endpoints"]
        if not isinstance(tables, list):
            raise ConfigError(
                "endpoints: expected an array of tables ([[endpoints]]),"
                f" got {tables!r}"
            )
        config = replace(
            config,
            endpoints=tuple(
                _endpoint(f"endpoints[{index}]", table)
                for index, table in enumerate(tables)
            ),
        )
    return config


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

    @raise ConfigError: the file cannot be read, is not TOML, or is invalid.
    """
    if path is None:
        return ServerConfig()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: {path!r} is not valid TOML: {e}") from None
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
