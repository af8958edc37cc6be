"""
The Files API's upload: the body's limit by route (L{make_site}'s
C{uploads}: a file's upload may pass C{max_body_size} up to its own
limit, every other request may not), over a real edge connection on a
L{Clock}; the C{multipart/form-data} form read from the spooled body
(L{llmgw.router.api.uploads}), as the C{openai} SDK's HTTP client builds it,
read one byte at a time too; and the results of an Anthropic batch
(L{llmgw.router.api.batch_shapes}).
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from typing import Any

import httpx2
from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource
from twisted.web.test.requesthelper import DummyChannel

from llmgw.router.api.batch_api import upload_paths
from llmgw.router.api.batch_shapes import results_jsonl
from llmgw.router.api.uploads import FormError, read_upload
from llmgw.router.batch_interfaces import KeptLine
from llmgw.router.edge.site import make_site
from llmgw.router.settings import RouterConfig


class _Sizes(Resource):
    """
    Answers each request with its body's size, or C{too large}.
    """

    isLeaf = True

    def render(self, request: IRequest) -> bytes:
        if getattr(request, "body_too_large", False):
            return b"too large"
        assert request.content is not None
        return b"%d" % len(request.content.read())


def _http(method: bytes, path: bytes, body: bytes, chunked: bool = False) -> bytes:
    head = b"%s %s HTTP/1.1\r\nHost: x\r\n" % (method, path)
    if not chunked:
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    return head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        len(body),
        body,
    )


class UploadLimitTests(SynchronousTestCase):
    def answer(self, request: bytes) -> bytes:
        settings = replace(RouterConfig(), max_body_size=100)
        site = make_site(_Sizes(), settings, Clock(), uploads=upload_paths(1000))
        protocol = site.buildProtocol(IPv4Address("TCP", "10.0.0.1", 40000))
        assert protocol is not None
        transport = StringTransport()
        protocol.makeConnection(transport)
        protocol.dataReceived(request)
        answered: bytes = transport.value()
        return answered.partition(b"\r\n\r\n")[2]

    def test_upload_route_has_its_own_limit(self) -> None:
        """
        A POST to /v1/files or /v1/messages/batches takes a body past
        max_body_size up to the upload limit, by length or chunked; past
        it, it is too large.
        """
        for path in (b"/v1/files", b"/v1/files?x=1", b"/v1/messages/batches"):
            for chunked in (False, True):
                self.assertEqual(
                    self.answer(_http(b"POST", path, b"x" * 900, chunked)), b"900"
                )
                self.assertEqual(
                    self.answer(_http(b"POST", path, b"x" * 1001, chunked)),
                    b"too large",
                )

    def test_other_routes_keep_max_body_size(self) -> None:
        """
        Any other route, and another method on the upload's path, keep
        max_body_size.
        """
        for method, path in (
            (b"POST", b"/v1/chat/completions"),
            (b"POST", b"/v1/files/x"),
            (b"POST", b"/v1/batches"),
            (b"PUT", b"/v1/files"),
        ):
            self.assertEqual(
                self.answer(_http(method, path, b"x" * 101)), b"too large", path
            )
            self.assertEqual(self.answer(_http(method, path, b"x" * 100)), b"100")


class _Trickle(io.BytesIO):
    """
    A body read back one byte at a time, whatever is asked.
    """

    def read(self, size: int | None = -1) -> bytes:
        return super().read(1)


def _form(content: bytes, **fields: str) -> tuple[bytes, bytes]:
    request = httpx2.Request(
        "POST",
        "http://x/v1/files",
        data=fields,
        files={"file": ("in.jsonl", content, "application/jsonl")},
    )
    return request.read(), request.headers["content-type"].encode()


class ReadUploadTests(SynchronousTestCase):
    def test_sdk_form(self) -> None:
        """
        The form the SDK's client sends is read whole: the file's name and
        bytes, and the purpose; read a byte at a time too.
        """
        content = b'{"a": 1}\r\n--\x00\xff' * 1000
        body, kind = _form(content, purpose="batch")
        for stream in (io.BytesIO(body), _Trickle(body)):
            upload = read_upload(stream, kind)
            self.assertEqual(upload.fields, {"purpose": "batch"})
            self.assertEqual((upload.filename, upload.content), ("in.jsonl", content))

    def test_refused(self) -> None:
        """
        Not a form, a form cut short, a form without its file, and a text
        field too long: each one FormError.
        """
        body, kind = _form(b"x", purpose="batch")
        no_file = (
            b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
            b"batch\r\n--b--\r\n"
        )
        cases: list[tuple[bytes, Any]] = [
            (body, b"application/json"),
            (body, b"multipart/form-data"),
            (body[: len(body) // 2], kind),
            (b"", kind),
            _form(b"x", purpose="b" * 70_000),
            (no_file, b"multipart/form-data; boundary=b"),
        ]
        for data, content_type in cases:
            with self.assertRaises(FormError):
                read_upload(io.BytesIO(data), content_type)


class ResultsTests(SynchronousTestCase):
    def test_each_ended_line_once(self) -> None:
        """
        An Anthropic batch's results give each ended request once, by its
        custom_id: succeeded with its Message, errored with an error
        response (the engine's, or one made of an OpenAI error), canceled,
        expired; a request not ended is left out.
        """
        message = {"id": "msg_1", "type": "message", "content": []}
        error = {"type": "error", "error": {"type": "not_found_error", "message": "m"}}
        lines = [
            KeptLine(
                "b",
                1,
                "a",
                "m",
                "/v1/messages",
                "{}",
                "done",
                result=json.dumps(message),
            ),
            KeptLine(
                "b",
                2,
                "b",
                "m",
                "/v1/messages",
                "{}",
                "failed",
                status_code=404,
                result=json.dumps(error),
            ),
            KeptLine(
                "b",
                3,
                "c",
                "m",
                "/v1/messages",
                "{}",
                "failed",
                status_code=500,
                result='{"error": {"message": "boom"}}',
            ),
            KeptLine("b", 4, "d", "m", "/v1/messages", "{}", "cancelled"),
            KeptLine("b", 5, "e", "m", "/v1/messages", "{}", "expired"),
            KeptLine("b", 6, "f", "m", "/v1/messages", "{}", "running"),
        ]
        results = [json.loads(x) for x in results_jsonl(lines).splitlines()]
        self.assertEqual(
            results,
            [
                {"custom_id": "a", "result": {"type": "succeeded", "message": message}},
                {"custom_id": "b", "result": {"type": "errored", "error": error}},
                {
                    "custom_id": "c",
                    "result": {
                        "type": "errored",
                        "error": {
                            "type": "error",
                            "error": {"type": "api_error", "message": "boom"},
                        },
                    },
                },
                {"custom_id": "d", "result": {"type": "canceled"}},
                {"custom_id": "e", "result": {"type": "expired"}},
            ],
        )


class _Stream:
    """
    Stands in for an HTTP/2 stream, the request's channel: it has the
    method and path once the headers came.
    """

    def __init__(self, command: bytes, path: bytes) -> None:
        self.command = command
        self.path = path


class StreamLimitTests(SynchronousTestCase):
    def test_limit_from_the_stream(self) -> None:
        """
        Over HTTP/2 (no request line for the channel to tell), the limit is
        read from the stream: an upload's path has its own, another path
        max_body_size.
        """
        settings = replace(RouterConfig(), max_body_size=100)
        site = make_site(_Sizes(), settings, Clock(), uploads=upload_paths(1000))
        for path, limit in ((b"/v1/files", 1000), (b"/v1/chat/completions", 100)):
            request: Any = site.requestFactory(DummyChannel(), queued=False)
            request.channel = _Stream(b"POST", path)
            self.assertEqual(request.body_limit(), limit)
            request.gotLength(limit + 1)
            self.assertTrue(request.body_too_large)
