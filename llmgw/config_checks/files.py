"""
A configuration file read, and its mistakes told after its path: the
server, its router workers, a tier's routers and each agent may each read
another file, so every error a file causes names it.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from llmgw.config_checks.values import ConfigError


def read_toml(path: str) -> dict[str, Any]:
    """
    @param path: the file C{--config} names.
    @return: its tables, as L{tomllib} reads them.
    @raise ConfigError: it cannot be read, or is not TOML.
    """
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config: cannot read {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: {path!r} is not valid TOML: {e}") from None


@contextmanager
def told_in(path: str | None, how: str = "") -> Iterator[None]:
    """
    Tell a L{ConfigError} raised inside after C{path} (and C{how} it was
    read, such as C{" with the flags"} for what is checked once the flags
    are merged in): C{"/etc/llmgw/server.toml: control.lost_after: ..."}.
    With no file (C{path} L{None}) the error passes as it is.
    """
    try:
        yield
    except ConfigError as e:
        if path is None:
            raise
        raise ConfigError(f"{path}{how}: {e}") from None
