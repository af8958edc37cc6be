"""
The server process's own tables of its configuration file: C{[standby]}
(leadership among servers on one PostgreSQL, L{llmgw.server.standby}) and
C{[agent_tls]} (the agent listener's certificates), each key's kind (which
reads and checks it), default and meaning given with its field.  A leaf
beside the modules that read them: it imports only L{llmgw.config_checks},
so that reading the file pulls in none of the server's wiring.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.config_checks import (
    Address,
    ConfigError,
    Duration,
    Key,
    Table,
    Text,
    Url,
    setting,
    settings_keys,
)

_PATH = Text("path")


@dataclass(frozen=True)
class AgentTLSConfig:
    """
    The C{[agent_tls]} table: PEM paths, as C{llmgw certs} writes them.
    """

    ca: str
    cert: str
    key: str


AGENT_TLS_TABLE = Table(
    "[agent_tls]",
    "Mutual TLS for the agent listener (agent_listen): PEM files as llmgw"
    " certs writes them.  Without it (and without insecure_agents) the server"
    " accepts no agents.",
    (
        Key("ca", _PATH, "The fleet's CA certificate (ca.pem)."),
        Key("cert", _PATH, "The server's certificate (server.pem)."),
        Key("key", _PATH, "The server's private key (server-key.pem)."),
    ),
)


def parse_agent_tls(table: object) -> AgentTLSConfig:
    """
    @return: the C{[agent_tls]} table's paths.
    @raise ConfigError: an unknown key, a missing one or a bad value, named.
    """
    return AgentTLSConfig(**AGENT_TLS_TABLE.read(table))


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

    url: str = setting(
        "",
        Url(("postgresql", "postgres"), "postgresql://user@host:port/db", host=False),
        "The PostgreSQL whose advisory lock chooses the leader; by default"
        " [store] url when it is PostgreSQL, else this server leads alone.",
        shown="none",
    )
    advertise: str = setting(
        "",
        Address(),
        "What agents dial to reach this server's agent listener, recorded for"
        " the standbys to name; by default the listener's address, the host's"
        " name for 0.0.0.0.",
        shown="none",
    )
    retry: float = setting(
        1.0,
        Duration(least=0.1, most=60.0),
        "A standby's tries of the lock, and a leader's checks of its"
        " connection, this often.",
    )
    lease: float = setting(
        5.0,
        # At least twice the shortest retry, 100ms.
        Duration(least=0.2),
        "A leader that cannot show its connection alive this long stops"
        " leading and exits (status 75); at least twice retry.",
    )


STANDBY_TABLE = Table(
    "[standby]",
    "Standby control planes: servers on one PostgreSQL, one leading, the"
    " others taking over when it dies.",
    settings_keys(StandbyConfig),
)


def parse_standby(table: object) -> StandbyConfig:
    """
    @return: the C{[standby]} table's settings.
    @raise ConfigError: an unknown key, a bad value, or a lease under twice
        the retry.
    """
    standby = StandbyConfig(**STANDBY_TABLE.read(table))
    if standby.lease < 2 * standby.retry:
        raise ConfigError(
            f"standby.lease: {standby.lease:g}s is under twice retry"
            f" ({standby.retry:g}s)"
        )
    return standby
