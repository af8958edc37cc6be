"""
The router tier's parts without processes: the watch's pushes and
keep-alives, the follower's reading of them, and C{router_workers}'s
check.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import ResponseDone
from twisted.web.test.requesthelper import DummyRequest

from llmgw.config import ServerConfig, load_config
from llmgw.config_checks import ConfigError
from llmgw.reactors import ISpawningReactor
from llmgw.router.interfaces import Endpoint
from llmgw.tier.admin_client import AdminClient
from llmgw.tier.follow import NEXT_URL_AFTER, SILENT_AFTER, Follower
from llmgw.tier.settings import check_router_workers
from llmgw.tier.watch import KEEPALIVE, Watch, endpoint_from_json, endpoint_json
from llmgw.tier.workers import tcp_address
from tests.typing_support import as_request

E1 = Endpoint("r1", "http://10.0.0.1:8000", ("m", "m-alias"), 2.0, api_key="s3cret")


def lines(request: DummyRequest) -> list[Any]:
    data = b"".join(request.written)
    return [json.loads(line) if line else None for line in data.split(b"\n")[:-1]]


class WatchTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.names = {"m": "m"}
        self.watch = Watch(self.clock, lambda: self.names)
        self.watch.startService()
        self.addCleanup(self.watch.stopService)

    def test_pushes_whole_state(self) -> None:
        """
        A watcher gets the state at once and again after each change of
        endpoints or names, versions rising; an unchanged list pushes
        nothing.
        """
        request = DummyRequest([b""])
        self.watch.watch(as_request(request))
        self.watch.set_endpoints([E1])
        self.watch.set_endpoints([E1])
        self.names = {"m": "m", "m-alias": "m"}
        self.watch.changed()
        first, second, third = lines(request)
        self.assertEqual((first["endpoints"], first["names"]), ([], {"m": "m"}))
        self.assertEqual(second["endpoints"], [endpoint_json(E1)])
        self.assertEqual(second["endpoints"][0]["api_key"], "s3cret")
        self.assertEqual(third["names"], {"m": "m", "m-alias": "m"})
        self.assertLess(first["version"], second["version"])
        self.assertLess(second["version"], third["version"])
        self.assertEqual(endpoint_from_json(second["endpoints"][0]), E1)

    def test_endpoint_adapters_round_trip(self) -> None:
        """
        A LoRA base's endpoint keeps its adapters and C{max_loras} through
        the watch's JSON: a tier's routers load adapters as the server's.
        """
        base = Endpoint(
            "r2",
            "http://10.0.0.2:8000",
            ("m", "m-sql"),
            adapters=(("m-sql", "/adapters/sql"),),
            max_loras=3,
        )
        self.assertEqual(
            endpoint_from_json(json.loads(json.dumps(endpoint_json(base)))), base
        )
        self.assertEqual(endpoint_from_json(endpoint_json(E1)).adapters, ())

    def test_endpoint_gpus_round_trip(self) -> None:
        """
        An endpoint's GPUs and their price per hour go through the watch's
        JSON: a tier's routers give their requests their share of it
        (docs/cost.md); one from an older server has none.
        """
        priced = Endpoint("r3", "http://10.0.0.3:8000", ("m",), gpus=1.5, gpu_hour=4.5)
        self.assertEqual(
            endpoint_from_json(json.loads(json.dumps(endpoint_json(priced)))), priced
        )
        older = {"id": "r3", "url": "http://10.0.0.3:8000", "models": ["m"]}
        self.assertEqual(endpoint_from_json(older).gpus, 0.0)

    def test_keepalive_and_unannounced_change(self) -> None:
        """
        An empty line every KEEPALIVE seconds; a catalog change nobody
        announced is pushed at the next one.  A watcher that goes gets
        nothing more.
        """
        request = DummyRequest([b""])
        waiting = self.watch.watch(as_request(request))
        self.clock.advance(KEEPALIVE)
        self.assertEqual(lines(request)[1:], [None])
        self.names = {}
        self.clock.advance(KEEPALIVE)
        self.assertEqual(lines(request)[2]["names"], {})
        waiting.addErrback(lambda _: None)
        waiting.cancel()
        count = len(request.written)
        self.clock.advance(KEEPALIVE * 3)
        self.assertEqual(len(request.written), count)


class FollowerTests(SynchronousTestCase):
    def test_lines(self) -> None:
        """
        Each state line is applied; empty lines and bad lines are not;
        the first state fires C{first}.
        """
        applied: list[tuple[list[Endpoint], dict[str, str]]] = []
        follower = Follower(Clock(), None, lambda e, n, k: applied.append((e, n)))  # type: ignore[arg-type]
        follower._line(b"")
        follower._line(b"{not json")
        self.assertFalse(follower.first.called)
        state = {"version": 3, "endpoints": [endpoint_json(E1)], "names": {"m": "m"}}
        follower._line(json.dumps(state).encode())
        self.assertEqual(applied, [([E1], {"m": "m"})])
        self.assertEqual(follower.version, 3)
        self.assertTrue(follower.first.called)
        self.assertGreater(SILENT_AFTER, KEEPALIVE)


class _Response:
    def __init__(self, code: int, body: bytes) -> None:
        self.code = code
        self.phrase = b"Service Unavailable"
        self._body = body

    def deliverBody(self, protocol: Any) -> None:
        protocol.dataReceived(self._body)
        protocol.connectionLost(Failure(ResponseDone()))


class _Agent:
    def __init__(self) -> None:
        self.asked: list[tuple[str, Deferred[Any]]] = []

    def request(self, method: bytes, url: bytes, *args: object) -> Deferred[Any]:
        waiting: Deferred[Any] = Deferred()
        self.asked.append((url.decode(), waiting))
        return waiting


class FollowerFailoverTests(SynchronousTestCase):
    def test_standby_refuses_next_url(self) -> None:
        """
        A standby's 503 naming the leader sends the follower to the URL on
        the leader's host at once (skipping another standby); failures go
        on to the next URL in turn, and only a whole round of failures
        backs off; nothing is applied meanwhile (the router keeps its
        endpoints).  Requests then go to the URL that answered.
        """
        clock, agent = Clock(), _Agent()
        urls = ["http://10.0.0.1:9090", "http://10.0.0.2:9090", "http://10.0.0.3:9090"]
        control = AdminClient(urls, agent=agent)
        applied: list[object] = []
        follower = Follower(clock, control, lambda e, n, k: applied.append(e))
        follower.startService()
        self.addCleanup(follower.stopService)
        refusal = {"error": {"message": "standby", "code": "standby"}}
        refusal["error"]["leader"] = "10.0.0.3:8443"
        agent.asked[-1][1].callback(_Response(503, json.dumps(refusal).encode()))
        clock.advance(NEXT_URL_AFTER)
        self.assertEqual(agent.asked[-1][0], urls[2] + "/api/v1/watch")
        agent.asked[-1][1].errback(ConnectionRefusedError())
        clock.advance(NEXT_URL_AFTER)
        self.assertEqual(agent.asked[-1][0], urls[0] + "/api/v1/watch")
        agent.asked[-1][1].errback(ConnectionRefusedError())
        clock.advance(NEXT_URL_AFTER)
        self.assertEqual(len(agent.asked), 3)  # A whole round: the back-off.
        clock.advance(0.2)
        self.assertEqual(agent.asked[-1][0], urls[1] + "/api/v1/watch")
        self.assertEqual(applied, [])
        self.assertEqual(control.url, urls[1])
        state = {"version": 1, "endpoints": [endpoint_json(E1)], "names": {}}
        follower._line(json.dumps(state).encode())
        self.assertEqual(applied, [[E1]])
        self.assertEqual(control.advance(), urls[2])


class RouterWorkersConfigTests(SynchronousTestCase):
    def test_check(self) -> None:
        self.assertEqual(check_router_workers(2), 2)
        self.assertEqual(check_router_workers("3"), 3)
        for bad in (-1, 65, True, 1.5, "two"):
            with self.assertRaises(ConfigError) as raised:
                check_router_workers(bad)
            self.assertIn("router_workers", str(raised.exception))

    def test_file_key(self) -> None:
        path = self.mktemp()
        with open(path, "w") as f:
            f.write(
                "router_workers = 2\n[[endpoints]]\n"
                'id = "a"\nurl = "http://h:1"\nmodels = ["m"]\n'
            )
        self.assertEqual(load_config(path).router_workers, 2)

    def test_workers_share_limits(self) -> None:
        """
        Without C{[limits] url}, each of N workers admits 1/N of every
        key's limits: the server passes C{--routers N}, and the router
        takes the larger of that and C{[limits] routers}.
        """
        from types import SimpleNamespace

        from llmgw.tier.tap import Options
        from llmgw.tier.workers import worker_argv

        config = replace(ServerConfig(), router_workers=3)
        address = SimpleNamespace(host="127.0.0.1", port=9090)
        bound = SimpleNamespace(host="127.0.0.1", port=8080)
        argv = worker_argv(
            None,
            config,
            SimpleNamespace(getHost=lambda: bound),
            SimpleNamespace(getHost=lambda: address),
        )
        self.assertEqual(argv[argv.index("--routers") + 1], "3")
        options = Options()
        options.parseOptions(["--control", "http://127.0.0.1:9090", *argv[-2:]])
        self.assertEqual(options.config.limits_routers, 3)
        with self.assertRaises(SystemExit):
            Options().parseOptions(["--control", "http://h:1", "--routers", "0"])

    def test_tcp_address(self) -> None:
        self.assertEqual(tcp_address("tcp:8080"), ("0.0.0.0", 8080))
        self.assertEqual(
            tcp_address("tcp:0:interface=127.0.0.1:backlog=10"), ("127.0.0.1", 0)
        )
        for bad in ("ssl:8443:privateKey=k", "unix:/tmp/s", "tcp:http"):
            self.assertRaises(ConfigError, tcp_address, bad)


class _Process:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.signals: list[object] = []

    def signalProcess(self, signal: object) -> None:
        self.signals.append(signal)


class _Reactor(Clock):
    """
    A clock that spawns fake processes; the first C{failures} spawns
    raise L{OSError} (no fork).
    """

    def __init__(self, failures: int = 0) -> None:
        super().__init__()
        self.failures = failures
        self.spawned: list[tuple[Any, _Process, list[str]]] = []

    def spawnProcess(
        self, protocol: Any, executable: str, args: list[str], **kw: Any
    ) -> _Process:
        if self.failures:
            self.failures -= 1
            raise OSError("no fork")
        process = _Process(1000 + len(self.spawned))
        self.spawned.append((protocol, process, args))
        return process


class WorkersTests(SynchronousTestCase):
    def test_restart_backoff_and_stop(self) -> None:
        """
        A spawn that fails and a worker that ends are tried again after
        0.5 s, then 1 s (doubling); each gets --parent-pid; the stop
        sends SIGTERM and fires once the worker ended.
        """
        from twisted.python.failure import Failure

        from llmgw.tier.workers import Workers

        reactor = _Reactor(failures=1)
        workers = Workers(
            cast(ISpawningReactor, reactor), 1, ["twistd", "llmgw-router"], "token", 5.0
        )
        workers.startService()
        self.assertEqual(reactor.spawned, [])
        reactor.advance(0.5)
        ((protocol, process, args),) = reactor.spawned
        self.assertIn("--parent-pid", args)
        protocol.processEnded(Failure(OSError("killed")))
        reactor.advance(0.9)
        self.assertEqual(len(reactor.spawned), 1)
        reactor.advance(0.1)
        self.assertEqual(len(reactor.spawned), 2)
        protocol, process, _ = reactor.spawned[1]
        stopped = workers.stopService()
        self.assertEqual(process.signals, ["TERM"])
        self.assertNoResult(stopped)
        protocol.processEnded(Failure(OSError("terminated")))
        self.successResultOf(stopped)
        reactor.advance(60)
        self.assertEqual(len(reactor.spawned), 2)
