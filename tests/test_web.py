"""
The dashboard's parts on a L{Clock}: login sessions and their limits,
the sampler behind the sparklines, the failure tap, the CSRF check on
actions and the resources that mount the pages.  The browser tests
(L{tests.test_e2e_dashboard}) drive the same pages through a running
server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlencode

from prometheus_client import CollectorRegistry
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyChannel

from llmgw.control.plane import ControlPlane
from llmgw.router.accounting.api_key import hash_key
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.telemetry.metrics import RouterMetrics
from llmgw.web.fleet import Fleet
from llmgw.web.history import FailureTap, History, sparkline
from llmgw.web.login import SESSION_COOKIE, LoginGate, Mount, Sessions, Split
from llmgw.web.pages import CookieCsrf, Dashboard
from llmgw.web.traffic import Traffic
from llmgw.wire import agent_pb2 as pb
from tests.plane_support import PlaneCase
from tests.typing_support import stub_treq

ADMIN = "sk-admin-" + "a" * 30
PLAIN = "sk-plain-" + "b" * 30


def _keys() -> KeyRing:
    keys = KeyRing(None, clock=time.monotonic, wall_clock=time.time)  # type: ignore[arg-type]
    keys.load(
        [
            {
                "id": i,
                "name": name,
                "prefix": secret[:11],
                "hash": hash_key(secret),
                "models": None,
                "rpm": None,
                "tpm": None,
                "budget_tokens": None,
                "admin": admin,
                "created": 0.0,
            }
            for i, (name, secret, admin) in enumerate(
                [("ops", ADMIN, True), ("app", PLAIN, False)]
            )
        ]
    )
    return keys


def _request(cookie: str | None = None) -> Request:
    request = Request(DummyChannel())
    if cookie is not None:
        request.received_cookies[SESSION_COOKIE] = cookie.encode()
    return request


class SessionTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.keys = _keys()
        self.sessions = Sessions(self.keys, self.clock.seconds, idle=60, window=60)

    def test_admin_key_opens_a_session(self) -> None:
        """
        An admin key opens a session found by its cookie, with a CSRF
        token of its own; a non-admin key or a wrong one opens none.
        """
        token = self.sessions.login("10.0.0.1", ADMIN)
        assert token is not None
        session = self.sessions.session(_request(token))
        assert session is not None
        self.assertEqual(session.key, "ops")
        self.assertTrue(self.sessions.check(_request(token), session.csrf))
        self.assertFalse(self.sessions.check(_request(token), "x" + session.csrf))
        self.assertFalse(self.sessions.check(_request(), session.csrf))
        self.assertIsNone(self.sessions.login("10.0.0.1", PLAIN))
        self.assertIsNone(self.sessions.login("10.0.0.1", "sk-nothing"))
        self.assertIsNone(self.sessions.session(_request("made-up")))

    def test_idle_expiry(self) -> None:
        """
        A session used within C{idle} seconds lives on; one left idle
        longer is gone.
        """
        token = self.sessions.login("10.0.0.1", ADMIN)
        assert token is not None
        for _ in range(3):
            self.clock.advance(50)
            self.assertIsNotNone(self.sessions.session(_request(token)))
        self.clock.advance(61)
        self.assertIsNone(self.sessions.session(_request(token)))

    def test_revoked_key_ends_session(self) -> None:
        """
        Revoking the key ends the sessions it opened.
        """
        token = self.sessions.login("10.0.0.1", ADMIN)
        assert token is not None
        key = self.keys.find("ops")
        assert key is not None
        key.revoked = 1.0
        self.assertIsNone(self.sessions.session(_request(token)))

    def test_expired_key_ends_session(self) -> None:
        """
        A key whose expiry passes (keys update --expires) ends the
        sessions it opened.
        """
        token = self.sessions.login("10.0.0.1", ADMIN)
        assert token is not None
        key = self.keys.find("ops")
        assert key is not None
        key.expires = time.time() + 3600
        self.assertIsNotNone(self.sessions.session(_request(token)))
        key.expires = time.time() - 1
        self.assertIsNone(self.sessions.session(_request(token)))

    def test_failed_logins_limited_per_address(self) -> None:
        """
        After C{attempts} failures in the window an address is limited
        (another is not), and free again once the window has passed.
        """
        for _ in range(5):
            self.assertFalse(self.sessions.limited("10.0.0.1"))
            self.sessions.login("10.0.0.1", PLAIN)
        self.assertTrue(self.sessions.limited("10.0.0.1"))
        self.assertFalse(self.sessions.limited("10.0.0.2"))
        self.clock.advance(61)
        self.assertFalse(self.sessions.limited("10.0.0.1"))


class _Replica:
    def __init__(self, state: str) -> None:
        self.state = state


class HistoryTests(SynchronousTestCase):
    def test_samples_rates_and_states(self) -> None:
        """
        Each tick turns the router's counters into a rate, an error share
        and a mean time to first token since the last tick, and notes
        replica state changes; stopping leaves no delayed call.
        """
        clock = Clock()
        metrics = RouterMetrics(CollectorRegistry())
        requests = metrics.requests
        ttft = metrics.time_to_first_token
        plane: Any = type("Plane", (), {})()
        plane.replicas = {"r1": _Replica("starting")}
        history = History(
            clock,
            metrics,
            cast(ControlPlane, plane),
            None,
            wall_clock=clock.seconds,
            interval=5,
        )
        history.startService()
        requests.labels("m", "200").inc(9)
        requests.labels("m", "502").inc(1)
        ttft.labels("m").observe(0.2)
        ttft.labels("m").observe(0.4)
        plane.replicas["r1"].state = "ready"
        clock.advance(5)
        (point,) = history.points
        self.assertEqual(point.rate, 2.0)
        self.assertEqual(point.error_rate, 0.1)
        assert point.ttft is not None
        self.assertAlmostEqual(point.ttft, 0.3)
        self.assertEqual([s for _, s in history.states["r1"]], ["starting", "ready"])
        clock.advance(5)
        self.assertEqual(history.points[-1].rate, 0.0)
        self.assertIsNone(history.points[-1].ttft)
        del plane.replicas["r1"]
        clock.advance(5)
        self.assertNotIn("r1", history.states)
        history.stopService()
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_sparkline(self) -> None:
        """
        A sparkline is an SVG polyline with one point per value, scaled to
        the largest; none is a flat line.
        """
        svg = sparkline([0, 5, 10], width=100, height=40)
        self.assertIn('points="0.0,38.0 50.0,20.0 100.0,2.0"', svg)
        self.assertIn('points="0.0,38.0 100.0,38.0"', sparkline([], width=100))
        self.assertIn('points="0.0,38.0 100.0,2.0"', sparkline([3], width=100))


class _Listener:
    def __init__(self) -> None:
        self.got: list[Any] = []

    def node_registered(self, node_id: str, register: pb.Register) -> None:
        self.got.append(register)

    def shard_status(self, node_id: str, status: pb.ShardStatus) -> None:
        self.got.append(status)


class FailureTapTests(SynchronousTestCase):
    def test_keeps_failures_passes_all(self) -> None:
        """
        A failed shard's output tail is kept; every message goes on to
        the plane unchanged, and C{changed} is called after each shard
        status reached it.
        """
        inner = _Listener()
        tap = FailureTap(inner, lambda: 5.0)
        seen: list[int] = []
        tap.changed = lambda: seen.append(len(inner.got))
        ready = pb.ShardStatus(shard_id="s1", state=pb.SHARD_STATE_READY)
        failed = pb.ShardStatus(
            shard_id="s2",
            state=pb.SHARD_STATE_FAILED,
            error="exit 1",
            output_tail=["a", "b"],
        )
        tap.node_registered("n1", pb.Register(node_id="n1"))
        tap.shard_status("n1", ready)
        tap.shard_status("n1", failed)
        self.assertEqual(len(inner.got), 3)
        self.assertIs(inner.got[2], failed)
        (failure,) = tap.failures
        self.assertEqual((failure.node, failure.error), ("n1", "exit 1"))
        self.assertEqual(tap.tails, {"s2": ("a", "b")})
        # Told after the plane has each shard status.
        self.assertEqual(seen, [2, 3])


class _Actions:
    def __init__(self) -> None:
        self.scaled: list[tuple[str, int, int]] = []
        self.drains: list[tuple[str, bool]] = []
        self.kept = True
        self.report: dict[str, Any] | None = None

    async def set_scale(self, name: str, low: int, high: int) -> Any:
        self.scaled.append((name, low, high))

    async def revoke(self, name: str) -> Any:
        raise KeyError(name)

    async def keep_drain(self, node_id: str, draining: bool) -> bool:
        self.drains.append((node_id, draining))
        return self.kept

    async def usage(
        self, by: str, since: float, until: float | None
    ) -> dict[str, Any] | None:
        return self.report


@dataclass(frozen=True)
class _Finished:
    model: str
    status: int
    replica: str | None = None
    stream: bool = True
    time_to_first_token: float | None = 0.1
    usage_estimated: bool = False


class DashboardTests(PlaneCase):
    def setUp(self) -> None:
        self.make()
        self.plane.reconcile()
        self.ready_all()
        history = History(
            self.clock,
            RouterMetrics(CollectorRegistry()),
            self.plane,
            None,
            wall_clock=time.time,
        )
        self.traffic = Traffic(self.clock.seconds, self.plane.catalog.resolve)
        fleet = Fleet(
            self.inventory, self.plane, None, history, None, traffic=self.traffic
        )
        self.actions = _Actions()
        self.treq = stub_treq(
            Dashboard(fleet, self.actions, CookieCsrf()).app.resource()
        )

    def call(self, method: str, url: str, **kwargs: Any) -> tuple[int, Any, bytes]:
        response = self.successResultOf(
            self.treq.request(method, "http://admin" + url, **kwargs)
        )
        body = self.successResultOf(response.content())
        return response.code, response, body

    def test_pages(self) -> None:
        """
        The overview names both nodes; node, replica and model pages
        answer 200, unknown ones 404; C{?fragment=1} is the main part
        alone.
        """
        code, _, body = self.call("GET", "/")
        self.assertEqual(code, 200)
        self.assertIn(b'data-node="n1"', body)
        self.assertIn(b'data-node="n2"', body)
        (replica,) = self.plane.replicas
        for path in ("/nodes/n1", f"/replicas/{replica}", "/models/m", "/keys"):
            self.assertEqual(self.call("GET", path)[0], 200, path)
        for path in ("/nodes/n9", "/replicas/r9", "/models/none", "/nowhere"):
            self.assertEqual(self.call("GET", path)[0], 404, path)
        code, _, fragment = self.call("GET", "/?fragment=1")
        self.assertEqual(code, 200)
        self.assertNotIn(b"<html", fragment)
        self.assertIn(b'data-node="n1"', fragment)

    def test_keys_page_shows_cost(self) -> None:
        """
        The keys page shows the usage report the admin API answers
        (docs/cost.md): each key's GPU-seconds and cost, the idle row,
        each GPU's seconds by state; without a store, none of it.
        """
        self.assertNotIn(b"GPU time and cost", self.call("GET", "/keys")[2])
        states = {"starting": 1.0, "awake": 5.0, "asleep": 3.0, "free": 1.0}
        gpu = {"node": "n1", "gpu": 0, "gpu_name": "H100", "seconds": 10.0}
        gpu.update(states=states, requests=4.0, idle=6.0, cost=0.5)
        key = {"key": "app", "requests": 3, "gpu_seconds": 4.0, "cost": 0.25}
        idle = {"gpu_seconds": 6.0, "cost": 0.125}
        self.actions.report = {"usage": [key], "idle": [idle], "gpus": [gpu]}
        body = self.call("GET", "/keys")[2]
        self.assertIn(b"<td>app</td><td>3</td><td>4.0</td><td>0.250000</td>", body)
        self.assertIn(b"<td>(idle)</td><td></td><td>6.0</td><td>0.125000</td>", body)
        self.assertIn(b"<td>n1:0</td><td>H100</td><td>10.0</td><td>1.0</td>", body)

    def test_estimated_usage_marked(self) -> None:
        """
        A model whose streams end whole without the engine's usage (as
        llama-cpp-python's server sends them) is marked on the overview,
        and its page says how many requests were charged an estimate and
        why (issue 37, item 8); a model without any is not.
        """
        code, _, body = self.call("GET", "/models/m")
        self.assertNotIn(b"usage-estimated", body)
        self.assertNotIn(b"usage estimated", self.call("GET", "/")[2])
        for status in (200, 200, 499):
            self.traffic.record(_Finished("m", status, usage_estimated=True))
        self.traffic.record(_Finished("m", 200, usage_estimated=False))
        code, _, body = self.call("GET", "/models/m")
        self.assertEqual(code, 200)
        self.assertIn(b'id="usage-estimated"', body)
        self.assertIn(b"Usage estimated: 3 requests", body)
        self.assertIn(b"2 of them streams answered whole without usage", body)
        self.assertIn(b'<span class="pin est"', self.call("GET", "/")[2])

    def test_actions_need_the_csrf_token(self) -> None:
        """
        A drain without the token, or with one that is not the cookie's,
        is refused with 403 and changes nothing; with both it drains and
        answers 303 back to the node's page, the drain kept through the
        admin's function (503 when the store refuses).  Scale goes to the
        admin's function.
        """
        _, response, _ = self.call("GET", "/")
        (cookie,) = response.headers.getRawHeaders("set-cookie")
        self.assertIn("HttpOnly", cookie)
        self.assertIn("SameSite=strict", cookie)
        csrf = cookie.split(";")[0].split("=", 1)[1]
        form = {"content-type": "application/x-www-form-urlencoded"}
        for body in (b"", b"csrf=" + b"x" * 43):
            code, _, _ = self.call(
                "POST",
                "/nodes/n1/drain",
                data=body,
                headers=form,
                allow_redirects=False,
            )
            self.assertEqual(code, 403)
        node = self.inventory.get("n1")
        assert node is not None
        self.assertFalse(node.draining)
        code, response, _ = self.call(
            "POST",
            "/nodes/n1/drain",
            data=f"csrf={csrf}".encode(),
            headers=form,
            allow_redirects=False,
        )
        self.assertEqual(code, 303)
        self.assertEqual(response.headers.getRawHeaders("location"), ["/nodes/n1"])
        self.assertTrue(node.draining)
        self.assertEqual(self.actions.drains, [("n1", True)])
        # The store refuses: 503, the node undrained in this server only.
        self.actions.kept = False
        code, _, body = self.call(
            "POST",
            "/nodes/n1/undrain",
            data=f"csrf={csrf}".encode(),
            headers=form,
            allow_redirects=False,
        )
        self.assertEqual(code, 503)
        self.assertIn(b"Store busy", body)
        self.assertFalse(node.draining)
        self.assertEqual(self.actions.drains, [("n1", True), ("n1", False)])
        code, _, _ = self.call(
            "POST",
            "/models/m/scale",
            data=f"csrf={csrf}&min_replicas=0&max_replicas=3".encode(),
            headers=form,
            allow_redirects=False,
        )
        self.assertEqual(code, 303)
        self.assertEqual(self.actions.scaled, [("m", 0, 3)])


class _Leaf(Resource):
    isLeaf = True

    def __init__(self, name: bytes) -> None:
        super().__init__()
        self.name = name

    def render(self, request: Any) -> bytes:
        prepath = b"/".join(request.prepath)
        return self.name + b" " + prepath + b"|" + b"/".join(request.postpath)


class MountTests(SynchronousTestCase):
    def get(self, resource: Resource, path: str) -> bytes:
        treq = stub_treq(resource)
        response = self.successResultOf(treq.get("http://x" + path))
        body: bytes = self.successResultOf(response.content())
        return body

    def test_mount_moves_the_prefix(self) -> None:
        """
        Requests under the prefix reach the mounted resource with the
        prefix moved to C{prepath}; all others reach the inner one.
        """
        mount = Mount(_Leaf(b"api"), b"admin", _Leaf(b"dash"))
        self.assertTrue(self.get(mount, "/admin/nodes/n1").startswith(b"dash admin"))
        self.assertTrue(self.get(mount, "/admin").startswith(b"dash admin"))
        self.assertTrue(self.get(mount, "/v1/models").startswith(b"api "))
        self.assertTrue(self.get(mount, "/administrator").startswith(b"api "))

    def test_split_by_first_segment(self) -> None:
        """
        The admin listener's split sends named first segments to their
        resource and everything else to the default.
        """
        split = Split({b"api": _Leaf(b"api"), b"debug": _Leaf(b"prof")}, _Leaf(b"d"))
        self.assertTrue(self.get(split, "/api/v1/nodes").startswith(b"api"))
        self.assertTrue(self.get(split, "/debug/threads").startswith(b"prof"))
        self.assertTrue(self.get(split, "/").startswith(b"d "))
        self.assertTrue(self.get(split, "/nodes/api").startswith(b"d "))


class LoginGateTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.sessions = Sessions(_keys(), self.clock.seconds)
        gate = LoginGate(_Leaf(b"dash"), self.sessions, "/admin")
        self.treq = stub_treq(Mount(_Leaf(b"api"), b"admin", gate))

    def post_login(self, scheme: str, key: str) -> Any:
        response = self.successResultOf(
            self.treq.post(
                f"{scheme}://x/admin/login",
                data=urlencode({"key": key}).encode(),
                headers={"content-type": "application/x-www-form-urlencoded"},
                allow_redirects=False,
            )
        )
        self.successResultOf(response.content())
        return response

    def test_cookie(self) -> None:
        """
        An admin key's login answers 303 to the pages with a session
        cookie that is C{HttpOnly}, C{SameSite=Strict}, for C{/admin}
        only, and C{Secure} under TLS; a non-admin key gets 403 and no
        cookie.
        """
        response = self.post_login("http", ADMIN)
        self.assertEqual(response.code, 303)
        self.assertEqual(response.headers.getRawHeaders("location"), ["/admin/"])
        (cookie,) = response.headers.getRawHeaders("set-cookie")
        self.assertIn("HttpOnly", cookie)
        self.assertIn("SameSite=strict", cookie)
        self.assertIn("Path=/admin", cookie)
        self.assertNotIn("Secure", cookie)
        (cookie,) = self.post_login("https", ADMIN).headers.getRawHeaders("set-cookie")
        self.assertIn("Secure", cookie)
        response = self.post_login("http", PLAIN)
        self.assertEqual(response.code, 403)
        self.assertIsNone(response.headers.getRawHeaders("set-cookie"))

    def test_pages_need_a_session(self) -> None:
        """
        Without a session the pages send to the login form (a fragment
        request gets 401); the client API beside them is untouched.
        """
        for path, code in (("/admin/", 303), ("/admin/nodes/n1?fragment=1", 401)):
            response = self.successResultOf(
                self.treq.get("http://x" + path, allow_redirects=False)
            )
            self.assertEqual(response.code, code, path)
        response = self.successResultOf(self.treq.get("http://x/v1/models"))
        self.assertEqual(self.successResultOf(response.content())[:3], b"api")


class _Reading:
    running = 3.0
    waiting = 1.0
    kv_cache_usage: float | None = 0.42
    prefix_cache_hit_rate: float | None = 0.5
    read_at = 100.0


class _Load:
    def __init__(self) -> None:
        self.metrics: bool | None = True
        self.is_stale = False
        self.value: _Reading | None = _Reading()

    def reading(self, replica_id: str) -> _Reading | None:
        return self.value

    def stale(self, replica_id: str, now: float) -> bool:
        return self.is_stale

    def has_metrics(self, replica_id: str) -> bool | None:
        return self.metrics


class EngineLoadTests(PlaneCase):
    def test_replica_load(self) -> None:
        """
        The replica page shows C{router.load}'s reading (running, waiting,
        KV cache, prefix cache hit rate, its age), says when it is stale,
        when the engine serves no metrics, and when the server polls none.
        """
        self.make()
        self.plane.reconcile()
        self.ready_all()
        (replica,) = self.plane.replicas
        history = History(
            self.clock,
            RouterMetrics(CollectorRegistry()),
            self.plane,
            None,
            wall_clock=time.time,
        )
        load = _Load()
        fleet = Fleet(
            self.inventory,
            self.plane,
            None,
            history,
            None,
            load,
            wall_clock=lambda: 105,
        )

        def shown() -> dict[str, Any]:
            row = fleet.replica(replica)
            assert row is not None
            result: dict[str, Any] = row["load"]
            return result

        self.assertEqual(
            shown(),
            {
                "text": "",
                "running": "3",
                "waiting": "1",
                "kv": "42%",
                "prefix_cache": "50%",
                "age": "5s ago",
            },
        )
        load.is_stale = True
        self.assertEqual(shown()["text"], "stale")
        load.value = None
        self.assertEqual(shown(), {"text": "no reading yet"})
        load.metrics = False
        self.assertEqual(shown(), {"text": "no reading: the engine serves no metrics"})
        fleet.load = None
        self.assertIn("does not poll", shown()["text"])
