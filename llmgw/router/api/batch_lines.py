"""
A batch's input checked line by line, before the batch is made: bytes in,
requests and errors out, no I/O (the routes in
L{llmgw.router.api.batch_routes} and L{llmgw.router.api.message_batches}
call it).

OpenAI's input file is JSONL, one request a line: C{custom_id} (unique in
the file), C{method} (C{POST}), C{url} (the batch's C{endpoint}) and
C{body} (the request, with its C{model}) (OpenAI's Batch API guide, "Prepare
your batch file").  A batch whose file has a bad line is made C{failed},
each bad line named in its C{errors} as OpenAI's C{BatchError} objects
(C{code}, C{line}, C{message}, C{param}; C{openai.types.BatchError}):
docs/batches.md says why it is not a refusal.

Anthropic's Message Batches come inline: C{requests}, each C{custom_id}
(1 to 64 letters, digits, C{_} or C{-}, unique in the batch) and
C{params} (a Messages API request); Anthropic's API reference,
"Create a Message Batch".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
)
"""
The endpoints an OpenAI batch may run (C{openai.resources.batches}'
C{create}, C{endpoint}, less those the gateway does not serve).
"""

MESSAGES_URL = "/v1/messages"
"""
The path an Anthropic batch's requests run on.
"""

MAX_ERRORS = 1000
"""
The most errors a failed batch lists: the first ones, by line.
"""

CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
"""
Anthropic's pattern for a request's C{custom_id}.
"""


@dataclass(frozen=True)
class LineRequest:
    """
    One request of a batch, checked.

    @ivar line_no: 1-based.
    @ivar body: the request body, JSON text.
    """

    line_no: int
    custom_id: str
    model: str
    url: str
    body: str


@dataclass
class Checked:
    """
    What the check of a batch's input found.

    @ivar requests: the good lines, in order.
    @ivar errors: one C{BatchError} object per bad line (at most
        L{MAX_ERRORS}), in order.
    @ivar bad: how many lines were bad, all of them counted.
    """

    requests: list[LineRequest] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    bad: int = 0

    def add_error(self, line: int, error: LineError) -> None:
        """
        Count a bad line, and list it while under L{MAX_ERRORS}.
        """
        self.bad += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(error.as_batch_error(line))


class LineError(Exception):
    """
    One line is bad.

    @ivar code: OpenAI's C{BatchError.code}.
    @ivar param: the field at fault, dotted (C{body.model}), or L{None}.
    """

    def __init__(self, code: str, message: str, param: str | None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def as_batch_error(self, line: int) -> dict[str, Any]:
        """
        @return: OpenAI's C{BatchError} object for line C{line}.
        """
        return {
            "code": self.code,
            "line": line,
            "message": self.message,
            "param": self.param,
        }


STREAM_REFUSED = (
    "A batch's request cannot stream: its answer is kept whole, one JSON"
    " object; leave stream out or false."
)
"""
Why a batch's request with C{stream} on is refused.
"""


def split_lines(content: bytes) -> list[bytes]:
    """
    @return: the lines of a JSONL file, without their ends (C{\\n} or
        C{\\r\\n}); a last line break ends the last line, it does not
        start another, and blank lines at the end (as some exporters
        write them) are no lines.
    """
    lines = [line.removesuffix(b"\r") for line in content.split(b"\n")]
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def openai_file(content: bytes, endpoint: str) -> Checked:
    """
    Check the shape of every line of an OpenAI batch's input file (the
    models are L{ModelCheck}'s: this part runs off the reactor thread,
    touching nothing shared).

    @param endpoint: the batch's C{endpoint}, which every C{url} must be.
    """
    checked = Checked()
    seen: set[str] = set()
    for number, raw in enumerate(split_lines(content), start=1):
        try:
            request = openai_line(number, raw, endpoint)
            if request.custom_id in seen:
                raise LineError(
                    "duplicate_custom_id",
                    f"The custom_id {_shown(request.custom_id)} is used by an"
                    " earlier line: each request's custom_id must be unique in"
                    " the batch.",
                    "custom_id",
                )
        except LineError as error:
            checked.add_error(number, error)
            continue
        seen.add(request.custom_id)
        checked.requests.append(request)
    return checked


def openai_line(number: int, raw: bytes, endpoint: str) -> LineRequest:
    """
    @return: line C{number} of an OpenAI input file, its shape checked.
    @raise LineError: it is bad.
    """
    try:
        line = json.loads(raw)
    except ValueError as error:
        # The parser's word says where in the line (its column).
        raise LineError(
            "invalid_json_line", f"This line is not valid JSON: {error}.", None
        ) from None
    except RecursionError:
        # Nested past the parser's depth.
        line = None
    if not isinstance(line, dict):
        raise LineError("invalid_json_line", "This line is not a JSON object.", None)
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(
            "missing_required_parameter",
            "custom_id must be a non-empty string.",
            "custom_id",
        )
    if line.get("method") != "POST":
        raise LineError("invalid_method", "method must be 'POST'.", "method")
    url = line.get("url")
    if url != endpoint:
        raise LineError(
            "mismatched_endpoint",
            f"The url {_shown(url)} is not the batch's endpoint {endpoint!r}:"
            " every line of a batch must be for its endpoint.",
            "url",
        )
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "body must be a JSON object.", "body")
    if body.get("stream"):
        raise LineError("invalid_body", STREAM_REFUSED, "body.stream")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise LineError(
            "missing_required_parameter",
            "body.model must be a non-empty string.",
            "body.model",
        )
    return LineRequest(number, custom_id, model, endpoint, json.dumps(body))


def anthropic_requests(requests: object) -> list[LineRequest]:
    """
    Check the shape of an Anthropic batch's C{requests}: a bad one
    refuses the batch whole (Anthropic's create answers 400).

    @return: each request, C{line_no} its place in C{requests} from 1.
    @raise LineError: C{requests} is not a non-empty list of objects with
        a unique, valid C{custom_id} and a C{params} object (C{param}
        names C{requests[i]...}).
    """
    if not isinstance(requests, list) or not requests:
        raise LineError("invalid_request", "must be a non-empty list.", "requests")
    checked: list[LineRequest] = []
    seen: set[str] = set()
    for place, request in enumerate(requests):
        where = f"requests[{place}]"
        if not isinstance(request, dict):
            raise LineError("invalid_request", "must be an object.", where)
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
            raise LineError(
                "invalid_request",
                "must be 1 to 64 letters, digits, underscores or hyphens.",
                f"{where}.custom_id",
            )
        if custom_id in seen:
            raise LineError(
                "invalid_request",
                f"{custom_id!r} is used by an earlier request: each custom_id"
                " must be unique in the batch.",
                f"{where}.custom_id",
            )
        seen.add(custom_id)
        params = request.get("params")
        if not isinstance(params, dict):
            raise LineError("invalid_request", "must be an object.", f"{where}.params")
        if params.get("stream"):
            raise LineError("invalid_request", STREAM_REFUSED, f"{where}.params.stream")
        model = params.get("model")
        checked.append(
            LineRequest(
                place + 1,
                custom_id,
                model if isinstance(model, str) else "",
                MESSAGES_URL,
                json.dumps(params),
            )
        )
    return checked


class ModelCheck:
    """
    Whether one key may send its batch's requests to their models: each
    model asked once.

    @param allowed: whether the key may use a model (its C{models}).
    @param known: whether the gateway serves a model (a replica or the
        catalog).
    """

    def __init__(
        self, allowed: Callable[[str], bool], known: Callable[[str], bool]
    ) -> None:
        self._allowed = allowed
        self._known = known
        self._seen: dict[str, tuple[str, str] | None] = {}

    def error(self, model: str, param: str) -> LineError | None:
        """
        @return: what is wrong with C{model} (not allowed for the key, or
            served by no one), or L{None}.
        """
        if model not in self._seen:
            self._seen[model] = self._check(model)
        found = self._seen[model]
        return None if found is None else LineError(found[0], found[1], param)

    def _check(self, model: str) -> tuple[str, str] | None:
        if not model:
            return ("missing_required_parameter", "model must be a non-empty string.")
        if not self._allowed(model):
            return (
                "model_not_allowed",
                f"This API key may not use the model {_shown(model)}.",
            )
        if not self._known(model):
            return ("model_not_found", f"The model {_shown(model)} does not exist.")
        return None

    def openai(self, checked: Checked) -> Checked:
        """
        @return: C{checked} with the lines whose model is wrong moved to
            its errors (still in line order).
        """
        requests: list[LineRequest] = []
        errors = list(checked.errors)
        bad = checked.bad
        for request in checked.requests:
            error = self.error(request.model, "body.model")
            if error is None:
                requests.append(request)
                continue
            bad += 1
            errors.append(error.as_batch_error(request.line_no))
        errors.sort(key=lambda e: int(e["line"]))
        return Checked(requests, errors[:MAX_ERRORS], bad)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


__all__ = [
    "CUSTOM_ID",
    "ENDPOINTS",
    "MAX_ERRORS",
    "MESSAGES_URL",
    "Checked",
    "LineError",
    "LineRequest",
    "ModelCheck",
    "anthropic_requests",
    "openai_file",
    "openai_line",
    "split_lines",
]
