"""
The routes in process (L{treq.testing.StubTreq}): keys, usage records and
metrics around an exchange with a fake agent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.router.api.app import Router
from llmgw.router.errors import APIError
from llmgw.router.interfaces import Endpoint, Key, RequestRecord, Tenant
from llmgw.router.routing.balancer import Balancer
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import RouterMetrics
from tests.exchange_fakes import FakeAgent, FakeResponse
from tests.typing_support import Response, stub_treq


@dataclass(frozen=True)
class FakeKey:
    id: int
    name: str
    tenant: Tenant = Tenant("app")

    def allows(self, model: str, resolve: Callable[[str], str | None]) -> bool:
        return model != "hidden"


class FakeAuth:
    """
    One key, C{sk-good}; records what is admitted and used.
    """

    def __init__(self) -> None:
        self.key = FakeKey(7, "app")
        self.admitted: list[tuple[Sequence[str], int]] = []
        self.used_calls: list[tuple[int, int]] = []
        self.refuse: APIError | None = None

    def authenticate(self, header: bytes | None) -> Key | None:
        if header != b"Bearer sk-good":
            raise APIError(401, "no", "invalid_request_error", "invalid_api_key")
        return self.key

    def vouched(self, key_id: int | None) -> Key | None:
        if key_id != self.key.id:
            raise APIError(401, "no", "invalid_request_error", "invalid_api_key")
        return self.key

    def admit(self, key: Key, names: Sequence[str], reserve: int) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.admitted.append((tuple(names), reserve))

    def used(self, key: Key, tokens: int, reserved: int, cost: float = 0.0) -> None:
        self.used_calls.append((tokens, reserved))


class Records:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def record(self, record: RequestRecord) -> None:
        self.records.append(record)


class RouterTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.agent = FakeAgent()
        balancer = Balancer(self.clock, 10.0)
        balancer.set_endpoints(
            [Endpoint("r1", "http://a:1", ("m", "hidden"))],
        )
        self.auth = FakeAuth()
        self.sink = Records()
        self.router = Router(
            self.clock,
            balancer,
            self.agent,
            RouterConfig(),
            RouterMetrics(CollectorRegistry()),
            self.sink,
            wall_clock=lambda: 1234.5,
            auth=self.auth,
        )
        self.stub = stub_treq(self.router.resource())

    def post(self, body: bytes, key: bytes = b"sk-good") -> Deferred[Response]:
        d = self.stub.post(
            "http://gw/v1/chat/completions",
            data=body,
            headers={b"authorization": [b"Bearer " + key]},
        )
        self.stub.flush()
        return d

    def test_answer_accounted(self) -> None:
        """
        A request is admitted for its names with its reservation; its record
        has the engine's usage, the key and the replica; the key is charged
        and its reservation released.
        """
        body = b'{"model": "m", "max_tokens": 10, "messages": [{"role": "user"}]}'
        d = self.post(body)
        response = FakeResponse(200, b"application/json")
        self.agent.sent[0].answer.callback(response)
        self.clock.advance(0.5)
        response.write(b'{"usage": {"prompt_tokens": 5, "completion_tokens": 6}}')
        response.end()
        self.stub.flush()
        self.assertEqual(self.successResultOf(d).code, 200)
        reserve = len(body) // 4 + 10
        self.assertEqual(self.auth.admitted, [(("m", "m"), reserve)])
        self.assertEqual(self.auth.used_calls, [(11, reserve)])
        (record,) = self.sink.records
        self.assertEqual(
            (record.model, record.replica, record.status, record.key_id),
            ("m", "r1", 200, 7),
        )
        self.assertEqual((record.prompt_tokens, record.completion_tokens), (5, 6))
        self.assertEqual(record.latency, 0.5)
        self.assertFalse(record.usage_estimated)
        self.assertEqual(record.reserved_tokens, reserve)

    def test_drain_released_after_accounting(self) -> None:
        """
        The drain the stop waits for is released only once the last
        request's record reached the usage sink and its key was charged:
        the stop's next step, "usage flushed", runs as soon as the drain
        fires, and must find them (the record was written after the flush,
        and lost, when the drain fired first).
        """
        d = self.post(
            b'{"model": "m", "max_tokens": 10, "messages": [{"role": "user"}]}'
        )
        seen: list[tuple[int, int]] = []
        drained = self.router.drain(30.0)
        drained.addCallback(
            lambda _: seen.append((len(self.sink.records), len(self.auth.used_calls)))
        )
        response = FakeResponse(200, b"application/json")
        self.agent.sent[0].answer.callback(response)
        response.write(b"{}")
        response.end()
        self.stub.flush()
        self.successResultOf(d)
        self.successResultOf(drained)
        self.assertEqual(seen, [(1, 1)])

    def test_refused_before_sending(self) -> None:
        """
        A bad key, an unknown model or a refused admission is answered
        without sending anything, recorded with what was read, and holds
        nothing against the key.
        """
        d = self.post(b'{"model": "m", "messages": [{"role": "user"}]}', key=b"sk-bad")
        self.assertEqual(self.successResultOf(d).code, 401)
        d = self.post(b'{"model": "no\\nsuch", "stream": true}')
        self.assertEqual(self.successResultOf(d).code, 404)
        self.auth.refuse = APIError(429, "slow down", "requests", "rate_limit_exceeded")
        d = self.post(b'{"model": "m", "messages": [{"role": "user"}]}')
        self.assertEqual(self.successResultOf(d).code, 429)
        self.assertEqual(self.agent.sent, [])
        self.assertEqual(
            [(r.status, r.model, r.stream, r.key_id) for r in self.sink.records],
            [(401, "", False, None), (404, "no\\nsuch", True, 7), (429, "m", False, 7)],
        )
        self.assertEqual(self.auth.used_calls, [(0, 0), (0, 0)])
        self.assertEqual([r.reserved_tokens for r in self.sink.records], [0, 0, 0])

    def test_models_by_key(self) -> None:
        """
        The model list shows what the key may use, created at the injected
        wall clock's time.
        """
        d = self.stub.get(
            "http://gw/v1/models", headers={b"authorization": [b"Bearer sk-good"]}
        )
        self.stub.flush()
        body = json.loads(
            self.successResultOf(self.stub.content(self.successResultOf(d)))
        )
        self.assertEqual([(m["id"], m["created"]) for m in body["data"]], [("m", 1234)])
