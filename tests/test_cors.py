"""
The CORS policy, pure: the headers of answers and preflights.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.edge.cors import Cors

EXPOSE = (b"access-control-expose-headers", b"X-Request-ID, Retry-After")


class CorsTests(SynchronousTestCase):
    def test_answer_headers(self) -> None:
        """
        Off: none.  C{*}: any origin, and none sent.  A list: the origin
        echoed when it is listed, only C{Vary} otherwise.
        """
        listed = Cors(("https://a.example",))
        table: list[tuple[Cors, bytes | None, list[tuple[bytes, bytes]]]] = [
            (Cors(), b"https://a.example", []),
            (
                Cors(("*",)),
                None,
                [(b"vary", b"Origin"), (b"access-control-allow-origin", b"*"), EXPOSE],
            ),
            (
                listed,
                b"https://a.example",
                [
                    (b"vary", b"Origin"),
                    (b"access-control-allow-origin", b"https://a.example"),
                    EXPOSE,
                ],
            ),
            (listed, b"https://b.example", [(b"vary", b"Origin")]),
            (listed, b"https://a.example.evil", [(b"vary", b"Origin")]),
            (listed, b"\xff", [(b"vary", b"Origin")]),
            (listed, None, [(b"vary", b"Origin")]),
        ]
        for cors, origin, expected in table:
            self.assertEqual(cors.answer_headers(origin), expected, (cors, origin))

    def test_preflight_headers(self) -> None:
        """
        The requested headers that are allowed are echoed, lower case, in
        their order; others are left out.
        """
        cors = Cors(("*",))
        for requested, allowed in [
            (None, None),
            (b"", None),
            (b"X-Evil", None),
            (
                b"Authorization, Content-Type,X-Stainless-Lang , OpenAI-Beta, x-evil",
                b"authorization, content-type, x-stainless-lang, openai-beta",
            ),
            (b"api-key,x-request-id", b"api-key, x-request-id"),
        ]:
            headers = dict(cors.preflight_headers(["POST"], requested))
            self.assertEqual(headers[b"access-control-allow-methods"], b"POST")
            self.assertEqual(headers[b"access-control-max-age"], b"600")
            self.assertEqual(
                headers.get(b"access-control-allow-headers"), allowed, requested
            )

    def test_preflight(self) -> None:
        """
        Only a preflight (with C{Access-Control-Request-Method}) from an
        allowed origin, for a method the path has, is answered.
        """
        routes = {"/v1/chat/completions": ["OPTIONS", "POST"], "/v1/models": ["GET"]}
        cors = Cors(("https://a.example",), lambda path: routes.get(path, []))
        origin = b"https://a.example"
        for path, origin_sent, method, answered in [
            ("/v1/chat/completions", origin, b"POST", True),
            ("/v1/models", origin, b"GET", True),
            ("/v1/models", origin, b"POST", False),
            ("/nowhere", origin, b"POST", False),
            ("/v1/chat/completions", b"https://b.example", b"POST", False),
            ("/v1/chat/completions", None, b"POST", False),
            ("/v1/chat/completions", origin, None, False),
        ]:
            answer = cors.preflight(path, origin_sent, method, None)
            self.assertEqual(answer is not None, answered, (path, origin_sent, method))
        answer = cors.preflight("/v1/chat/completions", origin, b"POST", None)
        assert answer is not None
        self.assertEqual(dict(answer)[b"access-control-allow-methods"], b"POST")
