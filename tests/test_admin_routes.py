"""
The admin API's route groups served as one resource (L{llmgw.admin.api}):
each group's routes answer through it, a method another group takes is
answered 405 naming every group's methods, errors answer as JSON whichever
group raised them, and each L{Admin} answers from its own collaborators.
Through L{StubTreq}; the end-to-end tests drive the same routes through a
running server.
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector
from twisted.trial.unittest import SynchronousTestCase

import llmgw
from llmgw.admin.api import Admin
from llmgw.control.inventory import Inventory
from llmgw.control.metrics import FleetCollector
from llmgw.tier.watch import Watch
from llmgw.wire import versions
from tests.plane_support import PlaneCase, make_model
from tests.test_fleet_collector import _Hub, scrape
from tests.typing_support import TypedStubTreq, stub_treq

ADMIN = os.path.join(os.path.dirname(os.path.abspath(llmgw.__file__)), "admin")

ROUTER = {versions.HEADER: versions.text()}
"""
What a router of the tier says on each request (L{llmgw.wire.versions}).
"""


class _Broken(Collector):
    """
    A collector that fails, so that C{/metrics} fails.
    """

    def collect(self) -> Iterator[Any]:
        raise RuntimeError("the collector broke")


class AdminRoutesTests(PlaneCase):
    def setUp(self) -> None:
        self.make()
        self.plane.reconcile()

    def admin(self, **kwargs: Any) -> TypedStubTreq:
        kwargs.setdefault("wall_clock", self.clock.seconds)
        kwargs.setdefault("config_models", frozenset({"m"}))
        kwargs.setdefault("watch", Watch(self.clock, dict))
        admin = Admin(CollectorRegistry(), self.inventory, self.plane, **kwargs)
        return stub_treq(admin.resource())

    def call(
        self,
        treq: TypedStubTreq,
        method: str,
        path: str,
        body: object = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, Any]:
        """
        @return: the status, the response, and the JSON body (the raw bytes
            when it is not JSON).
        """
        data = json.dumps(body).encode() if body is not None else None
        response = self.successResultOf(
            treq.request(method, "http://admin" + path, data=data, headers=headers)
        )
        content = self.successResultOf(response.content())
        try:
            return response.code, response, json.loads(content)
        except ValueError:
            return response.code, response, content

    def test_adapter_load_refusals_shown(self) -> None:
        """
        The loads of an adapter its engines refused (the server's router's
        account) show on the adapter: each with when it is tried again,
        the first as its C{last_error}; its base shows none.
        """
        from llmgw.control.catalog import parse_models

        base, adapter = parse_models(
            [
                {
                    "name": "b",
                    "max_loras": 2,
                    "min_replicas": 0,
                    "profiles": [
                        {
                            "name": "one",
                            "engine": "vllm",
                            "source": "s",
                            "gpus": 1,
                            "gpu_memory_gb": 10,
                        }
                    ],
                },
                {"name": "ad", "base": "b", "adapter": "/ad"},
            ]
        )
        self.plane.catalog.add(base)
        self.plane.catalog.add(adapter)
        refusal = {
            "replica": "r-1",
            "adapter": "ad",
            "failures": 2,
            "status": 404,
            "error": "No adapter found for /ad",
            "since": self.clock.seconds(),
            "retry_at": self.clock.seconds() + 2.0,
        }
        asked: list[str] = []

        def refusals(name: str) -> list[dict[str, Any]]:
            asked.append(name)
            return [refusal] if name == "ad" else []

        treq = self.admin(adapter_refusals=refusals)
        models = {
            m["name"]: m for m in self.call(treq, "GET", "/api/v1/models")[2]["models"]
        }
        self.assertEqual(asked, ["ad"])
        self.assertEqual(models["ad"]["load_errors"], [{**refusal, "retry_in": 2.0}])
        self.assertEqual(
            models["ad"]["last_error"],
            "replica r-1 refused to load it (2 in a row): 404 No adapter found"
            " for /ad; tried again in 2.0s",
        )
        self.assertNotIn("load_errors", models["b"])

    def test_each_group_answers_through_one_resource(self) -> None:
        """
        A route of each group (status, models, weights, keys, the routers',
        drains, swaps) answers through the one resource L{Admin.resource}
        gives, as C{/metrics} and C{/healthz} do.
        """
        treq = self.admin()
        (replica,) = self.plane.replicas
        self.assertEqual(
            self.call(treq, "GET", "/api/v1/status")[2]["nodes"], {"ready": 2}
        )
        self.assertEqual(
            [m["name"] for m in self.call(treq, "GET", "/api/v1/models")[2]["models"]],
            ["m"],
        )
        self.assertEqual(
            [n["node"] for n in self.call(treq, "GET", "/api/v1/weights")[2]["nodes"]],
            ["n1", "n2"],
        )
        code, _, body = self.call(treq, "GET", "/api/v1/keys")
        self.assertEqual(
            (code, body["error"]["message"]), (404, "no store in this server")
        )
        code, _, body = self.call(
            treq, "POST", "/api/v1/touch", {"names": ["m"]}, ROUTER
        )
        self.assertEqual((code, body), (200, {"touched": 1}))
        code, _, body = self.call(treq, "POST", f"/api/v1/replicas/{replica}/drain")
        self.assertEqual((code, body["replica"]), (200, replica))
        code, _, body = self.call(treq, "POST", "/api/v1/models/m-alias/pin")
        self.assertEqual((code, body["name"], body["runtime"]), (200, "m", False))
        self.assertEqual(self.call(treq, "GET", "/healthz")[2], {"status": "ok"})
        self.assertEqual(self.call(treq, "GET", "/metrics")[0], 200)

    def test_methods_of_every_group(self) -> None:
        """
        A path whose routes are in two groups (removing a model,
        activating one) answers a method neither takes with 405 and
        C{Allow} naming the methods of both; a method one of them takes
        reaches it.  A path no group has is 404.
        """
        treq = self.admin()
        code, response, body = self.call(treq, "PUT", "/api/v1/models/m/activate")
        self.assertEqual(code, 405)
        self.assertEqual(
            body,
            {"error": {"message": "PUT is not allowed here", "code": "bad_method"}},
        )
        (allow,) = response.headers.getRawHeaders("allow")
        self.assertEqual(sorted(allow.split(", ")), ["DELETE", "GET", "HEAD", "POST"])
        code, _, body = self.call(treq, "DELETE", "/api/v1/models/m/activate")
        self.assertEqual(
            (code, body["error"]["message"]), (404, "no model 'm/activate'")
        )
        code, _, body = self.call(
            treq, "GET", "/api/v1/models/m/activate", None, ROUTER
        )
        self.assertEqual((code, body["model"]), (200, "m"))
        code, response, body = self.call(treq, "GET", "/api/v1/nowhere")
        self.assertEqual(
            (code, body),
            (
                404,
                {"error": {"message": "no path /api/v1/nowhere", "code": "not_found"}},
            ),
        )
        self.assertEqual(response.headers.getRawHeaders("allow"), None)

    def test_errors_answer_as_json(self) -> None:
        """
        A group's refusal answers with its status and C{{"error":
        {"message", "code"}}} (with the C{models} of a drain refused); a
        failure no route expects answers 500 and is logged.
        """
        treq = self.admin()
        code, _, body = self.call(treq, "POST", "/api/v1/nodes/n1/drain", {"force": 1})
        self.assertEqual(
            (code, body),
            (
                400,
                {
                    "error": {
                        "message": "force: expected true or false",
                        "code": "bad_request",
                    }
                },
            ),
        )
        # With n2 drained, n1's replica has nowhere to go.
        self.assertEqual(self.call(treq, "POST", "/api/v1/nodes/n2/drain")[0], 200)
        code, _, body = self.call(treq, "POST", "/api/v1/nodes/n1/drain")
        self.assertEqual((code, body["error"]["code"]), (409, "below_min_replicas"))
        self.assertEqual(body["error"]["models"], ["m"])
        registry = CollectorRegistry()
        registry.register(_Broken())
        broken = stub_treq(
            Admin(registry, Inventory(), wall_clock=self.clock.seconds).resource()
        )
        code, _, body = self.call(broken, "GET", "/metrics")
        self.assertEqual((code, body["error"]["code"]), (500, "internal"))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    def test_each_admin_its_own(self) -> None:
        """
        Two admin APIs answer each from its own collaborators: one built
        with a standby's state says it (and refuses a router, naming the
        leader), the other, alone, says none.
        """
        standby = self.admin(
            standby=lambda: {"leading": False, "leader": "10.0.0.9:7000"}
        )
        alone = self.admin()
        self.assertEqual(
            self.call(standby, "GET", "/api/v1/status")[2]["standby"],
            {"leading": False, "leader": "10.0.0.9:7000"},
        )
        self.assertIsNone(self.call(alone, "GET", "/api/v1/status")[2]["standby"])
        code, _, body = self.call(
            standby, "GET", "/api/v1/models/m/activate", None, ROUTER
        )
        self.assertEqual(
            (code, body["error"]["code"], body["error"]["leader"]),
            (503, "standby", "10.0.0.9:7000"),
        )
        self.assertEqual(
            self.call(alone, "GET", "/api/v1/models/m/activate", None, ROUTER)[0], 200
        )

    def test_fleet_bound_refuses_the_lowest(self) -> None:
        """
        With a fleet bound of one held request per model, a batch
        activation held (posted by one router) is answered 429
        C{{"error": {"code": "activation_queue_full"}, "refused": true}}
        when an interactive one comes (from another router), which holds
        the place; the fleet metrics count the refusal for the model.
        """
        self.make(make_model(low=0), held_bound=1)
        treq = self.admin()
        path = "http://admin/api/v1/models/m-alias/activate"

        def post(priority: str) -> Any:
            body = json.dumps({"priority": priority, "timeout": 10}).encode()
            return treq.request("POST", path, data=body, headers=ROUTER)

        batch = post("batch")
        self.assertNoResult(batch)
        chat = post("interactive")
        treq.flush()
        response = self.successResultOf(batch)
        self.assertEqual(response.code, 429)
        self.assertEqual(
            json.loads(self.successResultOf(response.content())),
            {
                "error": {
                    "message": "more requests wait for model 'm' across the fleet"
                    " than it may hold; this one is of the lowest priority and"
                    " the newest",
                    "code": "activation_queue_full",
                },
                "refused": True,
            },
        )
        self.assertNoResult(chat)
        found = scrape(FleetCollector(self.plane, _Hub()))  # type: ignore[arg-type]
        self.assertEqual(
            found[("llmgw_activations_refused_total", (("model", "m"),))], 1
        )
        self.clock.advance(10)
        treq.flush()
        self.assertEqual(self.successResultOf(chat).code, 504)


def _admin_modules() -> Iterator[tuple[str, ast.Module]]:
    for name in sorted(os.listdir(ADMIN)):
        if name.endswith(".py"):
            with open(os.path.join(ADMIN, name), encoding="utf-8") as f:
                yield name, ast.parse(f.read())


class AdminShapeTests(SynchronousTestCase):
    def test_route_groups_are_objects(self) -> None:
        """
        In C{llmgw/admin}: no Klein app outside a class (each group has its
        own), no class with more than one base (no route mixins), and no
        C{raise NotImplementedError} (no stub of a sibling's method).
        """
        found = []
        for name, tree in _admin_modules():
            for statement in tree.body:
                if isinstance(statement, ast.Assign | ast.AnnAssign) and "Klein(" in (
                    ast.unparse(statement)
                ):
                    found.append(f"{name}:{statement.lineno}: a module-level app")
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and len(node.bases) > 1:
                    found.append(f"{name}:{node.lineno}: {node.name} has bases")
                if (
                    isinstance(node, ast.Raise)
                    and node.exc is not None
                    and "NotImplementedError" in ast.unparse(node.exc)
                ):
                    found.append(f"{name}:{node.lineno}: a stub")
        self.assertEqual(found, [])
