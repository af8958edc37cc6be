"""
What the router defines and other parts of llmgw implement or fill in: the
endpoints it sends to, the models below their C{min_replicas}, the record
of a finished request and where it goes, the API-key check, and
scale-from-zero with where a held request stands.

A leaf: it imports nothing else from llmgw, so the store, the control plane,
the configuration and the server wiring may all import it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from twisted.internet.defer import Deferred


@dataclass(frozen=True)
class Endpoint:
    """
    A ready replica as the router sees it: where to send requests for which
    model names.  Also the shape of a statically configured replica
    (C{[[endpoints]]}, C{--endpoint}).

    @ivar id: the replica id, unique among endpoints.
    @ivar url: the engine's base URL, C{http://host:port}, no trailing slash
        and without C{/v1}.
    @ivar models: the model names clients may send for this replica (the
        engine's served model names).
    @ivar weight: relative share of traffic, > 0.
    @ivar api_key: the engine's own secret, sent as C{Authorization: Bearer}
        on every request to it; C{""} for none.  Never shown (not in the
        repr, not in the admin API).
    @ivar messages: whether the engine serves Anthropic's Messages API
        itself (C{/v1/messages}, C{/v1/messages/count_tokens}: vLLM), so
        that those requests are forwarded as they are; else the router
        translates them to chat completions.
    @ivar adapters: the LoRA adapters it may load, as C{(name, path)}: the
        catalog's adapters of its model (their names are in C{models}
        too); the router loads one the first time a request for it goes
        here (L{llmgw.router.routing.adapters}).
    @ivar max_loras: adapters it keeps loaded; beyond it the least
        recently used is unloaded.
    """

    id: str
    url: str
    models: tuple[str, ...]
    weight: float = 1.0
    api_key: str = field(default="", repr=False)
    messages: bool = False
    adapters: tuple[tuple[str, str], ...] = ()
    max_loras: int = 0


@dataclass(frozen=True)
class Shortfall:
    """
    A catalog model with fewer ready replicas than its C{min_replicas}, as
    the control plane publishes it beside the endpoints; C{/readyz} lists
    it as unavailable.

    @ivar model: the catalog name.
    @ivar ready: its replicas published now (ready, not draining).
    @ivar min_replicas: how many it should have at least.
    """

    model: str
    ready: int
    min_replicas: int


class Readiness:
    """
    What the router knows of the catalog's readiness: the models below
    their C{min_replicas}, as last published by the control plane (in the
    server) or read from the tier's watch (a router of a tier).

    @ivar below_min: those models, by name.
    """

    def __init__(self) -> None:
        self.below_min: tuple[Shortfall, ...] = ()

    def set(self, shortfalls: Iterable[Shortfall]) -> None:
        """
        The control plane published C{shortfalls}: they replace the last.
        """
        self.below_min = tuple(shortfalls)


@dataclass(frozen=True)
class RequestRecord:
    """
    What one client request used, for usage accounting.

    @ivar request_id: llmgw's own id of the request (unique: made for it
        alone, L{llmgw.router.edge.site.RequestIds}); its usage record's
        key.
    @ivar upstream_request_id: the C{X-Request-ID} the engine got.
    @ivar client_request_id: the client's own C{X-Request-ID}, or L{None}
        when it sent none (usable); not unique.

    @ivar latency: seconds from receipt to the last byte.
    @ivar time_to_first_token: seconds from receipt to the first byte of the
        replica's answer; L{None} when none came.
    @ivar usage_estimated: the token counts are the router's estimate: the
        engine's never came.
    @ivar reserved_tokens: tokens held against the key while the request
        ran.
    @ivar candidates: the replicas weighed for its last attempt and what
        was weighed (L{llmgw.router.routing.decision}), when asked; else L{None}.
    @ivar batch_id: the batch whose line this request was, or L{None} for
        a client's own request.
    """

    request_id: str
    upstream_request_id: str
    model: str
    replica: str | None
    status: int
    stream: bool
    prompt_tokens: int
    completion_tokens: int
    latency: float
    time_to_first_token: float | None
    key_id: int | None = None
    key_name: str | None = None
    usage_estimated: bool = False
    reserved_tokens: int = 0
    candidates: list[dict[str, Any]] | None = None
    client_request_id: str | None = None
    batch_id: str | None = None


class UsageSink(Protocol):
    """
    Receives one L{RequestRecord} per finished request.
    """

    def record(self, record: RequestRecord) -> None:
        """
        Take the record of a finished request; must not raise.
        """


@dataclass(frozen=True)
class KeptResponse:
    """
    A Responses API response as the router keeps it
    (L{llmgw.router.api.responses}).

    @ivar id: C{"resp_..."}.
    @ivar key_id: the API key that made it, or L{None} without keys.
    @ivar model: the model name the client sent.
    @ivar created_at: when it was made, POSIX seconds.
    @ivar previous_response_id: the response it continued, or L{None}.
    @ivar input_items: every input item the model saw, in order (those of
        the responses it continued first).
    @ivar output_items: its output items.
    @ivar response: the Response object as the client got it.
    """

    id: str
    key_id: int | None
    model: str
    created_at: float
    previous_response_id: str | None
    input_items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    response: dict[str, Any]


class ResponseStore(Protocol):
    """
    Where Responses API responses are kept (C{store}) and read back to be
    continued (C{previous_response_id}), under the key that made them.
    """

    def put(self, kept: KeptResponse) -> Deferred[None]:
        """
        Keep C{kept}; fires when written.
        """

    def get(
        self, response_id: str, key_id: int | None
    ) -> Deferred[KeptResponse | None]:
        """
        @return: fires with the response, or L{None} when it is unknown,
            expired or another key's.
        """

    def delete(self, response_id: str, key_id: int | None) -> Deferred[bool]:
        """
        Delete one of C{key_id}'s responses, as L{get} finds it.

        @return: fires with whether there was one to delete.
        """


@dataclass(frozen=True)
class Tenant:
    """
    Who a waiting request is for.

    @ivar name: the key's name; C{""} for a request without a key.
    @ivar rank: its priority's number, higher goes first
        (L{llmgw.router.routing.fairness.priority_rank}; 1 is C{standard}).
    @ivar weight: its weight, above 0.
    """

    name: str = ""
    rank: int = 1
    weight: float = 1.0


BATCH_RANK = -(2**31)
"""
The rank of a batch's lines where requests wait: below every priority a key
can hold, so that a batch line waits behind, and is refused before, any
client's own request.
"""


BATCH_RUN_AGAIN = frozenset({429, 499, 503})
"""
The statuses after which the batches' runner sends a line again: no room
now (429: the key's rate, the overload room; 503: no replica, the
activation queue full or timed out) or cut by a stop (499).  Such an
attempt is not the line's answer: it keeps no usage record, so that the
line's one record is its answer's.
"""


class BatchRoom(Protocol):
    """
    How many of a batch's lines may be sent to a model now: the batches'
    runner asks before it sends, and says when a line it sent ended, so
    that batch work fills what the fleet leaves idle and no more.
    """

    def room(self, model: str) -> int:
        """
        @param model: a model's catalog name.
        @return: how many more lines of C{model} may be in flight now
            (0: none; wait and ask again).
        """

    def sent(self, model: str) -> None:
        """
        One line of C{model} was sent.
        """

    def ended(self, model: str) -> None:
        """
        A line of C{model} sent earlier ended, however it ended.
        """


class Key(Protocol):
    """
    An API key as the router needs it.
    """

    @property
    def id(self) -> int:
        """
        The key's id in the store.
        """

    @property
    def name(self) -> str:
        """
        The key's name, for logs and usage records.
        """

    @property
    def tenant(self) -> Tenant:
        """
        Who its requests are for where they wait: its name, priority and
        weight (L{llmgw.router.routing.fairness}).
        """

    def allows(self, model: str, resolve: Callable[[str], str | None]) -> bool:
        """
        @param resolve: a name's catalog model, or L{None} (aliases count
            as the model they name).
        @return: whether the key may use C{model}.
        """


class Auth(Protocol):
    """
    API keys and their limits (L{llmgw.router.accounting.auth.KeyRing}).
    """

    def authenticate(self, header: bytes | None) -> Key | None:
        """
        @param header: the request's C{Authorization} value, or L{None}.
        @return: the key, or L{None} when none is needed.
        @raise llmgw.router.errors.APIError: 401.
        """

    def vouched(self, key_id: int | None) -> Key | None:
        """
        The key a batch line runs as: the one that made its batch, vouched
        for by the batches' runner (no secret comes with the line).

        @param key_id: its id, or L{None} for a batch made without keys.
        @return: the key, or L{None} when none is needed.
        @raise llmgw.router.errors.APIError: 401, the key is unknown,
            revoked or expired (or none came and keys are needed).
        """

    def admit(
        self, key: Key, names: Sequence[str], reserve: int
    ) -> Awaitable[None] | None:
        """
        Count a request of C{key} for a model known by C{names}.

        @param reserve: tokens to hold until L{used}.
        @return: L{None} when decided here and now, or an awaitable when
            the limits are shared (it fails the same way).
        @raise llmgw.router.errors.APIError: 403 or 429.
        """

    def used(self, key: Key, tokens: int, reserved: int) -> None:
        """
        Count a finished request's tokens; release its reservation.
        """


@dataclass(frozen=True)
class Standing:
    """
    Where a request held for a model stands, as the control plane sees it
    (L{Activator.where}): said in a waiting stream's keep-alive comments,
    and its C{eta_seconds} is the C{Retry-After} of a wait that ends
    unserved.

    @ivar words: a few words fit for a client (no node names or
        addresses), e.g. C{"waking replica r-3"}, C{"evicting a (idle
        12s) to make room"}, C{"2nd in the swap queue, behind b"}; C{""}
        when there is nothing to say.
    @ivar eta_seconds: seconds until a replica is expected ready, or
        L{None} when not known.
    """

    words: str = ""
    eta_seconds: float | None = None


class ActivationRefused(Exception):
    """
    The control plane refused a request held for a model to start: more
    requests wait for it across the fleet (the server's router and every
    router of a tier) than C{[router] activation_queue}, and this one is
    the lowest priority's newest (L{llmgw.control.held_order.refused_first}).
    The router answers it as its own full activation queue: 503
    C{activation_queue_full} with C{Retry-After}.

    @ivar model: the model the request waited for.
    """

    def __init__(self, model: str) -> None:
        super().__init__(
            f"more requests wait for model {model!r} across the fleet than it"
            " may hold; this one is of the lowest priority and the newest"
        )
        self.model = model


class NeverPlaceable(Exception):
    """
    The control plane can never place a replica of the model on the fleet
    as it is (more GPUs than any node has, more memory than any GPU has):
    the router answers at once with 503 C{model_unplaceable} naming why,
    rather than hold the request for C{activation_timeout}.

    @ivar model: the model asked for.
    @ivar why: why, in words fit for a client (profiles and counts, no node
        names or addresses).
    """

    def __init__(self, model: str, why: str) -> None:
        super().__init__(f"model {model!r} can never be placed: {why}")
        self.model = model
        self.why = why


class Activator(Protocol):
    """
    Scale from zero: the catalog's names, and a replica started on demand
    (L{llmgw.control.plane.ControlPlane}).
    """

    def resolve(self, name: str) -> str | None:
        """
        @return: the catalog model C{name} names, or L{None}.
        """

    def names(self) -> list[str]:
        """
        @return: every catalog name and alias.
        """

    def activate(self, name: str, priority: int = 1) -> Deferred[None]:
        """
        @param priority: the waiting request's priority number
            (L{llmgw.router.routing.fairness}: higher goes first; 1 is
            C{standard}).
        @return: fires once a replica of C{name} is ready, or fails with
            L{ActivationRefused} when the fleet holds more requests for it
            than its bound and this one is refused first, or at once with
            L{NeverPlaceable}; cancellable.
        """

    def touch(self, name: str) -> None:
        """
        A request for C{name} arrived or finished (the model is not idle:
        its idle time counts from the last completion).
        """

    def why_not(self, name: str) -> str:
        """
        @return: why C{name} has no ready replica, for the client, or
            C{""}.
        """

    def where(self, name: str) -> Standing:
        """
        @return: where a request held for C{name} stands now; an empty
            L{Standing} when nothing is known (or C{name} is not in the
            catalog).  Must answer at once and not raise.
        """
