"""
The C{[router]} and C{[cors]} tables of the server's config file, read
into the router's L{RouterConfig} (its connection edge, deadlines, routing
policy and cross-origin policy); L{llmgw.config} reads the rest.

Errors are L{ConfigError}s of one line naming the key, as everywhere in
the config.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from llmgw.config_checks import (
    ConfigError,
    check_bool,
    check_choice,
    check_keys,
    parse_duration,
    parse_size,
)
from llmgw.router.settings import BALANCE, RouterConfig


def parse_router(table: object) -> RouterConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"router: expected a table, got {table!r}")
    defaults = RouterConfig()
    durations = {
        "connect_timeout",
        "first_byte_timeout",
        "idle_timeout",
        "client_stall_timeout",
        "total_timeout",
        "eject_cooldown",
        "drain_timeout",
        "activation_timeout",
        "activation_keepalive",
        "header_timeout",
        "body_rate_window",
        "keepalive_timeout",
        "load_poll_interval",
        "eject_base_cooldown",
        "overload_wait",
    }
    counts = {
        "max_retries",
        "max_idle_connections",
        "activation_queue",
        "max_connections",
        "max_connections_per_client",
        "prefix_min_tokens",
        "eject_after",
        "overload_queue_depth",
        "overload_queue_size",
    }
    sizes = {
        "max_body_size",
        "max_response_size",
        "max_event_size",
        "min_body_rate",
        "max_request_line",
        "max_header_size",
        "prefix_bytes",
    }
    others = {"balance", "prefix_affinity", "affinity_epsilon", "session_header"}
    check_keys("router", table, durations | counts | sizes | others)
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key in others:
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
    if key == "prefix_affinity":
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
    check_keys("cors", table, {"allow_origins"})
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
