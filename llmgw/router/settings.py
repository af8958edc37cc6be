"""
The router's settings, the C{[router]} table of the server's configuration
(parsed and checked by L{llmgw.config}).  Here, in the router, so that the
router needs nothing of the configuration module, which also knows the
control plane's catalog.
"""

from __future__ import annotations

from dataclasses import dataclass

BALANCE = ("load", "least_in_flight", "round_robin")
"""
The C{[router] balance} policies (L{llmgw.router.balancer}).
"""


@dataclass(frozen=True)
class RouterConfig:
    """
    Router settings, the C{[router]} table.  Durations in seconds, sizes in
    bytes; a duration of 0 disables that deadline.
    """

    connect_timeout: float = 5.0
    # Long prefill is normal on big prompts: minutes, not seconds.
    first_byte_timeout: float = 300.0
    idle_timeout: float = 60.0
    # A client that holds a stream back (llmgw stopped reading the replica
    # for it) and reads nothing for this long is cut.
    client_stall_timeout: float = 60.0
    total_timeout: float = 1800.0
    max_body_size: int = 32 * 1024 * 1024
    # Bounds on what a replica may send: a whole (non-streamed) answer, and
    # one event of a stream.
    max_response_size: int = 256 * 1024 * 1024
    max_event_size: int = 16 * 1024 * 1024
    max_retries: int = 2
    eject_cooldown: float = 10.0
    max_idle_connections: int = 256
    # On stop, requests in flight get this long to finish.
    drain_timeout: float = 30.0
    # Scale from zero: how long a request for a catalog model with no ready
    # replica waits for one, how many may wait per model, and how often a
    # waiting stream gets an SSE comment line (a keep-alive for proxies).
    activation_timeout: float = 300.0
    activation_queue: int = 256
    activation_keepalive: float = 15.0
    # [cors] allow_origins: ("*",), the origins allowed, or () for no CORS.
    cors_allow_origins: tuple[str, ...] = ()
    # The connection edge (L{llmgw.router.edge}): the request line and
    # headers within header_timeout of the request's first byte; the body at
    # min_body_rate bytes/s over each body_rate_window; keepalive_timeout
    # idle between requests; caps on the request line and headers (414,
    # 431) and on open connections, in all and per client address (0: no
    # cap).
    header_timeout: float = 10.0
    min_body_rate: int = 1024
    body_rate_window: float = 10.0
    keepalive_timeout: float = 60.0
    max_request_line: int = 16 * 1024
    max_header_size: int = 32 * 1024
    max_connections: int = 16384
    max_connections_per_client: int = 1024
    # Seconds between reads of each replica's /metrics (engine load); 0
    # turns the poller off.
    load_poll_interval: float = 1.0
    # Replica choice (L{llmgw.router.balancer}): "load" (in flight plus the
    # engine's queue), "least_in_flight" (the router's own count, random
    # ties) or "round_robin".
    balance: str = "load"
    # Affinity (L{llmgw.router.affinity}): sessions and long shared prompt
    # prefixes stay on one replica while its load is within (1 + epsilon)
    # times the model's average.
    prefix_affinity: bool = True
    prefix_bytes: int = 1024
    prefix_min_tokens: int = 256
    affinity_epsilon: float = 0.25
    session_header: str = "X-Session-ID"
    # Outlier ejection (L{llmgw.router.ejection}): failed answers (5xx,
    # deadlines) in a row that eject a replica (0: never), and the first
    # cooldown, doubled on each ejection in a row.
    eject_after: int = 5
    eject_base_cooldown: float = 10.0
    # Overload (L{llmgw.router.overload}): when every replica of a model
    # reports more than this many waiting requests (0: off), new requests
    # wait up to overload_wait (0: a 429 at once) in a queue of at most
    # overload_queue_size per model.
    overload_queue_depth: int = 64
    overload_wait: float = 30.0
    overload_queue_size: int = 256
