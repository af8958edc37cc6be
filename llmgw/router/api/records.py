"""
The record of one finished request (L{RequestRecord}), built from what its
exchange saw: the engine's usage when it came, else the router's estimate.
"""

from __future__ import annotations

from llmgw.router.api.exchange import Exchange
from llmgw.router.edge.site import RequestIds
from llmgw.router.interfaces import Key, RequestRecord
from llmgw.router.upstream.sse import engine_count


def loggable(text: str, limit: int = 200) -> str:
    """
    @return: C{text} safe for a log line: at most C{limit} characters,
        control characters and lone surrogates escaped.
    """
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        try:
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:
            pass
    return text.encode("unicode_escape").decode("ascii")


def _began(exchange: Exchange) -> bool:
    """
    @return: whether the replica began a successful answer (the engine
        took the request and did work) before the exchange ended.
    """
    status = exchange.answer_status
    return status is not None and 200 <= status < 300


def request_record(
    ids: RequestIds,
    started: float,
    now: float,
    status: int,
    model: str,
    known: bool,
    stream: bool,
    key: Key | None,
    reserved: int,
    exchange: Exchange | None,
) -> RequestRecord:
    """
    @param ids: the request's ids: its record is keyed by llmgw's own, the
        client's kept beside it.
    @param started: clock time of the request's receipt, seconds.
    @param now: clock time of its end.
    @param status: the status answered (499: the client left).
    @param model: the model name, as far as it was read.
    @param known: whether C{model} is a name served (else it goes to the
        record cut short and escaped).
    @param key: the request's key, or L{None}.
    @param reserved: the tokens held for it against its key.
    @param exchange: its trip to the replicas, or L{None} when it was
        refused before one.
    """
    prompt, completion, estimated = _tokens(exchange, status)
    replica = exchange.replica if exchange is not None else None
    first_byte_at = exchange.first_byte_at if exchange is not None else None
    upstream_id = exchange.upstream_id if exchange is not None else ids.upstream
    return RequestRecord(
        request_id=ids.own.decode("ascii"),
        client_request_id=(
            ids.client.decode("ascii") if ids.client is not None else None
        ),
        upstream_request_id=upstream_id.decode("ascii"),
        # A name no replica serves came from the client: it goes to
        # logs cut short and escaped (it could be 32 MiB, or hold
        # newlines and lone surrogates).
        model=model if known else loggable(model),
        replica=replica.id if replica is not None else None,
        status=status,
        stream=stream,
        prompt_tokens=prompt or 0,
        completion_tokens=completion or 0,
        latency=now - started,
        time_to_first_token=(
            first_byte_at - started if first_byte_at is not None else None
        ),
        key_id=key.id if key is not None else None,
        key_name=key.name if key is not None else None,
        usage_estimated=estimated,
        reserved_tokens=reserved,
        candidates=exchange.candidates if exchange is not None else None,
        batch_id=ids.batch,
        gpu_seconds=exchange.gpu.gpu_seconds if exchange is not None else 0.0,
        cost=exchange.gpu.cost if exchange is not None else 0.0,
    )


POOLING_PATHS = frozenset((b"/v1/embeddings", b"/v1/rerank", b"/v1/score"))
"""
The engine paths whose answers are a pooling model's (vectors, scores):
no completion tokens.
"""


def _tokens(
    exchange: Exchange | None, status: int
) -> tuple[int | None, int | None, bool]:
    """
    @return: the request's prompt and completion tokens, the engine's
        count or the estimate, and whether they are the estimate.
    """
    usage = (exchange.usage if exchange is not None else None) or {}
    # Chat and completions name them so; the Responses API input and
    # output.
    prompt = engine_count(usage.get("prompt_tokens", usage.get("input_tokens")))
    completion = engine_count(
        usage.get("completion_tokens", usage.get("output_tokens"))
    )
    if (
        exchange is not None
        and exchange.path in POOLING_PATHS
        and "completion_tokens" not in usage
    ):
        # A pooling answer generates nothing, and may say so by naming
        # no completion count: OpenAI's embeddings usage is
        # prompt_tokens and total_tokens only (llama.cpp's server sends
        # that), and so is vLLM's rerank usage (its RerankUsage).
        completion = 0
    # A count that is no count is not believed (engine_count).
    counted = exchange is not None and exchange.usage is not None
    believed = not counted or (prompt is not None and completion is not None)
    estimated = False
    replica = exchange.replica if exchange is not None else None
    if (
        exchange is not None
        and (exchange.usage is None or not believed)
        and replica is not None
        and (status in (200, 499) or _began(exchange))
        and exchange.prepared.body
    ):
        # The engine's count never came (the client left mid-stream,
        # the stream broke, or the engine sends none): estimated,
        # whatever the status, so that neither leaving early nor a
        # fault is free.  One token per event relayed.
        estimated = True
        prompt = exchange.prepared.estimate
        completion = exchange.events_relayed
    return prompt, completion, estimated
