"""
The router's settings, the C{[router]} table of the server's configuration
(read by L{llmgw.router.settings_toml}).  Here, in the router, so that the
router needs nothing of the configuration module, which also knows the
control plane's catalog.  Each key's kind (which reads and checks it),
default and meaning is given with its field
(L{llmgw.config_checks.setting}), for the parser and the configuration
reference alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw.config_checks import (
    BOOLEAN,
    COUNT,
    DURATION,
    POSITIVE,
    SIZE,
    Choice,
    Duration,
    Number,
    Size,
    Text,
    setting,
)

BALANCE = ("load", "least_in_flight", "round_robin")
"""
The C{[router] balance} policies (L{llmgw.router.routing.balancer}).
"""

ORDERS = ("fair", "fifo")
"""
The values of C{waiting_order}: by priority and fair share
(L{llmgw.router.routing.fairness}), or first come, first served.
"""

_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]*$")
"""
A header name, an RFC 9110 token (or nothing).
"""

_OFF_OR_100MS = Duration(least=0.1, off=True)
_ONE_KIB = Size(least=1024)


@dataclass(frozen=True)
class RouterConfig:
    """
    Router settings, the C{[router]} table.  Durations in seconds, sizes in
    bytes; a duration of 0 disables that deadline.

    @ivar cors_allow_origins: the C{[cors] allow_origins}: C{("*",)}, the
        origins allowed, or C{()} for no CORS.
    """

    connect_timeout: float = setting(5.0, DURATION, "TCP connect to a replica.")
    first_byte_timeout: float = setting(
        300.0,
        DURATION,
        "From the request sent to the first byte of the answer, for a request"
        " of up to 8,192 tokens, in proportion beyond (a long prompt's prefill,"
        " an unstreamed answer's max_tokens).",
    )
    idle_timeout: float = setting(
        60.0,
        DURATION,
        "Between two chunks of an answer; not counted while a slow client"
        " holds the stream back (llmgw then stops reading the replica).",
    )
    client_stall_timeout: float = setting(
        60.0,
        DURATION,
        "A client that holds a stream back and reads nothing this long is cut.",
    )
    total_timeout: float = setting(
        1800.0, DURATION, 'The whole request; "0s" disables any of these deadlines.'
    )
    max_body_size: int = setting(
        32 * 1024 * 1024, SIZE, "Larger request bodies get 413."
    )
    max_response_size: int = setting(
        256 * 1024 * 1024,
        SIZE,
        "A larger whole (non-streamed) answer from a replica is a 502.",
    )
    max_event_size: int = setting(
        16 * 1024 * 1024,
        SIZE,
        "One server-sent event larger than this ends the stream with an error.",
    )
    max_retries: int = setting(
        2,
        COUNT,
        "Other replicas tried on connect failure or 503 (and, once, when a"
        " pooled connection closes with no answer byte), before the first"
        " byte only.",
    )
    eject_cooldown: float = setting(
        10.0, DURATION, "A replica that refuses connections is passed over this long."
    )
    max_idle_connections: int = setting(
        256, COUNT, "Idle keep-alive connections kept per replica."
    )
    drain_timeout: float = setting(
        30.0, DURATION, "On stop (SIGTERM), requests in flight get this long to finish."
    )
    activation_timeout: float = setting(
        300.0,
        DURATION,
        "Scale from zero: a request for a catalog model with no ready replica"
        " waits this long for one, then gets 503.",
    )
    activation_queue: int = setting(
        256,
        POSITIVE,
        "Requests that may wait per model for a replica, on each router and,"
        " the server's value, across the fleet; past it the lowest priority's"
        " newest gets 503, whichever router holds it.",
    )
    activation_keepalive: float = setting(
        15.0,
        _OFF_OR_100MS,
        "A waiting stream gets an SSE comment line (a keep-alive for proxies)"
        ' this often; "0s" turns it off.',
    )
    cors_allow_origins: tuple[str, ...] = ()
    header_timeout: float = setting(
        10.0,
        DURATION,
        "The request line and headers, from the request's first byte: else"
        " 408 and the connection closed.",
    )
    min_body_rate: int = setting(
        1024,
        Size(off=True),
        "Bytes a second a request body must keep up over each"
        " body_rate_window: else 408 (HTTP/2: the stream reset); 0 turns the"
        " check off.",
    )
    body_rate_window: float = setting(
        10.0,
        DURATION,
        "The window min_body_rate is measured over; at least 100ms while"
        " min_body_rate is set.",
    )
    keepalive_timeout: float = setting(
        60.0,
        DURATION,
        "A connection idle between requests (or before its first) is closed.",
    )
    max_request_line: int = setting(
        16 * 1024, _ONE_KIB, "Longer request lines get 414."
    )
    max_header_size: int = setting(
        32 * 1024, _ONE_KIB, "Larger headers, or over 500 lines, get 431."
    )
    max_connections: int = setting(
        16384,
        COUNT,
        "Open client connections (0: no cap); more are closed at once, with a"
        " 503 (Retry-After: 1) on plain TCP, and one log line per 10 s while"
        " refusing.",
    )
    max_connections_per_client: int = setting(
        1024,
        COUNT,
        "The same per client IP address (0: no cap); behind a proxy, raise it."
        " At start the open-file soft limit is raised to the hard limit.",
    )
    load_poll_interval: float = setting(
        1.0,
        _OFF_OR_100MS,
        "Each replica's /metrics (engine load) is read this often;"
        ' "0s" turns the poller off.',
    )
    balance: str = setting(
        "load",
        Choice(BALANCE),
        'Replica choice: "load" (in flight plus the engine\'s waiting'
        " requests, weighted by each replica's weight and learnt speed),"
        ' "least_in_flight" (the router\'s own count, random ties) or'
        ' "round_robin".',
    )
    prefix_affinity: bool = setting(
        True,
        BOOLEAN,
        'With balance = "load": sessions and long shared prompts stay on one'
        " replica while its load is within (1 + affinity_epsilon) times the"
        " model's average; false: no affinity of any kind.",
    )
    prefix_bytes: int = setting(
        1024,
        SIZE,
        "Leading prompt content hashed for prefix affinity (the messages'"
        " roles and text, or the prompt).",
    )
    prefix_min_tokens: int = setting(
        256,
        COUNT,
        "Shorter prompts (estimated, 4 bytes of body a token) get no prefix affinity.",
    )
    affinity_epsilon: float = setting(
        0.25,
        Number(least=0, most=100),
        "The affinity bound's slack (HAProxy's hash-balance-factor 125 is 0.25).",
    )
    session_header: str = setting(
        "X-Session-ID",
        Text("header name", empty=True, pattern=_HEADER_NAME),
        'A request with this header, else with the OpenAI "user" field, keeps'
        ' its replica (within the same bound); "" for none.',
    )
    eject_after: int = setting(
        5,
        COUNT,
        "Failed answers (5xx, deadlines) in a row that eject a replica (0:"
        " never); never the last replica of a model in service.",
    )
    eject_base_cooldown: float = setting(
        10.0,
        DURATION,
        "The first ejection's length, doubled on each one in a row (up to"
        " 64 times); then one request probes the replica.",
    )
    overload_queue_depth: int = setting(
        64,
        COUNT,
        "When every replica of a model reports more waiting requests than"
        " this (fresh readings; 0 turns it off), new requests wait in the"
        " router.",
    )
    overload_wait: float = setting(
        30.0,
        DURATION,
        'How long an overloaded model\'s request waits at most, then 429; "0s":'
        " 429 at once (Retry-After: the poll interval, at least 1 s).",
    )
    overload_queue_size: int = setting(
        256,
        POSITIVE,
        "Requests that may wait per overloaded model; more get 429 at once.",
    )
    log_candidates: bool = setting(
        False,
        BOOLEAN,
        "Every request's JSON log line lists the replicas weighed and their"
        " scores (in flight, waiting, KV use, speed, affinity owner, ejection);"
        " without it, only a request sent with X-LLMGW-Explain: 1.",
    )
    waiting_order: str = setting(
        "fair",
        Choice(ORDERS),
        'Who goes first where requests wait: "fair" (the key\'s priority, then'
        " its weighted share of the tokens served lately; a full room refuses"
        ' the lowest priority\'s newest) or "fifo" (first come, first served).',
    )
