"""
The grammar of a configuration value, one function per shape: durations,
sizes, URLs, booleans, choices and strings, each turning what a TOML file
(or a flag, or a JSON field of the admin API) gives into what the settings
hold, or raising L{ConfigError}; and L{spelled}, the value as TOML writes
it, for the messages.  The kinds of L{llmgw.config_checks.kinds} read keys
through these; the flags (C{--log-format}) and the admin API's fields (a
key's C{expires}) call them directly.
"""

from __future__ import annotations

import math
import re
from datetime import date, datetime, time
from urllib.parse import urlsplit


class ConfigError(Exception):
    """
    The configuration is invalid.  C{str(error)} is one line naming the key
    and the value.
    """


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KB": 1000,
    "KiB": 1024,
    "MB": 1000**2,
    "MiB": 1024**2,
    "GB": 1000**3,
    "GiB": 1024**3,
}
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def spelled(value: object, literal: bool = True) -> str:
    """
    @param literal: whether a string is written as a TOML literal string,
        C{'5 minutes'}, as messages show values (as they always have: it
        is also how Python writes it), when it holds no quote or control
        character; else as a basic string, C{"5 minutes"}, as the
        reference shows defaults.
    @return: C{value} as a TOML file writes it: C{true}, C{'5 minutes'},
        C{1.5}, C{inf}, C{[1, 'a']}, C{{a = 1}}, a date-time; C{nothing}
        for L{None}, which a file cannot give.
    """
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        plain = "'" not in value and all(c >= " " and c != "\x7f" for c in value)
        return f"'{value}'" if literal and plain else _basic_string(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(spelled(item, literal) for item in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(
            f"{_key(k)} = {spelled(v, literal)}" for k, v in value.items()
        )
        return "{" + items + "}"
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    return repr(value)


def _basic_string(value: str) -> str:
    """
    @return: C{value} as a TOML basic string (double quotes, escapes).
    """
    out = []
    for c in value:
        if c in '"\\':
            out.append("\\" + c)
        elif c < " " or c == "\x7f":
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _key(name: object) -> str:
    """
    @return: a table key as TOML writes it: bare when it can be.
    """
    text = str(name)
    return text if _BARE_KEY.match(text) else _basic_string(text)


def parse_duration(key: str, value: object) -> float:
    """
    Parse a duration such as C{"250ms"}, C{"5s"}, C{"2m"} or C{"1h"}.

    @param key: the configuration key, for the error message.
    @param value: a string with a unit, or a non-negative number of seconds.
    @return: seconds.
    @raise ConfigError: the value is not a duration.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{key}: bad duration {spelled(value)}: must be finite")
        if value < 0:
            raise ConfigError(
                f"{key}: bad duration {spelled(value)}: must not be negative"
            )
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is not None:
            return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    raise ConfigError(
        f"{key}: bad duration {spelled(value)}: use a number with a unit,"
        ' ms, s, m, h or d, such as "5s" or "2m"'
    )


def parse_size(key: str, value: object, zero: bool = False) -> int:
    """
    Parse a size such as C{33554432}, C{"32MiB"} or C{"500KB"}.

    @param zero: whether 0 (in any unit) is a size; by default it is not.
    @return: bytes.
    @raise ConfigError: the value is not a size, or is zero (unless
        C{zero}).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)) is not None:
        size = int(match.group(1)) * _SIZE_UNITS[match.group(2)]
    else:
        raise ConfigError(
            f'{key}: bad size {spelled(value)}: use bytes or a unit, such as "32MiB"'
        )
    if size < 0 or (size == 0 and not zero):
        raise ConfigError(f"{key}: bad size {spelled(value)}: must be positive")
    return size


def parse_url(
    key: str,
    value: object,
    schemes: tuple[str, ...],
    example: str,
    *,
    host: bool = True,
    query: bool = True,
) -> str:
    """
    Check a URL's scheme, host and port.

    @param schemes: the schemes it may have, such as C{("redis", "rediss")}.
    @param example: what it should look like, for the message, such as
        C{"redis://host:port/db"}.
    @param host: whether it must name a host.
    @param query: whether it may carry a query or fragment.
    @return: C{value}, unchanged.
    @raise ConfigError: not a string, or a URL that breaks one of these.
    """
    if not isinstance(value, str):
        raise ConfigError(f"{key}: bad URL {spelled(value)}: expected a string")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (parses the port)
    except ValueError:
        raise ConfigError(f"{key}: bad URL {spelled(value)}") from None
    if parts.scheme not in schemes or (host and not parts.hostname):
        raise ConfigError(f"{key}: bad URL {spelled(value)}: expected {example}")
    if not query and (parts.query or parts.fragment):
        raise ConfigError(
            f"{key}: bad URL {spelled(value)}: no query or fragment allowed"
        )
    return value


def check_url(key: str, value: object) -> str:
    """
    @return: an C{http} or C{https} URL with a host, without the trailing
        slash.
    @raise ConfigError: anything else, or a URL with a query or fragment.
    """
    url = parse_url(
        key,
        value,
        ("http", "https"),
        "http://host:port or https://host:port",
        query=False,
    )
    return url.rstrip("/")


def check_bool(key: str, value: object) -> bool:
    """
    @raise ConfigError: not C{true} or C{false}.
    """
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {spelled(value)}")
    return value


def check_choice(key: str, value: object, choices: tuple[str, ...]) -> str:
    """
    @raise ConfigError: not one of the strings C{choices}.
    """
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(
            f"{key}: expected one of {', '.join(choices)}, got {spelled(value)}"
        )
    return value


def check_string(key: str, value: object) -> str:
    """
    @raise ConfigError: not a string, or empty.
    """
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {spelled(value)}")
    return value
