"""
L{llmgw.router.routing.adapters}: one load per replica and adapter however many
requests wait, the least recently used idle adapter unloaded past
C{max_loras}, a refused load answered with the engine's own error, and the
balancer's narrowing to the replicas that have an adapter within the load
bound.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IResponse

from llmgw.router.interfaces import Endpoint
from llmgw.router.routing.adapters import LOAD_PATH, UNLOAD_PATH, AdapterLoads
from llmgw.router.routing.balancer import Replica
from llmgw.router.upstream.base import BodyReader
from tests.exchange_fakes import FakeAgent, FakeResponse

URL = "http://127.0.0.1:20001"
ADAPTERS = (("a", "/ad/a"), ("b", "/ad/b"), ("c", "/ad/c"), ("d", "/ad/d"))


def replica(
    name: str = "r1",
    max_loras: int = 2,
    url: str = URL,
    adapters: tuple[tuple[str, str], ...] = ADAPTERS,
) -> Replica:
    return Replica(
        Endpoint(
            name,
            url,
            ("base", *(n for n, _ in adapters)),
            adapters=adapters,
            max_loras=max_loras,
        )
    )


def listing(*adapters: str) -> bytes:
    """
    @return: a C{GET /v1/models} answer as vLLM's: the base model, then
        each adapter loaded with its C{parent} and C{root}.
    """
    cards: list[dict[str, Any]] = [{"id": "base", "object": "model", "parent": None}]
    cards += [
        {"id": a, "object": "model", "parent": "base", "root": f"/ad/{a}"}
        for a in adapters
    ]
    return json.dumps({"object": "list", "data": cards}).encode()


class _LoadsCase(SynchronousTestCase):
    """
    An L{AdapterLoads} on a fake engine client and a fake clock.
    """

    def setUp(self) -> None:
        self.agent = FakeAgent()
        self.clock = Clock()
        self.loads = AdapterLoads(self.agent, clock=self.clock)
        self.outcomes: list[tuple[str, str]] = []
        self.loads.count = lambda a, o: self.outcomes.append((a, o))

    def answer(self, index: int, code: int = 200, body: bytes = b"ok") -> None:
        response = FakeResponse(code, b"text/plain")
        self.agent.sent[index].answer.callback(response)
        if response.protocol is not None:  # read: a load's or an unload's
            response.write(body)
            response.end()

    def paths(self) -> list[tuple[str, str]]:
        return [
            (
                s.uri.decode().removeprefix(URL),
                json.loads(s.body or b"{}").get("lora_name", ""),
            )
            for s in self.agent.sent
        ]

    def use(self, r: Replica, model: str) -> list[Any]:
        """
        One request for C{model} through to its answer, ended.
        """
        got: list[Any] = []
        self.loads.post(r, model, b"/v1/chat/completions", [], b"{}").addBoth(
            got.append
        )
        for i, sent in enumerate(self.agent.sent):
            if not sent.answer.called:
                self.answer(i)
        self.loads.finished(r.endpoint.id, model)
        return got


class AdapterLoadTests(_LoadsCase):
    def test_one_load_for_waiting_requests(self) -> None:
        """
        Two requests for an adapter not loaded: one load, then both sent.
        """
        r = replica()
        got: list[IResponse] = []
        for _ in range(2):
            d = self.loads.post(r, "a", b"/v1/chat/completions", [], b"{}")
            d.addCallback(got.append)
        self.assertEqual(self.paths(), [("/v1/load_lora_adapter", "a")])
        self.assertEqual(
            json.loads(self.agent.sent[0].body),
            {"lora_name": "a", "lora_path": "/ad/a"},
        )
        self.answer(0)
        self.assertEqual([p for p, _ in self.paths()].count("/v1/chat/completions"), 2)
        self.assertEqual(self.loads.loaded("r1"), ["a"])
        self.assertEqual(self.outcomes, [("a", "loaded")])

    def test_least_recently_used_idle_unloaded(self) -> None:
        """
        C{max_loras = 2}: a, b, a, then c unloads b; then c (left in
        flight), a, and d: a is unloaded, not c, the least recently used
        but in use.
        """
        r = replica()
        for model in ("a", "b", "a", "c"):
            self.use(r, model)
        self.assertIn((UNLOAD_PATH.decode(), "b"), self.paths())
        self.assertEqual(self.loads.loaded("r1"), ["a", "c"])
        self.loads.post(r, "c", b"/v1/chat/completions", [], b"{}")
        self.answer(len(self.agent.sent) - 1)
        self.use(r, "a")  # c, in flight, is now the least recently used
        self.use(r, "d")
        unloads = [n for p, n in self.paths() if p == UNLOAD_PATH.decode()]
        self.assertEqual(unloads, ["b", "a"])
        self.assertEqual(self.loads.loaded("r1"), ["c", "d"])

    def test_already_loaded_counts(self) -> None:
        """
        An engine that has it already (another router loaded it) counts
        as having it.
        """
        r = replica()
        self.loads.post(r, "a", b"/v1/chat/completions", [], b"{}")
        self.answer(
            0, 400, b'{"error": "The lora adapter \'a\' has already been loaded."}'
        )
        self.assertEqual(self.loads.loaded("r1"), ["a"])
        self.assertEqual(self.paths()[1][0], "/v1/chat/completions")

    def test_refused_load_answers_engine_error(self) -> None:
        """
        A load the engine refuses: the request gets the engine's answer,
        status and body; nothing else is sent (the next try waits for its
        back-off: L{BackoffTests}).
        """
        r = replica()
        got: list[Any] = []
        self.loads.post(r, "a", b"/v1/chat/completions", [], b"{}").addBoth(got.append)
        body = b'{"error": {"message": "Loading lora a failed: No adapter found"}}'
        self.answer(0, 404, body)
        (response,) = got
        self.assertEqual(response.code, 404)
        chunks: list[bytes] = []
        reader = BodyReader(chunks.append)
        response.deliverBody(reader)
        self.assertEqual(b"".join(chunks), body)
        self.assertEqual(len(self.agent.sent), 1)
        self.assertEqual(self.loads.loaded("r1"), [])
        self.assertEqual(self.outcomes, [("a", "failed")])

    def test_not_an_adapter_passes(self) -> None:
        """
        The base model's requests go straight to the replica.
        """
        self.loads.post(replica(), "base", b"/v1/chat/completions", [], b"{}")
        self.assertEqual(self.paths(), [("/v1/chat/completions", "")])

    def test_narrow_within_bound(self) -> None:
        """
        The replica that has the adapter while within the load bound; all
        once it is past it; all when none has it.
        """
        r1, r2 = replica("r1"), replica("r2")
        load = {"r1": 0.0, "r2": 0.0}

        def load_of(r: Replica) -> float:
            return load[r.endpoint.id]

        self.assertEqual(self.loads.narrow("a", [r1, r2], load_of), [r1, r2])
        self.use(r1, "a")
        self.assertEqual(self.loads.narrow("a", [r1, r2], load_of), [r1])
        load["r1"] = 5.0
        self.assertEqual(self.loads.narrow("a", [r1, r2], load_of), [r1, r2])
        self.assertEqual(LOAD_PATH, b"/v1/load_lora_adapter")


class EngineTruthTests(_LoadsCase):
    """
    What the engines hold, not what this router did: read from their
    C{/v1/models}; a refused load backs off and shows; a removed adapter
    is unloaded; C{max_loras} never passed.
    """

    def held(self) -> int:
        """
        @return: the most adapters the engine held at once, from the loads
            and unloads it answered, in order (none held before).
        """
        held = most = 0
        for sent in self.agent.sent:
            if not sent.answer.called:
                continue
            path = sent.uri.decode().removeprefix(URL)
            held += {LOAD_PATH.decode(): 1, UNLOAD_PATH.decode(): -1}.get(path, 0)
            most = max(most, held)
        return most

    def test_new_router_reads_what_engines_hold(self) -> None:
        """
        A router started anew (this one) reads each replica's adapters from
        its engine: a request for an adapter one replica already holds goes
        there, and no load is sent anywhere.
        """
        r1 = replica("r1", url="http://127.0.0.1:20001")
        r2 = replica("r2", url="http://127.0.0.1:20002")
        self.loads.sync([r1, r2])
        self.assertEqual(
            [(s.method, s.uri) for s in self.agent.sent],
            [
                ("GET", b"http://127.0.0.1:20001/v1/models"),
                ("GET", b"http://127.0.0.1:20002/v1/models"),
            ],
        )
        self.answer(0, body=listing("a"))
        self.answer(1, body=listing())
        self.assertEqual(self.loads.loaded("r1"), ["a"])
        self.assertEqual(self.loads.narrow("a", [r1, r2], lambda r: 0.0), [r1])
        self.loads.post(r1, "a", b"/v1/chat/completions", [], b"{}")
        self.assertEqual(
            self.agent.sent[-1].uri, b"http://127.0.0.1:20001/v1/chat/completions"
        )
        loads = [s for s in self.agent.sent if s.uri.endswith(LOAD_PATH)]
        self.assertEqual(loads, [])

    def test_request_waits_for_the_read(self) -> None:
        """
        A request for an adapter while its replica's list is being read
        waits for it: the engine holds it, so no load.
        """
        r = replica()
        self.loads.sync([r])
        got: list[Any] = []
        self.loads.post(r, "b", b"/v1/chat/completions", [], b"{}").addBoth(got.append)
        self.assertEqual([s.method for s in self.agent.sent], ["GET"])
        self.answer(0, body=listing("b"))
        self.assertEqual(self.paths()[1:], [("/v1/chat/completions", "")])
        self.assertEqual(self.loads.loaded("r1"), ["b"])

    def test_refused_load_backs_off_and_shows(self) -> None:
        """
        A load the engine refuses is not tried by every request: in the
        second after it, ten requests get the engine's answer and no load
        is sent; then one try, refused again, and the wait doubles.  The
        refusal shows (the engine's error, when it is tried again) until a
        load goes through.
        """
        r = replica()
        body = b'{"error": {"message": "Loading lora a failed: No adapter found"}}'
        statuses: list[int] = []

        def ask() -> None:
            self.loads.post(r, "a", b"/v1/chat/completions", [], b"{}").addCallback(
                lambda response: statuses.append(response.code)
            )
            for i, sent in enumerate(self.agent.sent):
                if not sent.answer.called:
                    self.answer(i, 404, body)
            self.loads.finished("r1", "a")

        def loads() -> int:
            return sum(1 for s in self.agent.sent if s.uri.endswith(LOAD_PATH))

        ask()
        for _ in range(10):
            self.clock.advance(0.09)
            ask()
        self.assertEqual((loads(), statuses), (1, [404] * 11))
        (shown,) = self.loads.refusals("a")
        self.assertEqual(
            (shown["replica"], shown["failures"], shown["status"]), ("r1", 1, 404)
        )
        self.assertIn("No adapter found", shown["error"])
        self.assertEqual(shown["retry_at"], 1.0)
        self.clock.advance(0.2)  # 1.1 s: tried again, refused; next at 3.1 s
        ask()
        self.assertEqual(loads(), 2)
        self.assertAlmostEqual(self.loads.refusals()[0]["retry_at"], 1.1 + 2.0)
        for _ in range(19):
            self.clock.advance(0.1)
            ask()
        self.assertEqual(loads(), 2)
        self.clock.advance(0.1)
        self.loads.post(r, "a", b"/v1/chat/completions", [], b"{}")
        self.answer(len(self.agent.sent) - 1)
        self.assertEqual((loads(), self.loads.refusals()), (3, []))
        self.assertEqual(self.loads.loaded("r1"), ["a"])

    def test_removed_adapter_unloaded(self) -> None:
        """
        An adapter removed from the catalog (gone from its replica's
        adapters) is unloaded from the engine that holds it, once its
        request in flight there ends.
        """
        r = replica()
        self.loads.sync([r])
        self.answer(0, body=listing("a", "b"))
        self.loads.post(r, "b", b"/v1/chat/completions", [], b"{}")
        without = replica(adapters=(("c", "/ad/c"),))
        self.loads.sync([without])
        # a is unloaded at once; b when its request ends.
        self.assertEqual(self.paths()[-1], (UNLOAD_PATH.decode(), "a"))
        self.answer(len(self.agent.sent) - 2)  # b's request
        self.answer(len(self.agent.sent) - 1)  # a's unload
        self.loads.finished("r1", "b")
        self.assertEqual(self.paths()[-1], (UNLOAD_PATH.decode(), "b"))
        self.answer(len(self.agent.sent) - 1)
        self.assertEqual(self.loads.loaded("r1"), [])

    def test_max_loras_never_passed(self) -> None:
        """
        C{max_loras = 2}, a and b each with a request in flight: a request
        for c waits (no load, no unload); when a's request ends, a is
        unloaded, then c loaded, then c's request sent; the engine never
        holds 3.
        """
        r = replica()
        self.loads.sync([r])
        self.answer(0, body=listing())
        for model in ("a", "b"):
            self.loads.post(r, model, b"/v1/chat/completions", [], b"{}")
            self.answer(len(self.agent.sent) - 1)  # its load; its request waits
        sent = len(self.agent.sent)
        got: list[Any] = []
        self.loads.post(r, "c", b"/v1/chat/completions", [], b"{}").addBoth(got.append)
        self.assertEqual(len(self.agent.sent), sent)
        self.clock.advance(30)
        self.assertEqual(len(self.agent.sent), sent)
        # a's request ends.
        a_request = next(
            i
            for i, s in enumerate(self.agent.sent)
            if s.uri.endswith(b"/v1/chat/completions") and not s.answer.called
        )
        self.answer(a_request)
        self.loads.finished("r1", "a")
        self.assertEqual(self.paths()[sent:], [(UNLOAD_PATH.decode(), "a")])
        self.answer(sent)
        self.assertEqual(self.paths()[sent + 1 :], [(LOAD_PATH.decode(), "c")])
        self.answer(sent + 1)
        self.assertEqual(self.paths()[sent + 2 :], [("/v1/chat/completions", "")])
        self.assertEqual(self.loads.loaded("r1"), ["b", "c"])
        self.assertEqual(self.held(), 2)

    def test_waiting_load_ends_with_its_replica(self) -> None:
        """
        A load waiting for room on a replica that goes away does not wait
        for good: it is tried, and its request fails with the replica.
        """
        r = replica(max_loras=1)
        self.loads.sync([r])
        self.answer(0, body=listing())
        self.loads.post(r, "a", b"/v1/chat/completions", [], b"{}")
        self.answer(1)  # a's load; its request stays in flight
        got: list[Any] = []
        self.loads.post(r, "b", b"/v1/chat/completions", [], b"{}").addBoth(got.append)
        self.assertEqual(len(self.agent.sent), 3)
        self.loads.sync([])
        self.assertEqual(self.paths()[3], (LOAD_PATH.decode(), "b"))
        self.agent.sent[3].answer.errback(ConnectionRefusedError())
        (failure,) = got
        self.assertTrue(failure.check(ConnectionRefusedError))
