"""
The router's tables of the server's config file: C{[router]} and
C{[cors]}, read into the router's L{RouterConfig} (its connection edge,
deadlines, routing policy and cross-origin policy), and C{[[endpoints]]},
the static replicas, read into L{Endpoint}s; L{llmgw.config} composes the
file out of every table's parser.

Errors are L{ConfigError}s of one line naming the key, as everywhere in
the config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from llmgw.config_checks import (
    COUNT,
    DURATION,
    POSITIVE,
    REQUIRED,
    SIZE,
    ConfigError,
    Key,
    Table,
    check_bool,
    check_choice,
    check_keys,
    check_string,
    check_url,
    parse_duration,
    parse_size,
    setting,
    settings_keys,
)
from llmgw.router.interfaces import Endpoint
from llmgw.router.settings import BALANCE, ORDERS, RouterConfig

ROUTER_TABLE = Table(
    "[router]",
    "The router: deadlines, bounds on requests and answers, the connection"
    " edge, replica choice, affinity, outlier ejection and overload.",
    settings_keys(RouterConfig),
)

CORS_TABLE = Table(
    "[cors]",
    "Cross-origin requests, for scripts in web pages; without this table,"
    " no CORS headers.",
    (
        Key(
            "allow_origins",
            'list of origins, or "*"',
            "The origins allowed, scheme://host[:port] with no path (compared"
            ' in lower case), or "*" for any.',
            [],
        ),
    ),
)

ENDPOINTS_TABLE = Table(
    "[[endpoints]]",
    "Static replicas: engines llmgw does not run, one table each"
    " (--endpoint replaces them all).",
    (
        Key("id", "string", "The replica's id, unique among endpoints."),
        Key(
            "url",
            "http(s) URL",
            "The engine's base URL, http://host:port, without /v1; no query.",
        ),
        Key(
            "models",
            "list of strings, or a string",
            "The model names clients may send for it (the engine's served names).",
        ),
        Key(
            "weight",
            "number > 0",
            'Relative capacity; under balance = "load" multiplied by the learnt speed.',
            1.0,
        ),
        Key(
            "api_key",
            "string",
            "The engine's --api-key, sent as Authorization: Bearer (visible"
            ' ASCII); "" for none.',
            "",
        ),
        Key(
            "messages",
            "boolean",
            "The engine serves Anthropic's Messages API itself (vLLM): /v1/messages"
            " requests go to it as they are, not translated to chat completions.",
            False,
        ),
    ),
)


def parse_router(table: object) -> RouterConfig:
    """
    @return: the C{[router]} table's settings.
    @raise ConfigError: an unknown key or a bad value, named.
    """
    if not isinstance(table, dict):
        raise ConfigError(f"router: expected a table, got {table!r}")
    defaults = RouterConfig()
    durations = ROUTER_TABLE.of_kind(DURATION)
    counts = ROUTER_TABLE.of_kind(COUNT) | ROUTER_TABLE.of_kind(POSITIVE)
    sizes = ROUTER_TABLE.of_kind(SIZE)
    check_keys("router", table, ROUTER_TABLE.names)
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in durations | counts | sizes:
            values[key] = _routing_value(key, value)
        elif key in durations:
            values[key] = parse_duration(f"router.{key}", value)
        elif key in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"router.{key}: expected a non-negative integer, got {value!r}"
                )
            values[key] = value
        elif key == "min_body_rate" and value in (0, "0", "0B"):
            values[key] = 0  # off; parse_size refuses 0
        else:
            values[key] = parse_size(f"router.{key}", value)
    router = replace(defaults, **values)
    if router.overload_queue_size < 1:
        raise ConfigError("router.overload_queue_size: must be at least 1")
    if router.activation_queue < 1:
        raise ConfigError("router.activation_queue: must be at least 1")
    if 0 < router.activation_keepalive < 0.1:
        raise ConfigError(
            "router.activation_keepalive: under the least, 100ms (0s turns it off)"
        )
    _check_edge(router)
    if 0 < router.load_poll_interval < 0.1:
        raise ConfigError(
            "router.load_poll_interval: under the least, 100ms (0s turns it off)"
        )
    return router


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]*$")


def _routing_value(key: str, value: object) -> object:
    """
    @return: the value of one of C{[router]}'s routing keys that is not a
        duration, count or size, checked.
    @raise ConfigError: it is not valid.
    """
    where = f"router.{key}"
    if key == "balance":
        return check_choice(where, value, BALANCE)
    if key == "waiting_order":
        return check_choice(where, value, ORDERS)
    if key in ("prefix_affinity", "log_candidates"):
        return check_bool(where, value)
    if key == "affinity_epsilon":
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 <= value <= 100
        ):
            raise ConfigError(
                f"{where}: expected a number from 0 to 100, got {value!r}"
            )
        return float(value)
    # session_header: a header name (RFC 9110 token), or "" for none.
    if not isinstance(value, str) or not _HEADER_NAME.match(value):
        raise ConfigError(f'{where}: expected a header name or "", got {value!r}')
    return value


_ORIGIN = re.compile(r"^https?://[^/?#@\s]+$")


def parse_cors(table: object) -> tuple[str, ...]:
    """
    @return: the C{[cors] allow_origins}: C{("*",)}, or the origins, lower
        case (as browsers send C{Origin}, RFC 6454 section 6.1).
    """
    if not isinstance(table, dict):
        raise ConfigError(f"cors: expected a table, got {table!r}")
    check_keys("cors", table, CORS_TABLE.names)
    value = table.get("allow_origins", [])
    if value == "*":
        return ("*",)
    if not isinstance(value, list):
        raise ConfigError(
            'cors.allow_origins: expected "*" or a list of origins'
            f' such as ["https://app.example.com"], got {value!r}'
        )
    origins: list[str] = []
    for origin in value:
        if not isinstance(origin, str) or not _ORIGIN.match(origin):
            raise ConfigError(
                "cors.allow_origins: expected an origin, scheme://host[:port]"
                f' with no path (or "*" alone), got {origin!r}'
            )
        origins.append(origin.lower())
    return tuple(origins)


def _check_edge(router: RouterConfig) -> None:
    """
    @raise ConfigError: a bound of the connection edge that would refuse
        every client.
    """
    for key in ("max_request_line", "max_header_size"):
        if getattr(router, key) < 1024:
            raise ConfigError(f"router.{key}: under the least, 1KiB")
    if router.min_body_rate > 0 and router.body_rate_window < 0.1:
        raise ConfigError(
            "router.body_rate_window: under the least, 100ms, while"
            " min_body_rate is set (min_body_rate = 0 turns the check off)"
        )


def parse_endpoint(where: str, table: object) -> Endpoint:
    """
    @param where: the table's name in messages, C{"endpoints[0]"}.
    @return: one C{[[endpoints]]} table's replica.
    @raise ConfigError: an unknown key, a missing one or a bad value, named.
    """
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {table!r}")
    check_keys(where, table, ENDPOINTS_TABLE.names)
    for key in ENDPOINTS_TABLE.keys:
        if key.default is REQUIRED and key.name not in table:
            raise ConfigError(f"{where}.{key.name}: missing")
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
    messages = table.get("messages", False)
    if not isinstance(messages, bool):
        raise ConfigError(f"{where}.messages: expected true or false, got {messages!r}")
    return Endpoint(
        endpoint_id, url, tuple(models), float(weight), api_key, messages=messages
    )


def parse_endpoints(tables: object) -> tuple[Endpoint, ...]:
    """
    @return: the C{[[endpoints]]} tables' replicas, in order.
    @raise ConfigError: not an array of tables, or a bad table, named.
    """
    if not isinstance(tables, list):
        raise ConfigError(
            f"endpoints: expected an array of tables ([[endpoints]]), got {tables!r}"
        )
    return tuple(
        parse_endpoint(f"endpoints[{index}]", table)
        for index, table in enumerate(tables)
    )


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
        "http:// or https:// URL",
        "The OpenTelemetry collector spans go to over OTLP/HTTP (the exporter"
        " adds /v1/traces); by default none: tracing off.",
        shown="none",
    )
    sample_ratio: float = setting(
        1.0,
        "number, 0 to 1",
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
    if not isinstance(table, dict):
        raise ConfigError(f"tracing: expected a table, got {table!r}")
    check_keys("tracing", table, TRACING_TABLE.names)
    tracing = TracingConfig()
    if "otlp_endpoint" in table:
        url = check_url("tracing.otlp_endpoint", table["otlp_endpoint"])
        tracing = replace(tracing, otlp_endpoint=url)
    if "sample_ratio" in table:
        ratio = table["sample_ratio"]
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, int | float)
            or not 0 <= ratio <= 1
        ):
            raise ConfigError(
                f"tracing.sample_ratio: expected a number from 0 to 1, got {ratio!r}"
            )
        tracing = replace(tracing, sample_ratio=float(ratio))
    return tracing
