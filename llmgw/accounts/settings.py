"""
The tables of the server's configuration file that every process serving
clients reads alike (the server and the routers of a tier): C{[store]}
(where keys and usage are kept, and how usage is written,
L{llmgw.accounts.usage}), C{[limits]} (the keys' limits counted together,
L{llmgw.accounts.keysync}) and C{[auth]}, each key's kind (which reads
and checks it), default and meaning given with its field.  The store
itself is a leaf that imports nothing of llmgw, so its table is read here,
beside the usage writer.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.config_checks import (
    BOOLEAN,
    POSITIVE,
    Duration,
    Table,
    Text,
    Url,
    setting,
    settings_keys,
)

MIN_RETENTION = 86400.0
"""
The shortest C{[store] usage_retention}, seconds: the totals are daily.
"""


@dataclass(frozen=True)
class StoreConfig:
    """
    The C{[store]} table.
    """

    url: str = setting(
        "",
        Text("sqlite:/// or postgresql:// URL"),
        "Where keys, usage and the leader are kept; by default"
        " STATE_DIR/llmgw.db (SQLite).",
        shown="none",
    )
    flush_interval: float = setting(
        1.0, Duration(positive=True), "Between usage batch writes."
    )
    record_usage: bool = setting(
        True,
        BOOLEAN,
        "false keeps no record per request (only its log line); each key's"
        " totals are still counted.",
    )
    usage_retention: float = setting(
        365 * 86400.0,
        Duration(least=MIN_RETENTION),
        "How long each request's usage record is kept; older"
        " ones are rolled into daily totals per key and model, which the"
        " usage API and llmgw ctl usage still count.",
    )
    responses_retention: float = setting(
        30 * 86400.0,
        Duration(positive=True),
        "How long the Responses API's stored responses are kept (store:"
        " true); older ones read as unknown and are deleted every hour.",
    )


STORE_TABLE = Table(
    "[store]",
    "The database of API keys, usage records and stored responses.",
    settings_keys(StoreConfig),
)


def parse_store(table: object) -> StoreConfig:
    """
    @return: the C{[store]} table's settings.
    @raise ConfigError: an unknown key or a bad value, named.
    """
    return StoreConfig(**STORE_TABLE.read(table))


@dataclass(frozen=True)
class LimitsConfig:
    """
    The C{[limits]} table.
    """

    url: str = setting(
        "",
        Url(("redis", "rediss"), "redis://host:port/db or rediss://host:port/db"),
        "Redis counting requests, tokens and budgets for every router"
        " together; by default each router counts its own.",
        shown="none",
    )
    routers: int = setting(
        1,
        POSITIVE,
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
    return LimitsConfig(**LIMITS_TABLE.read(table))


@dataclass(frozen=True)
class AuthConfig:
    """
    The C{[auth]} table.
    """

    require_api_key: bool = setting(
        False,
        BOOLEAN,
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
    return AuthConfig(**AUTH_TABLE.read(table))
