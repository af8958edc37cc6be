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

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.iweb import IResponse

from llmgw.router.interfaces import Endpoint
from llmgw.router.routing.adapters import LOAD_PATH, UNLOAD_PATH, AdapterLoads
from llmgw.router.routing.balancer import Replica
from llmgw.router.upstream.base import BodyReader
from tests.exchange_fakes import FakeAgent, FakeResponse

URL = "http://127.0.0.1:20001"
ADAPTERS = (("a", "/ad/a"), ("b", "/ad/b"), ("c", "/ad/c"), ("d", "/ad/d"))


def replica(name: str = "r1", max_loras: int = 2) -> Replica:
    return Replica(
        Endpoint(
            name,
            URL,
            ("base", *(n for n, _ in ADAPTERS)),
            adapters=ADAPTERS,
            max_loras=max_loras,
        )
    )


class AdapterLoadTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.agent = FakeAgent()
        self.loads = AdapterLoads(self.agent)
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
            (s.uri.decode().removeprefix(URL), json.loads(s.body).get("lora_name", ""))
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
        status and body; nothing else is sent; the next request tries again.
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
