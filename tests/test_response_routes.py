"""
The Responses API's stored responses through the router's routes, in
process (L{treq.testing.StubTreq}): read, listed a page at a time and
deleted by the key that made them only, every other case OpenAI's error
shape naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.api.app import Router
from llmgw.router.api.response_routes import item_with_id
from llmgw.router.errors import APIError
from llmgw.router.interfaces import KeptResponse, Key
from llmgw.router.routing.balancer import Balancer
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import RouterMetrics
from tests.exchange_fakes import FakeAgent
from tests.test_router import FakeAuth, FakeKey, Records
from tests.typing_support import TypedStubTreq, stub_treq


class TwoKeys(FakeAuth):
    """
    C{sk-good} (key 7) and C{sk-other} (key 8).
    """

    def authenticate(self, header: bytes | None) -> Key | None:
        if header == b"Bearer sk-other":
            return FakeKey(8, "other")
        return super().authenticate(header)


class MemoryResponses:
    """
    A L{llmgw.router.interfaces.ResponseStore} in a dict.
    """

    def __init__(self) -> None:
        self.rows: dict[str, KeptResponse] = {}

    def put(self, state: KeptResponse) -> Deferred[None]:
        self.rows[state.id] = state
        return succeed(None)

    def get(
        self, response_id: str, key_id: int | None
    ) -> Deferred[KeptResponse | None]:
        row = self.rows.get(response_id)
        return succeed(row if row is not None and row.key_id == key_id else None)

    def delete(self, response_id: str, key_id: int | None) -> Deferred[bool]:
        row = self.rows.get(response_id)
        if row is None or row.key_id != key_id:
            return succeed(False)
        del self.rows[response_id]
        return succeed(True)


INPUT: list[dict[str, Any]] = [
    {"role": "developer", "content": "Be brief."},
    {"type": "message", "role": "user", "content": "Say hi"},
    {"type": "message", "role": "assistant", "content": "Hi"},
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "f",
        "arguments": "{}",
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
]

STATE = KeptResponse(
    id="resp_abc",
    key_id=7,
    model="m",
    created_at=1000.0,
    previous_response_id=None,
    input_items=INPUT,
    output_items=[{"type": "message", "id": "msg_out", "role": "assistant"}],
    response={"id": "resp_abc", "object": "response", "status": "completed"},
)


class ResponseRoutesTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.responses = MemoryResponses()
        self.responses.put(STATE)
        self.stub = self.router(self.responses)

    def router(self, responses: MemoryResponses | None) -> TypedStubTreq:
        clock = Clock()
        router = Router(
            clock,
            Balancer(clock, 10.0),
            FakeAgent(),
            RouterConfig(),
            RouterMetrics(CollectorRegistry()),
            Records(),
            wall_clock=lambda: 0.0,
            auth=TwoKeys(),
            responses=responses,
        )
        return stub_treq(router.resource())

    def call(
        self,
        method: str,
        path: str,
        key: bytes = b"sk-good",
        stub: TypedStubTreq | None = None,
    ) -> tuple[int, Any]:
        stub = stub or self.stub
        d = stub.request(
            method,
            "http://gw" + path,
            headers={b"authorization": [b"Bearer " + key]},
        )
        stub.flush()
        response = self.successResultOf(d)
        self.assertEqual(
            response.headers.getRawHeaders(b"content-type"), [b"application/json"]
        )
        body = self.successResultOf(stub.content(response))
        return response.code, json.loads(body)

    def assertNotFound(self, answer: tuple[int, Any], rid: str) -> None:
        self.assertEqual(
            answer,
            (
                404,
                {
                    "error": {
                        "message": f"Response with id {rid!r} not found.",
                        "type": "invalid_request_error",
                        "param": "response_id",
                        "code": None,
                    }
                },
            ),
        )

    def test_retrieve_own_only(self) -> None:
        """
        The key that made a response reads its Response object as it was
        returned; another key, and an unknown id, get the same 404; a
        wrong key is a 401.
        """
        self.assertEqual(
            self.call("GET", "/v1/responses/resp_abc"), (200, STATE.response)
        )
        self.assertNotFound(
            self.call("GET", "/v1/responses/resp_abc", b"sk-other"), "resp_abc"
        )
        self.assertNotFound(self.call("GET", "/v1/responses/resp_nope"), "resp_nope")
        code, body = self.call("GET", "/v1/responses/resp_abc", b"sk-bad")
        self.assertEqual((code, body["error"]["code"]), (401, "invalid_api_key"))

    def test_delete_own_only(self) -> None:
        """
        Another key cannot delete a response (404, and it stays); its own
        key deletes it once, after which it is unknown.
        """
        self.assertNotFound(
            self.call("DELETE", "/v1/responses/resp_abc", b"sk-other"), "resp_abc"
        )
        self.assertIn("resp_abc", self.responses.rows)
        self.assertEqual(
            self.call("DELETE", "/v1/responses/resp_abc"),
            (200, {"id": "resp_abc", "object": "response", "deleted": True}),
        )
        self.assertNotFound(self.call("DELETE", "/v1/responses/resp_abc"), "resp_abc")
        self.assertNotFound(self.call("GET", "/v1/responses/resp_abc"), "resp_abc")

    def test_input_items_newest_first(self) -> None:
        """
        By default the items come last first, each with an id and a type,
        a message's string content as one part.
        """
        code, body = self.call("GET", "/v1/responses/resp_abc/input_items")
        self.assertEqual(code, 200)
        ids = [item["id"] for item in body["data"]]
        self.assertEqual(
            ids, ["item_abc_4", "fc_1", "msg_abc_2", "msg_abc_1", "msg_abc_0"]
        )
        self.assertEqual(
            (body["object"], body["first_id"], body["last_id"], body["has_more"]),
            ("list", "item_abc_4", "msg_abc_0", False),
        )
        first = body["data"][-1]
        self.assertEqual(
            (first["type"], first["role"], first["content"]),
            ("message", "developer", [{"type": "input_text", "text": "Be brief."}]),
        )
        self.assertEqual(
            body["data"][2]["content"], [{"type": "output_text", "text": "Hi"}]
        )

    def test_input_items_pages(self) -> None:
        """
        C{limit}, C{order=asc} and C{after} page through the items in the
        order the model saw them, C{has_more} false on the last page.
        """
        pages = []
        after = ""
        for _ in range(5):
            code, body = self.call(
                "GET", f"/v1/responses/resp_abc/input_items?order=asc&limit=2{after}"
            )
            self.assertEqual(code, 200)
            pages.append(([i["id"] for i in body["data"]], body["has_more"]))
            if not body["has_more"]:
                break
            after = f"&after={body['last_id']}"
        self.assertEqual(
            pages,
            [
                (["msg_abc_0", "msg_abc_1"], True),
                (["msg_abc_2", "fc_1"], True),
                (["item_abc_4"], False),
            ],
        )

    def test_input_items_refused(self) -> None:
        """
        A bad C{limit}, C{order} or C{after} is a 400 naming it; another
        key's response is a 404, as an unknown one.
        """
        for query, param in [
            ("limit=0", "limit"),
            ("limit=101", "limit"),
            ("limit=ten", "limit"),
            ("order=up", "order"),
            ("after=msg_nope", "after"),
        ]:
            code, body = self.call("GET", f"/v1/responses/resp_abc/input_items?{query}")
            self.assertEqual((code, body["error"]["param"]), (400, param), query)
        self.assertNotFound(
            self.call("GET", "/v1/responses/resp_abc/input_items", b"sk-other"),
            "resp_abc",
        )

    def test_no_store(self) -> None:
        """
        A router given no store knows no response.
        """
        stub = self.router(None)
        self.assertNotFound(
            self.call("GET", "/v1/responses/resp_abc", stub=stub), "resp_abc"
        )
        self.assertNotFound(
            self.call("DELETE", "/v1/responses/resp_abc", stub=stub), "resp_abc"
        )


class ItemIdTests(SynchronousTestCase):
    def test_item_kept(self) -> None:
        """
        An item that has an id and parts is listed as it is, and the
        stored item is not changed.
        """
        item = {"type": "message", "id": "msg_x", "role": "user", "content": []}
        self.assertEqual(item_with_id(item, "resp_1", 0), item)
        easy = {"role": "user", "content": "hi"}
        self.assertEqual(item_with_id(easy, "resp_1", 3)["id"], "msg_1_3")
        self.assertEqual(easy, {"role": "user", "content": "hi"})

    def test_error_shape(self) -> None:
        """
        The 404's body is OpenAI's error object.
        """
        from llmgw.router.api.response_routes import not_found

        error = not_found("resp_" + "x" * 300)
        self.assertIsInstance(error, APIError)
        self.assertLess(len(error.message), 260)
