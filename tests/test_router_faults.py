"""
The router and the control plane together in process (L{StubTreq}, a fake
agent, a L{Clock}), under faults: idleness counted from completions (issue
14 case 3), usage charged for streams that broke (case 9), streams of a
replica that went away ended at once (case 5).
"""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.task import Clock
from twisted.logger import Logger
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseFailed

from llmgw.control.inventory import Inventory
from llmgw.control.plane import ControlPlane
from llmgw.router.api.app import Router
from llmgw.router.interfaces import Endpoint, RequestRecord
from llmgw.router.routing.balancer import Balancer
from llmgw.router.settings import RouterConfig
from llmgw.router.telemetry.metrics import RouterMetrics
from llmgw.wire import agent_pb2 as pb
from tests.exchange_fakes import FakeAgent, FakeResponse
from tests.plane_support import SETTINGS, Agents, make_model, register_message
from tests.typing_support import collect, stub_treq

SSE = b"text/event-stream"
CHUNK = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"
FINISH = b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
STREAM = json.dumps(
    {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()


class _Records:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def record(self, record: RequestRecord) -> None:
        self.records.append(record)


class _Gateway(SynchronousTestCase):
    """
    A router whose activator and endpoints are a real control plane's, on
    one L{Clock}; the engines are a L{FakeAgent}.
    """

    def make(
        self, idle: float = 0, low: int = 0, nodes: int = 1, router_idle: float = 60
    ) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        self.agent = FakeAgent()
        self.balancer = Balancer(self.clock, 10.0)
        self.agents = Agents()
        self.inventory = Inventory()
        self.published: list[list[Endpoint]] = []

        def publish(endpoints: list[Endpoint]) -> None:
            self.published.append(endpoints)
            self.balancer.set_endpoints(endpoints)

        self.plane = ControlPlane(
            self.clock,
            self.inventory,
            self.agents,
            (make_model(low=low, idle=idle),),
            SETTINGS,
            publish,
            outstanding=self.balancer.outstanding,
            cut=self.balancer.cut,
        )
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        for node in self.nodes:
            message = register_message(node)
            self.inventory.register(message, 0.0, self.clock.seconds())
            self.plane.node_registered(node, message)
        self.sink = _Records()
        self.events: list[dict[str, Any]] = []
        self.router = Router(
            self.clock,
            self.balancer,
            self.agent,
            RouterConfig(idle_timeout=router_idle),
            RouterMetrics(CollectorRegistry()),
            self.sink,
            wall_clock=lambda: 0.0,
            activator=self.plane.catalog,
        )
        self.router.log = Logger(observer=collect(self.events))
        self.stub = stub_treq(self.router.resource())

    def post(self, body: bytes = STREAM) -> Any:
        d = self.stub.post("http://gw/v1/chat/completions", data=body)
        self.stub.flush()
        return d

    def ready_all(self) -> None:
        for node, start in self.agents.starts():
            found = self.plane.ledger.shard(start.shard_id)
            if found is not None and found[1].state == "pending":
                status = pb.ShardStatus(shard_id=start.shard_id, pid=4242)
                status.state = pb.SHARD_STATE_READY
                self.plane.shard_status(node, status)

    def tick(self, seconds: int = 1) -> None:
        for _ in range(seconds):
            self.clock.advance(1)
            for node in self.nodes:
                self.inventory.heard(node, self.clock.seconds())
            self.plane.reconcile()
            self.stub.flush()

    def serve(self) -> FakeResponse:
        """
        A stream request, its replica started and ready, its answer begun.
        """
        self.done = self.post()
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        self.stub.flush()
        response = FakeResponse(200, SSE)
        self.agent.sent[-1].answer.callback(response)
        self.stub.flush()
        return response

    def body(self) -> bytes:
        response = self.successResultOf(self.done)
        content: bytes = self.successResultOf(self.stub.content(response))
        return content


class IdleTests(_Gateway):
    def test_idle_counts_from_the_last_completion(self) -> None:
        """
        idle_timeout = 5 s, one request that starts the model from zero and
        streams for 30 s: the model scales to zero 5 to 7 s after the
        stream ended, not at once (its request arrived 30 s before).
        """
        self.make(idle=5)
        response = self.serve()
        for _ in range(30):
            response.write(CHUNK)
            self.tick()
        self.assertEqual(len(self.balancer.replicas()), 1)
        response.write(USAGE + DONE)
        response.end()
        self.stub.flush()
        self.assertIn(b"[DONE]", self.body())
        second = 0
        while self.balancer.replicas() and second < 10:
            self.tick()
            second += 1
        self.assertGreaterEqual(second, 5)
        self.assertLessEqual(second, 7)


class UsageTests(_Gateway):
    def test_broken_stream_charged_its_estimate(self) -> None:
        """
        A stream that relayed 20 chunks and then broke (the engine reset
        the connection) is recorded 200 with an error event, or 502, and
        charged its estimate: 20 completion tokens and the prompt's
        estimate, not 0/0.
        """
        self.make(low=1)
        self.plane.reconcile()
        response = self.serve()
        for _ in range(20):
            response.write(CHUNK)
        response.lose(ResponseFailed([Exception("reset")]))
        self.stub.flush()
        self.assertIn(b'"error"', self.body())
        (record,) = self.sink.records
        self.assertEqual(record.status, 502)
        self.assertTrue(record.usage_estimated)
        self.assertEqual(record.completion_tokens, 20)
        self.assertGreater(record.prompt_tokens, 0)

    def test_idle_deadline_charged_its_estimate(self) -> None:
        """
        A stream that relayed 20 chunks and then went silent past the
        router's idle deadline (60 s) ends 504 and is charged its estimate.
        """
        self.make(low=1)
        self.plane.reconcile()
        response = self.serve()
        for _ in range(20):
            response.write(CHUNK)
        self.tick(61)
        (record,) = self.sink.records
        self.assertEqual(record.status, 504)
        self.assertTrue(record.usage_estimated)
        self.assertEqual(record.completion_tokens, 20)

    def test_warn_once_per_model_without_stream_usage(self) -> None:
        """
        An engine that ends streams cleanly (a choice finished) without the
        usage the router asked for (llama-cpp-python) gets one warning for
        its model, not one per request; a stream the engine broke off is
        no such word; its usage is estimated either way.
        """
        self.make(low=1)
        self.plane.reconcile()
        # vLLM's end of a stream its dead engine broke: an error event and
        # [DONE], no choice finished: no usage, and no word on the engine.
        broken = b'data: {"error":{"message":"EngineCore encountered an issue."}}\n\n'
        warned = []
        for end in (broken, FINISH, FINISH):
            response = self.serve()
            response.write(CHUNK + end + DONE)
            response.end()
            self.stub.flush()
            self.body()
            warnings = [e for e in self.events if "sends no usage" in e["log_format"]]
            warned.append(len(warnings))
        self.assertEqual(warned, [0, 1, 1])
        self.assertEqual(warnings[0]["model"], "m")
        self.assertEqual(
            [r.usage_estimated for r in self.sink.records], [True, True, True]
        )


class CutTests(_Gateway):
    def test_stream_of_a_lost_node_ends_at_once(self) -> None:
        """
        The node of a replica with a stream in flight goes silent: when it
        is declared lost (60 s), the stream ends with an SSE error event
        then, not at the router's idle deadline (300 s); it is charged its
        estimate.
        """
        self.make(low=1, router_idle=300)
        self.plane.reconcile()
        response = self.serve()
        response.write(CHUNK)
        self.stub.flush()
        for _ in range(61):
            self.clock.advance(1)
            self.plane.reconcile()
            self.stub.flush()
        self.assertTrue(self.done.called)
        body = self.body()
        self.assertIn(b"its node was lost", body)
        event = json.loads(body.split(b"data: ")[-1])
        self.assertEqual(event["error"]["type"], "upstream_error")
        (record,) = self.sink.records
        self.assertEqual((record.status, record.completion_tokens), (502, 1))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_request_waiting_for_an_answer_goes_elsewhere(self) -> None:
        """
        A request sent to a replica whose engine then exits, before any
        byte of its answer: the cut sends it to the other replica, and the
        client gets that one's answer.
        """
        self.make(low=2, nodes=2)
        self.plane.reconcile()
        self.ready_all()
        self.plane.reconcile()
        done = self.post(
            b'{"model": "m", "max_tokens": 3, "messages": [{"role": "user"}]}'
        )
        (first,) = self.agent.sent
        replica = next(
            r
            for r in self.plane.replicas.values()
            if first.uri.startswith(f"http://10.0.0.{r.shards[0].node[-1]}:".encode())
        )
        status = pb.ShardStatus(shard_id=replica.shards[0].id, error="exited")
        status.state = pb.SHARD_STATE_FAILED
        self.plane.shard_status(replica.shards[0].node, status)
        self.plane.reconcile()
        self.stub.flush()
        self.assertTrue(first.cancelled)
        second = self.agent.sent[1]
        self.assertNotEqual(second.uri, first.uri)
        response = FakeResponse(200, b"application/json")
        second.answer.callback(response)
        response.write(b'{"usage": {"prompt_tokens": 2, "completion_tokens": 3}}')
        response.end()
        self.stub.flush()
        self.assertEqual(self.successResultOf(done).code, 200)
        (record,) = self.sink.records
        self.assertEqual((record.status, record.completion_tokens), (200, 3))
