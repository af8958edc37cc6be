"""
L{llmgw.router.errors.engine_failure}: which engine 5xx answers are error
objects to pass on, and which are broken answers (a 502).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.errors import engine_failure

JSON = b"application/json"


class EngineFailureTests(SynchronousTestCase):
    def test_openai_shape(self) -> None:
        """
        OpenAI's shape: status, message, type, string code, param and
        Retry-After kept.
        """
        error = engine_failure(
            500,
            b"application/json; charset=utf-8",
            b'{"error": {"message": "boom", "type": "server_error",'
            b' "param": "messages", "code": "oom"}}',
            4,
        )
        assert error is not None
        self.assertEqual(
            (error.status, error.message, error.type, error.code, error.param),
            (500, "boom", "server_error", "oom", "messages"),
        )
        self.assertEqual(error.retry_after, 4)

    def test_vllm_shapes(self) -> None:
        """
        vLLM's nested error with an integer code, and older vLLM's top-level
        C{object: error}: the integer code dropped (OpenAI's is a string).
        """
        nested = engine_failure(
            500,
            JSON,
            b'{"error": {"message": "m", "type": "InternalServerError", "code": 500}}',
            None,
        )
        top = engine_failure(
            504,
            JSON,
            b'{"object": "error", "message": "m2", "type": "Timeout", "code": 504}',
            None,
        )
        assert nested is not None and top is not None
        self.assertEqual(
            (nested.message, nested.type, nested.code),
            ("m", "InternalServerError", None),
        )
        self.assertEqual((top.status, top.message, top.type), (504, "m2", "Timeout"))

    def test_defaults_and_traceback(self) -> None:
        """
        Without a type, C{server_error}; an empty message or one holding a
        traceback becomes a plain sentence naming the status.
        """
        plain = engine_failure(500, JSON, b'{"error": {"message": "x"}}', None)
        assert plain is not None
        self.assertEqual(plain.type, "server_error")
        for body in (
            b'{"error": {"message": ""}}',
            b'{"error": {"message": "Traceback (most recent call last):\\n  File"}}',
            # pydantic's validation error, as llama-cpp-python's server
            # answers "messages": null: a frame without the header.
            b'{"error": {"message": "1 validation error: {\'type\': \'list_type\'}'
            b'\\n\\nFile \\"/venv/lib/python3.11/site-packages/llama_cpp/server/'
            b'app.py\\", line 376, in create_chat_completion"}}',
        ):
            error = engine_failure(500, JSON, body, None)
            assert error is not None
            self.assertEqual(
                error.message, "The replica failed the request with status 500."
            )

    def test_broken_answers(self) -> None:
        """
        Not JSON, not labelled JSON, JSON of another shape, an error
        without a string message: L{None} (the caller's 502).
        """
        for content_type, body in (
            (b"text/plain", b"Internal Server Error"),
            (b"text/html", b'{"error": {"message": "x"}}'),
            (b"", b'{"error": {"message": "x"}}'),
            (JSON, b"<html>500</html>"),
            (JSON, b'["error"]'),
            (JSON, b'{"detail": "x"}'),
            (JSON, b'{"error": "x"}'),
            (JSON, b'{"error": {"message": 3}}'),
            (JSON, b'{"object": "list", "message": "x"}'),
        ):
            self.assertIsNone(engine_failure(500, content_type, body, None), body)

    @given(st.binary(max_size=300), st.sampled_from([JSON, b"text/plain", b""]))
    def test_any_bytes(self, body: bytes, content_type: bytes) -> None:
        """
        Any answer gives L{None} or an error of the engine's status with a
        message of at most 1,000 characters; nothing raises.
        """
        error = engine_failure(502, content_type, body, None)
        if error is not None:
            self.assertEqual(error.status, 502)
            self.assertLessEqual(len(error.message), 1000)
            self.assertTrue(error.message)
