"""
The tables of the server's configuration file that every process serving
clients reads alike (the server and the routers of a tier): C{[store]}
(where keys and usage are kept, and how usage is written,
L{llmgw.accounts.usage}), C{[limits]} (the keys' limits counted together,
L{llmgw.accounts.keysync}) and C{[auth]}, each key's kind, default and
meaning given with its field.  The store itself is a leaf that imports
nothing of llmgw, so its table is read here, beside the usage writer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from llmgw.config_checks import (
    DURATION,
    ConfigError,
    Table,
    check_bool,
    check_keys,
    check_string,
    parse_duration,
    setting,
    settings_keys,
)


@dataclass(frozen=True)
class StoreConfig:
    """
    The C{[store]} table.
    """

    url: str = setting(
        "",
        "sqlite:/// or postgresql:// URL",
        "Where keys, usage and the leader are kept; by default"
        " STATE_DIR/llmgw.db (SQLite).",
        shown="none",
    )
    flush_interval: float = setting(
        1.0, DURATION, "Between usage batch writes (more than 0s)."
    )
    record_usage: bool = setting(
        True,
        "boolean",
        "false keeps no record per request (only its log line); each key's"
        " totals are still counted.",
    )
    usage_retention: float = setting(
        365 * 86400.0,
        DURATION,
        "How long each request's usage record is kept (at least 1d); older"
        " ones are rolled into daily totals per key and model, which the"
        " usage API and llmgw ctl usage still count.",
    )


STORE_TABLE = Table(
    "[store]",
    "The database of API keys and usage records.",
    settings_keys(StoreConfig),
)


def parse_store(table: object) -> StoreConfig:
    """
    @return: the C{[store]} table's settings.
    @raise ConfigError: an unknown key or a bad value, named.
    """
    if not isinstance(table, dict):
        raise ConfigError(f"store: expected a table, got {table!r}")
    check_keys("store", table, STORE_TABLE.names)
    store = StoreConfig()
    if "record_usage" in table:
        record = check_bool("store.record_usage", table["record_usage"])
        store = replace(store, record_usage=record)
    if "url" in table:
        store = replace(store, url=check_string("store.url", table["url"]))
    if "flush_interval" in table:
        interval = parse_duration("store.flush_interval", table["flush_interval"])
        if interval <= 0:
            raise ConfigError("store.flush_interval: must be positive")
        store = replace(store, flush_interval=interval)
    if "usage_retention" in table:
        kept = parse_duration("store.usage_retention", table["usage_retention"])
        if kept < MIN_RETENTION:
            raise ConfigError(
                f"store.usage_retention: {table['usage_retention']!r} is less than"
                ' a day: records are rolled into daily totals; use "1d" or more'
            )
        store = replace(store, usage_retention=kept)
    return store


MIN_RETENTION = 86400.0
"""
The shortest C{[store] usage_retention}, seconds: the totals are daily.
"""


@dataclass(frozen=True)
class LimitsConfig:
    """
    The C{[limits]} table.
    """

    url: str = setting(
        "",
        "redis:// or rediss:// URL",
        "Redis counting requests, tokens and budgets for every router"
        " together; by default each router counts its own.",
        shown="none",
    )
    routers: int = setting(
        1,
        "integer >= 1",
        "Routers sharing the keys' limits: without Redis (or while it is"
        " away) each admits ceil(limit / routers).",
    )


LIMITS_TABLE = Table(
    "[limits]",
    "The API keys' rate limits and budgets, counted across routers.",
    settings_keys(LimitsConfig),
)


def parse_limits(table: object) -> LimitsConfig:
    """
    @return: the C{[limits]} table's settings.
    @raise ConfigError: an unknown key or a bad value, named.
    """
    if not isinstance(table, dict):
        raise ConfigError(f"limits: expected a table, got {table!r}")
    check_keys("limits", table, LIMITS_TABLE.names)
    limits = LimitsConfig()
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
        limits = replace(limits, url=url)
    if "routers" in table:
        routers = table["routers"]
        if isinstance(routers, bool) or not isinstance(routers, int) or routers < 1:
            raise ConfigError(
                "limits.routers: expected a whole number of at least 1,"
                f" got {routers!r}"
            )
        limits = replace(limits, routers=routers)
    return limits


@dataclass(frozen=True)
class AuthConfig:
    """
    The C{[auth]} table.
    """

    require_api_key: bool = setting(
        False,
        "boolean",
        "Requests need an API key even before any key exists (otherwise,"
        " from the first key made).",
    )


AUTH_TABLE = Table(
    "[auth]",
    "Client authentication by API key (llmgw ctl keys).",
    settings_keys(AuthConfig),
)


def parse_auth(table: object) -> AuthConfig:
    """
    @return: the C{[auth]} table's settings.
    @raise ConfigError: an unknown key or a bad value, named.
    """
    if not isinstance(table, dict):
        raise ConfigError(f"auth: expected a table, got {table!r}")
    check_keys("auth", table, AUTH_TABLE.names)
    return AuthConfig(
        check_bool("auth.require_api_key", table.get("require_api_key", False))
    )
