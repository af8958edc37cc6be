"""
Request preparation: bodies parsed, checked and rewritten for the engine.
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.api.prepare import (
    DEFAULT_RESERVED_COMPLETION,
    HELD_COMPLETION,
    Refused,
    estimate_prompt_tokens,
    prepare,
)

CHAT = b"/v1/chat/completions"
COMPLETIONS = b"/v1/completions"
EMBED = b"/v1/embeddings"
MISSING = "missing_required_parameter"
# Served names: "m" (a catalog model), "alias" (names "m"), "static" (a
# replica outside the catalog).
ALIASES = {"m": "m", "alias": "m"}


def knows(name: str) -> bool:
    return name in ALIASES or name == "static"


def _prepare(body: bytes, path: bytes = CHAT):  # type: ignore[no-untyped-def]
    return prepare(body, path, knows, ALIASES.get)


class RefusedTests(SynchronousTestCase):
    def test_refusals(self) -> None:
        """
        Each malformed body is refused with its status, code and param, and
        the model and stream flag read before the fault.
        """
        table: list[tuple[bytes, int, str | None, str | None, str, bool]] = [
            # body, status, code, param, model, stream
            (b"{", 400, None, None, "", False),
            (b"[" * 100_000, 400, None, None, "", False),
            (b"[1]", 400, None, None, "", False),
            (b"{}", 400, None, "model", "", False),
            (b'{"model": ""}', 400, None, "model", "", False),
            (b'{"model": 3}', 400, None, "model", "", False),
            (b'{"model": "m", "stream": "yes"}', 400, None, "stream", "m", False),
            (b'{"model": "nope"}', 404, "model_not_found", "model", "nope", False),
            (
                b'{"model": "nope", "stream": true}',
                404,
                "model_not_found",
                "model",
                "nope",
                True,
            ),
            (
                b'{"model": "alias", "stream": true, "stream_options": 1}',
                400,
                None,
                "stream_options",
                "m",
                True,
            ),
        ]
        for body, status, code, param, model, stream in table:
            with self.assertRaises(Refused) as raised:
                _prepare(body)
            refused = raised.exception
            self.assertEqual(
                (
                    refused.error.status,
                    refused.error.code,
                    refused.error.param,
                    refused.model,
                    refused.stream,
                ),
                (status, code, param, model, stream),
            )

    def test_messages(self) -> None:
        """
        The messages say what is wrong.
        """
        for body, message in [
            (b"{", "The request body is not valid JSON: "),
            (b"[" * 100_000, "The request body is nested too deeply."),
            (b"1", "The request body must be a JSON object."),
            (b"{}", "You must provide a model parameter (a string)."),
            (b'{"model":"m","stream":1}', "'stream' must be a boolean."),
        ]:
            with self.assertRaises(Refused) as raised:
                _prepare(body)
            self.assertTrue(
                raised.exception.error.message.startswith(message),
                raised.exception.error.message,
            )


class FieldCheckTests(SynchronousTestCase):
    def test_refused_fields(self) -> None:
        """
        Non-JSON numbers and fields of the wrong type are a 400 naming the
        field (OpenAI's own C{param} spelling).
        """
        table: list[tuple[bytes, str | None, str]] = [
            # the members after "model": "m", param, start of the message
            (b'"temperature": NaN', None, "The request body is not valid JSON"),
            (b'"temperature": Infinity', None, "The request body is not valid"),
            (b'"x": [-Infinity]', None, "The request body is not valid JSON"),
            (b'"temperature": 1e999', None, "The request body is not valid JSON"),
            (b'"x": [-2.5E400]', None, "The request body is not valid JSON"),
            (b'"messages": "hello"', "messages", "Invalid type for 'messages'"),
            (b'"messages": {"role": "user"}', "messages", "Invalid type for"),
            (b'"messages": ["hi"]', "messages.[0]", "Invalid type for 'messages[0]'"),
            (
                b'"messages": [{"role": "user"}, {"content": "x"}]',
                "messages.[1].role",
                "Invalid type for 'messages[1].role': expected a string,"
                " but got nothing",
            ),
            (
                b'"messages": [{"role": 1}]',
                "messages.[0].role",
                "Invalid type for 'messages[0].role'",
            ),
            (b'"prompt": 5', "prompt", "Invalid type for 'prompt'"),
            (b'"prompt": {}', "prompt", "Invalid type for 'prompt'"),
            (b'"prompt_embeds": false', "prompt_embeds", "Invalid type for 'prompt_"),
            (b'"stream": "true"', "stream", "'stream' must be a boolean."),
            (b'"stream_options": []', "stream_options", "'stream_options' must"),
            (b'"n": -1', "n", "Invalid value for 'n'"),
            # 0 is no limit to llama-cpp-python: a generation to the end of
            # its context (vLLM and OpenAI refuse it too).
            (b'"n": 0', "n", "Invalid value for 'n': expected an integer from 1"),
            (b'"max_tokens": 0', "max_tokens", "Invalid value for 'max_tokens'"),
            (b'"max_completion_tokens": 0', "max_completion_tokens", "Invalid"),
            (b'"prompt": "x", "echo": false, "max_tokens": 0', "max_tokens", "In"),
            (b'"n": 1.5', "n", "Invalid value for 'n'"),
            (b'"max_tokens": true', "max_tokens", "Invalid value for 'max_tokens'"),
            (b'"max_tokens": "5"', "max_tokens", "Invalid value for 'max_tokens'"),
            (b'"max_completion_tokens": -3', "max_completion_tokens", "Invalid"),
            # Past a signed 32-bit integer (a new user's 10**23 froze the
            # default engine for minutes).
            (b'"max_tokens": 100000000000000000000000', "max_tokens", "Invalid value"),
            (b'"max_tokens": 2147483648', "max_tokens", "Invalid value"),
            (b'"n": 4294967296', "n", "Invalid value for 'n'"),
        ]
        for members, param, message in table:
            body = b'{"model": "m", ' + members + b"}"
            with self.assertRaises(Refused, msg=members) as raised:
                _prepare(body)
            error = raised.exception.error
            self.assertEqual(
                (error.status, error.type, error.param),
                (400, "invalid_request_error", param),
                members,
            )
            self.assertTrue(error.message.startswith(message), error.message)

    def test_accepted_fields(self) -> None:
        """
        Fields of the right type, absent or null, and unknown fields pass,
        and the body goes to the engine byte for byte.
        """
        for path, members in [
            (CHAT, b'"messages": [{"role": "user", "content": 5, "x": "NaN"}]'),
            (CHAT, b'"messages": [{"role": "user"}], "prompt": null, "n": null'),
            (COMPLETIONS, b'"prompt": "", "messages": null, "max_tokens": null'),
            (COMPLETIONS, b'"prompt": "hi", "n": 1, "max_completion_tokens": 9'),
            # vLLM's prompt scoring: echo, and no token generated.
            (COMPLETIONS, b'"prompt": "hi", "echo": true, "max_tokens": 0'),
            (COMPLETIONS, b'"prompt": "hi", "max_tokens": 2147483647'),
            (COMPLETIONS, b'"prompt": ["a", [1, 2]], "stream_options": null'),
            (COMPLETIONS, b'"prompt_embeds": "AAAA", "stream": null'),
            (EMBED, b'"input": "", "vendor_field": {"nested": [true, null]}'),
            # Embeddings' input is the engine's to require: vLLM's chat
            # embeddings take messages, llama-server's content.
            (EMBED, b'"messages": [{"role": "user", "content": "x"}]'),
            (EMBED, b'"content": "x"'),
            (b"/tokenize", b'"temperature": 1e308'),
        ]:
            body = b'{"model": "m", ' + members + b"}"
            self.assertEqual(_prepare(body, path).body, body, members)

    def test_required_fields(self) -> None:
        """
        A request without the field its path cannot go without, absent or
        null (or chat's C{messages} an empty array), is OpenAI's 400 naming
        it, with its code.
        """
        for path, members, code, param, message in [
            (CHAT, b'"n": 1', MISSING, "messages", "Missing required"),
            (CHAT, b'"messages": null', MISSING, "messages", "Missing required"),
            (CHAT, b'"prompt": "hi"', MISSING, "messages", "Missing required"),
            (CHAT, b'"messages": []', "empty_array", "messages", "Invalid 'messages"),
            (COMPLETIONS, b'"messages": [{"role": "user"}]', MISSING, "prompt", "Mi"),
            (COMPLETIONS, b'"prompt": null', MISSING, "prompt", "Missing required"),
        ]:
            body = b'{"model": "alias", "stream": true, ' + members + b"}"
            with self.assertRaises(Refused, msg=members) as raised:
                _prepare(body, path)
            refused = raised.exception
            error = refused.error
            self.assertEqual(
                (error.status, error.type, error.code, error.param),
                (400, "invalid_request_error", code, param),
                members,
            )
            self.assertTrue(error.message.startswith(message), error.message)
            # Told in the stream's form, under the catalog name.
            self.assertEqual((refused.model, refused.stream), ("m", True))


class PreparedTests(SynchronousTestCase):
    def test_rewrites(self) -> None:
        """
        The body sent, the model engines see, and whether the usage chunk is
        left out, for each kind of body.
        """
        usage = b',"stream_options":{"include_usage":true}'
        # A chat's messages: every row's body has them (test_required_fields).
        said = b'"messages":[{"role":"user"}]'
        resaid = b'"messages": [{"role": "user"}]'
        table: list[tuple[bytes, bytes, bytes | None, str, bool]] = [
            # body, path, the body sent (None: unchanged), model, strip
            (b'{"model":"m",' + said + b"}", CHAT, None, "m", False),
            (b'{"model":"static",' + said + b"}", CHAT, None, "static", False),
            (b'{"model":"m","stream":null,' + said + b"}", CHAT, None, "m", False),
            (b'{"model":"m","stream":false,' + said + b"}", CHAT, None, "m", False),
            # One member more, the rest as the client wrote it.
            (
                b'{"model": "m", "stream": true,' + said + b"}  \n",
                CHAT,
                b'{"model": "m", "stream": true,' + said + usage + b"}  \n",
                "m",
                True,
            ),
            # Not a path with a usage chunk: unchanged.
            (b'{"model":"m","stream":true,"input":"x"}', EMBED, None, "m", False),
            # Asked for: unchanged, not stripped.
            (
                b'{"model":"m","stream":true,"stream_options":{"include_usage":true},'
                + said
                + b"}",
                CHAT,
                None,
                "m",
                False,
            ),
            (
                b'{"model":"alias",' + said + b"}",
                CHAT,
                b'{"model": "m", ' + resaid + b"}",
                "m",
                False,
            ),
            (
                b'{"model":"alias","stream":true,' + said + b"}",
                CHAT,
                b'{"model": "m", "stream": true, ' + resaid + b', "stream_options":'
                b' {"include_usage": true}}',
                "m",
                True,
            ),
            (
                b'{"model":"m","stream":true,"stream_options":{"x":1},' + said + b"}",
                CHAT,
                b'{"model": "m", "stream": true, "stream_options":'
                b' {"x": 1, "include_usage": true}, ' + resaid + b"}",
                "m",
                True,
            ),
            (
                b'{"model":"m","stream":true,"stream_options":null,' + said + b"}",
                CHAT,
                b'{"model": "m", "stream": true, "stream_options":'
                b' {"include_usage": true}, ' + resaid + b"}",
                "m",
                True,
            ),
            # Lone surrogates survive the rewrite, escaped.
            (
                b'{"model":"alias","prompt":"\\ud800"}',
                COMPLETIONS,
                b'{"model": "m", "prompt": "\\ud800"}',
                "m",
                False,
            ),
        ]
        for body, path, sent, model, strip in table:
            prepared = _prepare(body, path)
            self.assertEqual(prepared.body, body if sent is None else sent)
            self.assertEqual(prepared.model, model)
            self.assertEqual(prepared.requested_model, json.loads(body)["model"])
            self.assertEqual(prepared.strip_usage, strip)
            json.loads(prepared.body)

    def test_max_tokens(self) -> None:
        """
        The completion limit is the first integer of max_completion_tokens,
        max_tokens and max_output_tokens, clamped to 0..1,000,000; booleans
        are not integers.
        """
        for extra, expected in [
            ("", DEFAULT_RESERVED_COMPLETION),
            (',"max_tokens":10', 10),
            (',"max_tokens":10,"max_completion_tokens":20', 20),
            (',"max_output_tokens":30', 30),
            # max_tokens of another type, or negative, is refused
            # (FieldCheckTests); max_output_tokens is not checked.
            (',"max_output_tokens":true', DEFAULT_RESERVED_COMPLETION),
            (',"max_output_tokens":"5"', DEFAULT_RESERVED_COMPLETION),
            (',"max_output_tokens":-5', 0),
            (',"max_tokens":10000000', 1_000_000),
        ]:
            body = ('{"model":"m","prompt":"hi"' + extra + "}").encode()
            prepared = _prepare(body, COMPLETIONS)
            self.assertEqual(prepared.max_tokens, expected)
            # The hold is the ceiling up to HELD_COMPLETION, not the ceiling.
            self.assertEqual(
                prepared.reserve,
                estimate_prompt_tokens(body) + min(expected, HELD_COMPLETION),
            )

    def test_estimate(self) -> None:
        """
        About 4 bytes of request per prompt token.
        """
        self.assertEqual(
            [estimate_prompt_tokens(b"x" * n) for n in (0, 3, 4, 9)], [0, 0, 1, 2]
        )
