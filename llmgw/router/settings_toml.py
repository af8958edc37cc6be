"""
The router's tables of the server's config file: C{[router]} and
C{[cors]}, read into the router's L{RouterConfig} (its connection edge,
deadlines, routing policy and cross-origin policy), C{[[endpoints]]}, the
static replicas, read into L{Endpoint}s, and C{[tracing]}; each key
declared once with its kind, which reads and checks it
(L{llmgw.config_checks}); L{llmgw.config} composes the file out of every
table's parser.

Errors are L{ConfigError}s of one line naming the key, as everywhere in
the config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from llmgw.config_checks import (
    BOOLEAN,
    ArrayOfTables,
    ConfigError,
    Key,
    Kind,
    Number,
    Table,
    Text,
    Url,
    setting,
    settings_keys,
    spelled,
)
from llmgw.router.interfaces import Endpoint
from llmgw.router.settings import RouterConfig

ROUTER_TABLE = Table(
    "[router]",
    "The router: deadlines, bounds on requests and answers, the connection"
    " edge, replica choice, affinity, outlier ejection and overload.",
    settings_keys(RouterConfig),
)

_ORIGIN = re.compile(r"^https?://[^/?#@\s]+$")


@dataclass(frozen=True)
class Origins(Kind[tuple[str, ...]]):
    """
    C{[cors] allow_origins}: C{"*"}, read as C{("*",)}, or a list of
    origins, read lower case (as browsers send C{Origin}, RFC 6454 section
    6.1).
    """

    @property
    def words(self) -> str:
        return 'list of origins, or "*"'

    def read(self, where: str, value: object) -> tuple[str, ...]:
        if value == "*":
            return ("*",)
        if not isinstance(value, list):
            raise ConfigError(
                f'{where}: expected "*" or a list of origins'
                f' such as ["https://app.example.com"], got {spelled(value)}'
            )
        origins: list[str] = []
        for origin in value:
            if not isinstance(origin, str) or not _ORIGIN.match(origin):
                raise ConfigError(
                    f"{where}: expected an origin, scheme://host[:port]"
                    f' with no path (or "*" alone), got {spelled(origin)}'
                )
            origins.append(origin.lower())
        return tuple(origins)


CORS_TABLE = Table(
    "[cors]",
    "Cross-origin requests, for scripts in web pages; without this table,"
    " no CORS headers.",
    (
        Key(
            "allow_origins",
            Origins(),
            "The origins allowed, scheme://host[:port] with no path (compared"
            ' in lower case), or "*" for any.',
            (),
        ),
    ),
)


@dataclass(frozen=True)
class ModelNames(Kind[tuple[str, ...]]):
    """
    The model names of an endpoint: a list of names, or one name alone.
    """

    @property
    def words(self) -> str:
        return "list of strings, or a string"

    def read(self, where: str, value: object) -> tuple[str, ...]:
        names = [value] if isinstance(value, str) else value
        if (
            not isinstance(names, list)
            or not names
            or not all(isinstance(m, str) and m for m in names)
        ):
            raise ConfigError(
                f"{where}: expected a non-empty list of model names,"
                f" got {spelled(value)}"
            )
        return tuple(names)


_HTTP_URL = Url(
    ("http", "https"),
    "http://host:port or https://host:port",
    query=False,
    trim=True,
)

ENDPOINTS_TABLE = Table(
    "[[endpoints]]",
    "Static replicas: engines llmgw does not run, one table each"
    " (--endpoint replaces them all).",
    (
        Key("id", Text(), "The replica's id, unique among endpoints."),
        Key(
            "url",
            _HTTP_URL,
            "The engine's base URL, http://host:port, without /v1; no query.",
        ),
        Key(
            "models",
            ModelNames(),
            "The model names clients may send for it (the engine's served names).",
        ),
        Key(
            "weight",
            Number(positive=True),
            'Relative capacity; under balance = "load" multiplied by the learnt speed.',
            1.0,
        ),
        Key(
            "api_key",
            # Sent in a header: visible ASCII only, nothing to split it;
            # a secret, never shown in a message.
            Text(
                "string of visible ASCII characters",
                empty=True,
                pattern=re.compile(r"[!-~]*"),
                secret=True,
            ),
            'The engine\'s --api-key, sent as Authorization: Bearer; "" for none.',
            "",
        ),
        Key(
            "messages",
            BOOLEAN,
            "The engine serves Anthropic's Messages API itself (vLLM): /v1/messages"
            " requests go to it as they are, not translated to chat completions.",
            False,
        ),
    ),
)


def parse_router(table: object) -> RouterConfig:
    """
    @return: the C{[router]} table's settings.
    @raise ConfigError: an unknown key or a bad value, named; or a body
        rate checked over a window too short to measure.
    """
    router = RouterConfig(**ROUTER_TABLE.read(table))
    if router.min_body_rate > 0 and router.body_rate_window < 0.1:
        raise ConfigError(
            "router.body_rate_window: under the least, 100ms, while"
            " min_body_rate is set (min_body_rate = 0 turns the check off)"
        )
    return router


def parse_cors(table: object) -> tuple[str, ...]:
    """
    @return: the C{[cors] allow_origins}: C{("*",)}, or the origins, lower
        case.
    @raise ConfigError: an unknown key or a bad value, named.
    """
    origins: tuple[str, ...] = CORS_TABLE.read(table)["allow_origins"]
    return origins


def _endpoint(values: dict[str, Any]) -> Endpoint:
    """
    @return: the replica of one C{[[endpoints]]} table's values.
    """
    return Endpoint(
        values["id"],
        values["url"],
        values["models"],
        values["weight"],
        values["api_key"],
        messages=values["messages"],
    )


ENDPOINTS = ArrayOfTables(ENDPOINTS_TABLE, _endpoint)
"""
The C{[[endpoints]]} array, read into L{Endpoint}s.
"""


def parse_endpoint(where: str, table: object) -> Endpoint:
    """
    @param where: the table's name in messages, C{"endpoints[0]"}.
    @return: one C{[[endpoints]]} table's replica.
    @raise ConfigError: an unknown key, a missing one or a bad value, named.
    """
    return _endpoint(ENDPOINTS_TABLE.read(table, where))


def parse_endpoints(tables: object) -> tuple[Endpoint, ...]:
    """
    @return: the C{[[endpoints]]} tables' replicas, in order.
    @raise ConfigError: not an array of tables, or a bad table, named.
    """
    return ENDPOINTS.read("endpoints", tables)


@dataclass(frozen=True)
class TracingConfig:
    """
    The C{[tracing]} table: OpenTelemetry spans exported over OTLP/HTTP
    (L{llmgw.router.telemetry.tracing}).

    @ivar otlp_endpoint: the collector's URL (C{http://host:4318}, the
        exporter adds C{/v1/traces}); empty: tracing off, no exporter.
    @ivar sample_ratio: the share of requests traced, 0 to 1, unless the
        client's C{traceparent} decides.
    """

    otlp_endpoint: str = setting(
        "",
        _HTTP_URL,
        "The OpenTelemetry collector spans go to over OTLP/HTTP (the exporter"
        " adds /v1/traces); by default none: tracing off.",
        shown="none",
    )
    sample_ratio: float = setting(
        1.0,
        Number(least=0, most=1),
        "The share of client requests traced (a client's traceparent decides"
        " for its own).",
    )


TRACING_TABLE = Table(
    "[tracing]",
    "OpenTelemetry traces: a server span per client request with the GenAI"
    " attributes, its waits, attempts and relay, and the control plane's"
    " placements, starts and drains.",
    settings_keys(TracingConfig),
)


def parse_tracing(table: object) -> TracingConfig:
    """
    @return: the C{[tracing]} table's settings.
    @raise ConfigError: an unknown key or a bad value, named.
    """
    return TracingConfig(**TRACING_TABLE.read(table))
