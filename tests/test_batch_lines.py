"""
A batch's input checked line by line (L{llmgw.router.api.batch_lines}):
each bad line named by its number, code and field, in OpenAI's
C{BatchError} shape; Anthropic's C{requests} refused by their shape, their
models checked per request.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.api.batch_lines import (
    MAX_ERRORS,
    LineError,
    ModelCheck,
    anthropic_requests,
    openai_file,
    split_lines,
)

CHAT = "/v1/chat/completions"


def _line(n: int, **changes: Any) -> bytes:
    line: dict[str, Any] = {
        "custom_id": f"c{n}",
        "method": "POST",
        "url": CHAT,
        "body": {"model": "m", "messages": []},
    }
    line.update(changes)
    return json.dumps(line).encode()


def _errors(content: bytes, check: ModelCheck | None = None) -> list[tuple[Any, ...]]:
    checked = openai_file(content, CHAT)
    if check is not None:
        checked = check.openai(checked)
    return [(e["line"], e["code"], e["param"]) for e in checked.errors]


class OpenAIFileTests(SynchronousTestCase):
    def test_good_lines(self) -> None:
        """
        Good lines become requests, numbered from 1, their body kept as
        JSON text; a last line break starts no line, CRLF ends are taken.
        """
        checked = openai_file(_line(1) + b"\r\n" + _line(2) + b"\n", CHAT)
        self.assertEqual(checked.errors, [])
        self.assertEqual(
            [(r.line_no, r.custom_id, r.model, r.url) for r in checked.requests],
            [(1, "c1", "m", CHAT), (2, "c2", "m", CHAT)],
        )
        self.assertEqual(json.loads(checked.requests[0].body)["model"], "m")

    def test_each_bad_line_named(self) -> None:
        """
        Each kind of bad line is named by its number, a code and the field
        at fault; the good lines around them stay requests.
        """
        lines = [
            _line(1),
            b"{not json",
            b"[1, 2]",
            b"",
            _line(5, custom_id=""),
            _line(6, method="GET"),
            _line(7, url="/v1/embeddings"),
            _line(8, body="text"),
            _line(9, body={"messages": []}),
            _line(1),
            _line(11),
            _line(12, body={"model": "m", "messages": [], "stream": True}),
            b"[" * 100_000 + b"]" * 100_000,
        ]
        checked = openai_file(b"\n".join(lines), CHAT)
        self.assertEqual(
            [(e["line"], e["code"], e["param"]) for e in checked.errors],
            [
                (2, "invalid_json_line", None),
                (3, "invalid_json_line", None),
                (4, "invalid_json_line", None),
                (5, "missing_required_parameter", "custom_id"),
                (6, "invalid_method", "method"),
                (7, "mismatched_endpoint", "url"),
                (8, "invalid_body", "body"),
                (9, "missing_required_parameter", "body.model"),
                (10, "duplicate_custom_id", "custom_id"),
                (12, "invalid_body", "body.stream"),
                (13, "invalid_json_line", None),
            ],
        )
        self.assertEqual([r.line_no for r in checked.requests], [1, 11])
        self.assertIn("'/v1/embeddings'", checked.errors[5]["message"])
        # Not JSON: the parser's word, with where in the line.
        self.assertEqual(
            checked.errors[0]["message"],
            "This line is not valid JSON: Expecting property name enclosed in"
            " double quotes: line 1 column 2 (char 1).",
        )
        self.assertEqual(
            checked.errors[1]["message"], "This line is not a JSON object."
        )

    def test_blank_lines_at_the_end(self) -> None:
        """
        Blank lines at the end of a file (as some exporters write them)
        are no lines; a blank line between two is a bad one.
        """
        checked = openai_file(_line(1) + b"\n\r\n \n\n", CHAT)
        self.assertEqual((checked.errors, len(checked.requests)), ([], 1))
        self.assertEqual(split_lines(b"\n \n"), [])
        self.assertEqual(
            _errors(_line(1) + b"\n\n" + _line(3)), [(2, "invalid_json_line", None)]
        )

    def test_models_checked_once_each(self) -> None:
        """
        A model the key may not use, and one no one serves, name their
        lines (in order with the others); each model is asked about once.
        """
        asked: list[str] = []

        def allowed(model: str) -> bool:
            asked.append(model)
            return model != "secret"

        check = ModelCheck(allowed, lambda model: model != "gone")
        content = b"\n".join(
            [
                _line(1, body={"model": "secret"}),
                b"x",
                _line(3, body={"model": "gone"}),
                _line(4),
                _line(5, body={"model": "secret"}),
            ]
        )
        self.assertEqual(
            _errors(content, check),
            [
                (1, "model_not_allowed", "body.model"),
                (2, "invalid_json_line", None),
                (3, "model_not_found", "body.model"),
                (5, "model_not_allowed", "body.model"),
            ],
        )
        self.assertEqual(sorted(asked), ["gone", "m", "secret"])

    def test_errors_listed_up_to_a_bound(self) -> None:
        """
        A file of bad lines lists the first L{MAX_ERRORS} and counts all.
        """
        checked = openai_file(b"x\n" * (MAX_ERRORS + 5), CHAT)
        self.assertEqual(len(checked.errors), MAX_ERRORS)
        self.assertEqual(checked.bad, MAX_ERRORS + 5)
        self.assertEqual(checked.errors[-1]["line"], MAX_ERRORS)

    @given(st.lists(st.binary(max_size=40), max_size=20))
    def test_any_bytes_each_line_once(self, pieces: list[bytes]) -> None:
        """
        Whatever the bytes, every line ends as a request or an error, once.
        """
        content = b"\n".join(p.replace(b"\n", b" ") for p in pieces)
        checked = openai_file(content, CHAT)
        numbers = sorted(
            [r.line_no for r in checked.requests]
            + [int(e["line"]) for e in checked.errors]
        )
        self.assertEqual(numbers, list(range(1, len(split_lines(content)) + 1)))


class AnthropicRequestsTests(SynchronousTestCase):
    def test_shape_refused_naming_the_request(self) -> None:
        """
        A request that is not an object, a bad or reused custom_id, and
        params that are not an object refuse the batch, naming where.
        """
        params = {"model": "m", "max_tokens": 1, "messages": []}
        cases = [
            ([], "requests"),
            ("x", "requests"),
            ([1], "requests[0]"),
            ([{"custom_id": "a b", "params": params}], "requests[0].custom_id"),
            ([{"custom_id": "x" * 65, "params": params}], "requests[0].custom_id"),
            (
                [
                    {"custom_id": "a", "params": params},
                    {"custom_id": "a", "params": params},
                ],
                "requests[1].custom_id",
            ),
            ([{"custom_id": "a", "params": []}], "requests[0].params"),
            (
                [{"custom_id": "a", "params": {**params, "stream": True}}],
                "requests[0].params.stream",
            ),
        ]
        for requests, param in cases:
            with self.assertRaises(LineError) as raised:
                anthropic_requests(requests)
            self.assertEqual(raised.exception.param, param, requests)

    def test_requests_numbered(self) -> None:
        """
        Good requests are numbered from 1, for /v1/messages, their params
        the body.
        """
        params = {"model": "m", "max_tokens": 1, "messages": []}
        lines = anthropic_requests(
            [{"custom_id": "a", "params": params}, {"custom_id": "b-2", "params": {}}]
        )
        self.assertEqual(
            [(x.line_no, x.custom_id, x.model, x.url) for x in lines],
            [(1, "a", "m", "/v1/messages"), (2, "b-2", "", "/v1/messages")],
        )
        check = ModelCheck(lambda m: True, lambda m: m == "m")
        self.assertIsNone(check.error("m", "p"))
        missing = check.error("", "requests[1].params.model")
        assert missing is not None
        self.assertEqual(
            (missing.code, missing.param),
            ("missing_required_parameter", "requests[1].params.model"),
        )
