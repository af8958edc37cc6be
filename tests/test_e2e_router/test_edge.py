"""
End to end: what the client side of llmgw answers to streams that end oddly,
bodies it must refuse, browsers (CORS) and Azure-style keys (issue 13, cases
1 to 5 and 11).  C{twistd -n llmgw-server} in front of a scripted engine
(L{tests.fake_upstream}), over loopback sockets.
"""

from __future__ import annotations

import json
from http.client import HTTPConnection
from urllib.parse import urlsplit

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.fake_upstream import FakeUpstream
from tests.support import Processes, http
from tests.test_e2e_router import MESSAGES, client
from tests.test_e2e_store import _Ctl

DONE = b"data: [DONE]\n\n"


def post_raw(
    url: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """
    POST C{body} to C{url} and read the whole answer, stream or not.

    @return: status, headers (lower-case names) and body.
    """
    parts = urlsplit(url)
    connection = HTTPConnection(parts.netloc, timeout=30)
    try:
        connection.request(
            "POST",
            parts.path,
            body,
            {"Content-Type": "application/json", **(headers or {})},
        )
        response = connection.getresponse()
        return (
            response.status,
            {k.lower(): v for k, v in response.getheaders()},
            response.read(),
        )
    finally:
        connection.close()


class _FakeEngine(Processes):
    """
    One server in front of a scripted engine.
    """

    timeout = 60
    config = ""

    def setUp(self) -> None:
        self.fake = FakeUpstream()
        self.addCleanup(self.fake.stop)  # type: ignore[attr-defined]
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint", f"fake={self.fake.url}=m", config=self.config
        )
        self.gateway = client(self.url)

    def stream_body(self, mode: str) -> bytes:
        status, headers, body = post_raw(
            self.url + "/v1/chat/completions",
            json.dumps(
                {"model": "m", "messages": MESSAGES, "stream": True, "mode": mode}
            ).encode(),
        )
        assert status == 200, (status, body)
        assert headers["content-type"] == "text/event-stream", headers
        return body


class StreamEndingTests(_FakeEngine, SynchronousTestCase):
    """
    A stream that completed ends with exactly one C{data: [DONE]}.
    """

    def test_done_added_after_clean_end(self) -> None:
        """
        Case 1: the replica finishes (finish_reason), then its chunked body
        ends without C{[DONE]}: the client gets one C{[DONE]} at the end,
        and the SDK's iteration ends with every chunk and no error.
        """
        body = self.stream_body("no_done")
        self.assertTrue(body.endswith(b"\n\n" + DONE), body)
        self.assertEqual(body.count(b"[DONE]"), 1)
        self.assertNotIn(b'"error"', body)
        chunks = list(
            self.gateway.chat.completions.create(
                model="m",
                messages=MESSAGES,
                stream=True,
                extra_body={"mode": "no_done"},
            )
        )
        self.assertEqual([c.choices[0].finish_reason for c in chunks], [None, "stop"])

    def test_done_without_blank_line(self) -> None:
        """
        Case 2: the replica's last line is C{data: [DONE]} without the blank
        line after it, then the connection closes: that is the end of a
        complete answer (one C{[DONE]}, whole), not an error event.
        """
        body = self.stream_body("done_no_blank")
        self.assertTrue(body.endswith(b"\n\n" + DONE), body)
        self.assertEqual(body.count(b"[DONE]"), 1)
        self.assertNotIn(b'"error"', body)
        chunks = list(
            self.gateway.chat.completions.create(
                model="m",
                messages=MESSAGES,
                stream=True,
                extra_body={"mode": "done_no_blank"},
            )
        )
        self.assertEqual([c.choices[0].finish_reason for c in chunks], [None, "stop"])
        self.assertNotIn("Traceback", self.server.output())


class RequestCheckTests(_FakeEngine, SynchronousTestCase):
    """
    Bodies llmgw cannot rely on are refused before any engine sees them;
    what it does not read passes untouched.  Without C{[cors]}, no CORS.
    """

    def test_nan_refused(self) -> None:
        """
        Case 3: C{NaN} and C{Infinity} are not JSON: 400, nothing sent;
        nor a number past a double's range, which parses to infinity (the
        body written again for a stream said C{Infinity}).
        """
        for number in (b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1E400"):
            status, headers, body = post_raw(
                self.url + "/v1/chat/completions",
                b'{"model": "m", "messages": [{"role": "user"}], "stream": true,'
                b' "stream_options": {}, "temperature": ' + number + b"}",
            )
            self.assertEqual(status, 400, body)
            self.assertEqual(headers["content-type"], "application/json")
            error = json.loads(body)["error"]
            self.assertEqual(error["type"], "invalid_request_error")
            self.assertIn(number.lstrip(b"-").decode(), error["message"])
        self.assertEqual(self.fake.received, [])
        self.assertNotIn("Traceback", self.server.output())

    def test_field_types_refused(self) -> None:
        """
        Case 4: C{messages} as a string (and the other fields llmgw reads,
        of the wrong type) is a 400 naming the param, as the SDK reports
        it; the engine gets nothing.
        """
        with self.assertRaises(openai.BadRequestError) as raised:
            self.gateway.chat.completions.create(model="m", messages="hello")  # type: ignore[arg-type]
        self.assertEqual(raised.exception.param, "messages")
        for members, param in [
            ('"messages": [{"content": "x"}]', "messages.[0].role"),
            (
                '"messages": [{"role": "user"}], "max_tokens": -1',
                "max_tokens",
            ),
            ('"messages": [{"role": "user"}], "n": true', "n"),
            ('"prompt": 3', "prompt"),
            (
                '"messages": [{"role": "user"}], "stream": "yes"',
                "stream",
            ),
        ]:
            status, _, body = post_raw(
                self.url + "/v1/chat/completions",
                ('{"model": "m", ' + members + "}").encode(),
            )
            self.assertEqual(status, 400, members)
            self.assertEqual(json.loads(body)["error"]["param"], param, members)
        self.assertEqual(self.fake.received, [])

    def test_unknown_fields_untouched(self) -> None:
        """
        Fields llmgw does not read reach the engine byte for byte.
        """
        sent = (
            b'{"model": "m", "mode": "ok", "messages": [{"role": "user",'
            b' "content": "hi", "vendor": {"x": [1.50, null]}}],'
            b' "temperature": 1e2, "repetition_penalty": 1.10}'
        )
        status, _, body = post_raw(self.url + "/v1/chat/completions", sent)
        self.assertEqual(status, 200, body)
        self.assertEqual(self.fake.received[-1][1], sent)

    def test_no_cors_by_default(self) -> None:
        """
        Without C{[cors]}: no CORS header on any answer, and a preflight is
        refused as before (405, naming the allowed method).
        """
        status, headers, _ = http(
            "OPTIONS",
            self.url + "/v1/chat/completions",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
            },
        )
        self.assertEqual(status, 405)
        self.assertEqual(headers["allow"], "POST")
        _, answer, _ = http(
            "GET", self.url + "/v1/models", headers={"Origin": "https://app.example"}
        )
        for seen in (headers, answer):
            self.assertEqual(
                [name for name in seen if name.startswith("access-control")], []
            )
            self.assertNotIn("vary", seen)


class BrowserAndKeyTests(_FakeEngine, SynchronousTestCase, _Ctl):
    """
    Keys required, and one origin allowed for scripts in web pages.
    """

    origin = "https://app.example"
    config = '[auth]\nrequire_api_key = true\n[cors]\nallow_origins = ["https://app.example"]\n'

    def test_preflight(self) -> None:
        """
        Case 5: a browser's preflight from the allowed origin is 204 without
        a key, allowing POST and the headers the OpenAI SDK sends (echoed),
        but not another header; from another origin, no CORS answer.
        """
        status, headers, body = http(
            "OPTIONS",
            self.url + "/v1/chat/completions",
            headers={
                "Origin": self.origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type,"
                "x-stainless-os,openai-organization,x-request-id,api-key,x-evil",
            },
        )
        self.assertEqual((status, body), (204, b""))
        self.assertEqual(headers["access-control-allow-origin"], self.origin)
        self.assertEqual(headers["access-control-allow-methods"], "POST")
        self.assertEqual(
            headers["access-control-allow-headers"].split(", "),
            [
                "authorization",
                "content-type",
                "x-stainless-os",
                "openai-organization",
                "x-request-id",
                "api-key",
            ],
        )
        self.assertEqual(headers["vary"], "Origin")
        status, headers, _ = http(
            "OPTIONS",
            self.url + "/v1/models",
            headers={"Origin": self.origin, "Access-Control-Request-Method": "GET"},
        )
        self.assertEqual(status, 204)
        self.assertEqual(headers["access-control-allow-methods"], "GET")
        status, headers, _ = http(
            "OPTIONS",
            self.url + "/v1/files",
            headers={"Origin": self.origin, "Access-Control-Request-Method": "POST"},
        )
        self.assertEqual(status, 204)
        self.assertEqual(headers["access-control-allow-methods"], "GET, POST")
        status, headers, _ = http(
            "OPTIONS",
            self.url + "/v1/chat/completions",
            headers={
                "Origin": "https://evil.example",
                "Access-Control-Request-Method": "POST",
            },
        )
        self.assertEqual(status, 405)
        self.assertNotIn("access-control-allow-origin", headers)

    def test_errors_readable(self) -> None:
        """
        Case 5: a 401 (no key) carries the CORS headers, so a script can
        read it, with X-Request-ID and Retry-After exposed.
        """
        status, headers, body = post_raw(
            self.url + "/v1/chat/completions",
            b'{"model": "m", "messages": [{"role": "user"}]}',
            {"Origin": self.origin},
        )
        self.assertEqual(status, 401, body)
        self.assertEqual(headers["access-control-allow-origin"], self.origin)
        self.assertEqual(
            headers["access-control-expose-headers"], "X-Request-ID, Retry-After"
        )
        self.assertEqual(headers["vary"], "Origin")

    def test_api_key_header(self) -> None:
        """
        Case 11: a key sent as C{api-key} is accepted like C{Authorization:
        Bearer}; when both come, C{Authorization} is the one checked; the
        engine gets neither.
        """
        key = self.ctl_json("keys", "create", "--name", "azure")["key"]
        chat = b'{"model": "m", "mode": "ok", "messages": [{"role": "user"}]}'
        url = self.url + "/v1/chat/completions"
        cases: list[tuple[dict[str, str], int]] = [
            ({"api-key": key}, 200),
            ({"API-Key": key}, 200),
            ({}, 401),
            ({"api-key": "sk-wrong"}, 401),
            ({"Authorization": f"Bearer {key}", "api-key": "sk-wrong"}, 200),
            ({"Authorization": "Bearer sk-wrong", "api-key": key}, 401),
        ]
        for headers, expected in cases:
            status, _, body = post_raw(url, chat, headers)
            self.assertEqual(status, expected, (headers, body))
        status, _, body = http("GET", self.url + "/v1/models", headers={"api-key": key})
        self.assertEqual(status, 200, body)
        self.assertEqual([m["id"] for m in json.loads(body)["data"]], ["m"])
        engine_headers = [
            {name.lower() for name in headers} for headers, _ in self.fake.received
        ]
        self.assertEqual(len(engine_headers), 3)
        for names in engine_headers:
            self.assertFalse(names & {"api-key", "authorization"}, names)

    def test_rate_limited(self) -> None:
        """
        A key past its requests per minute gets a 429 whose status line says
        C{Too Many Requests} (twisted.web's table has no 429: it sent
        C{Unknown Status}), with C{Retry-After} and the CORS headers.
        """
        key = self.ctl_json("keys", "create", "--name", "tight", "--rpm", "1")["key"]
        chat = b'{"model": "m", "mode": "ok", "messages": [{"role": "user"}]}'
        parts = urlsplit(self.url)
        answers = []
        for _ in range(2):
            connection = HTTPConnection(parts.netloc, timeout=30)
            try:
                connection.request(
                    "POST",
                    "/v1/chat/completions",
                    chat,
                    {
                        "Content-Type": "application/json",
                        "Authorization": f"Bearer {key}",
                        "Origin": self.origin,
                    },
                )
                response = connection.getresponse()
                response.read()
                answers.append(response)
            finally:
                connection.close()
        self.assertEqual(answers[0].status, 200)
        limited = answers[1]
        self.assertEqual((limited.status, limited.reason), (429, "Too Many Requests"))
        self.assertTrue(limited.getheader("retry-after", "").isdigit())
        self.assertEqual(limited.getheader("access-control-allow-origin"), self.origin)
