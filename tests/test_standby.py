"""
L{llmgw.server.standby.Leadership} on a fake PostgreSQL connection and a
L{Clock}; the agent's side of a standby (a Redirect, the server list); the
C{[standby]} table.  The real thing, two servers on one PostgreSQL, is
L{tests.test_e2e_standby}.
"""

from __future__ import annotations

import tempfile
from typing import Any, cast

from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.link import AgentFactory
from llmgw.agent.service import _Uplink, retry_policy
from llmgw.agent.settings import AgentConfig, parse_agent_config
from llmgw.config import parse_config
from llmgw.config_checks import ConfigError
from llmgw.control.agents import AgentHub
from llmgw.control.inventory import Inventory
from llmgw.reactors import IEngineReactor
from llmgw.server.settings import StandbyConfig
from llmgw.server.standby import LOCK_KEY, Leadership, advertised, relearn_drains
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.codec import FrameDecoder, encode_frame


class _Database:
    """
    One advisory lock and the leader table, shared by fake connections.
    """

    def __init__(self) -> None:
        self.holder: _Connection | None = None
        self.leader: str | None = None
        self.down = False


class _Cursor:
    def __init__(self, row: Any) -> None:
        self._row = row

    def fetchone(self) -> Any:
        return self._row


class _Connection:
    def __init__(self, database: _Database) -> None:
        self.database = database
        self.closed = False
        self.queries: list[str] = []

    def execute(self, query: str, params: Any = None) -> _Cursor:
        if self.database.down or self.closed:
            raise OSError("server closed the connection unexpectedly")
        self.queries.append(query)
        if query.startswith("SELECT pg_try_advisory_lock"):
            assert params == (LOCK_KEY,)
            if self.database.holder in (None, self):
                self.database.holder = self
                return _Cursor((True,))
            return _Cursor((False,))
        if query.startswith("INSERT INTO llmgw_leader"):
            self.database.leader = params[0]
        if query.startswith("SELECT agent_address"):
            leader = self.database.leader
            return _Cursor(None if leader is None else (leader,))
        return _Cursor(None)

    def close(self) -> None:
        # PostgreSQL releases the session's advisory locks.
        self.closed = True
        if self.database.holder is self:
            self.database.holder = None


class _Loop(Service):
    pass


class LeadershipTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.database = _Database()
        self.events: list[str] = []

    def server(self, address: str, in_thread: Any = maybeDeferred) -> Leadership:
        leadership = Leadership(
            self.clock,
            in_thread,
            lambda: _Connection(self.database),
            address,
            lambda: self.events.append(f"{address} leads"),
            lambda why: self.events.append(f"{address} lost: {why}"),
            retry=1.0,
            lease=5.0,
        )
        leadership.loop = _Loop()
        return leadership

    def test_one_leads_the_other_names_it(self) -> None:
        """
        The first server takes the lock, records its address and starts
        its reconciler; the second stands by and names the first.
        """
        first, second = self.server("a:1"), self.server("b:2")
        first.startService()
        second.startService()
        self.assertTrue(first.leading)
        self.assertTrue(first.loop is not None and first.loop.running)
        self.assertFalse(second.leading)
        self.assertEqual(second.leader, "a:1")
        self.assertFalse(second.loop is not None and second.loop.running)
        self.assertEqual(self.events, ["a:1 leads"])

    def test_standby_leads_when_the_leader_is_gone(self) -> None:
        """
        The leader's session ends (its process died): within one retry the
        standby takes the lock, records itself, and leads.
        """
        first, second = self.server("a:1"), self.server("b:2")
        first.startService()
        second.startService()
        assert self.database.holder is not None
        self.database.holder.close()
        first._loop.stop()  # type: ignore[union-attr]
        self.clock.advance(1.0)
        self.assertTrue(second.leading)
        self.assertEqual(self.database.leader, "b:2")
        self.assertEqual(self.events, ["a:1 leads", "b:2 leads"])

    def test_lost_connection_stops_leading_at_once(self) -> None:
        """
        A leader whose connection fails stops leading at the next check:
        its reconciler stops and it is told why.
        """
        first = self.server("a:1")
        first.startService()
        self.database.down = True
        self.clock.advance(1.0)
        self.assertFalse(first.leading)
        self.assertFalse(first.loop is not None and first.loop.running)
        self.assertEqual(len(self.events), 2)
        self.assertIn("a:1 lost: server closed the connection", self.events[1])

    def test_unanswered_check_stops_leading_after_the_lease(self) -> None:
        """
        A check that hangs (a cut path) ends leadership once the lease is
        over, without waiting for it.
        """
        pending: list[Deferred[Any]] = []
        answers = iter([True])

        def in_thread(call: Any) -> Deferred[Any]:
            if next(answers, False):
                return maybeDeferred(call)
            d: Deferred[Any] = Deferred()
            pending.append(d)
            return d

        first = self.server("a:1", in_thread)
        first.startService()
        self.assertTrue(first.leading)
        self.clock.advance(5.0)
        self.assertTrue(first.leading)
        self.clock.advance(1.0)
        self.assertFalse(first.leading)
        self.assertIn("not shown alive for 5s", self.events[-1])
        # The hung check answers at last: nothing changes.
        pending[0].callback((True, "a:1"))
        self.assertFalse(first.leading)
        self.assertTrue(self.events[-1].startswith("a:1 lost"))
        self.assertEqual(len(self.events), 2)

    def test_standby_retries_while_the_database_is_down(self) -> None:
        """
        A server that cannot reach the database stands by and leads once
        it can.
        """
        self.database.down = True
        first = self.server("a:1")
        first.startService()
        self.clock.advance(3.0)
        self.assertFalse(first.leading)
        self.database.down = False
        self.clock.advance(1.0)
        self.assertTrue(first.leading)

    def test_stop_releases_the_lock(self) -> None:
        """
        A clean stop stops the reconciler and closes the connection: the
        lock is free for a standby.
        """
        first = self.server("a:1")
        first.startService()
        self.successResultOf(first.stopService())
        self.assertIsNone(self.database.holder)
        self.assertFalse(first.loop is not None and first.loop.running)


class _Endpoint:
    def __init__(self, server: str, dialed: list[str]) -> None:
        self._server = server
        self._dialed = dialed

    def connect(self, factory: Any) -> Deferred[Any]:
        self._dialed.append(self._server)
        return Deferred()


class AgentFollowsTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.factory = AgentFactory(
            lambda: pb.Register(node_id="n1"),
            pb.Heartbeat,
            cast(IEngineReactor, Clock()),
            tempfile.mkdtemp(),
        )
        self.dialed: list[str] = []
        self.uplink = _Uplink(
            lambda server: _Endpoint(server, self.dialed),
            ["a:1", "b:2"],
            self.factory,
        )

    def test_servers_in_turn(self) -> None:
        """
        Without a server to prefer, each attempt dials the next of the list.
        """
        for _ in range(3):
            self.uplink.connect(object())
        self.assertEqual(self.dialed, ["a:1", "b:2", "a:1"])

    def test_failed_hint_turn_goes_on(self) -> None:
        """
        The server last registered with is dialed first; when it fails,
        the next attempt dials the server after it in the list.
        """
        self.uplink.connect(object())
        self.factory.server_hint = "b:2"
        self.uplink.connect(object())
        self.uplink.connect(object())
        self.assertEqual(self.dialed, ["a:1", "b:2", "a:1"])

    def test_redirect_names_the_next(self) -> None:
        """
        A standby's Redirect: the agent closes the link, dials the leader it
        names next (even one not in its list), 0.1 s later.
        """
        protocol = self.factory.buildProtocol(None)
        closed: list[bool] = []

        class Transport:
            def loseConnection(self) -> None:
                closed.append(True)

        protocol.transport = Transport()  # type: ignore[assignment]
        protocol.message_received(pb.ControlMessage(redirect=pb.Redirect(leader="c:3")))
        self.assertEqual(closed, [True])
        self.assertEqual(retry_policy(2, self.factory)(5), 0.1)
        self.uplink.connect(object())
        self.assertEqual(self.dialed, ["c:3"])
        self.assertGreaterEqual(retry_policy(2, self.factory)(1), 0.5)


class ConfigTests(SynchronousTestCase):
    def test_standby_table(self) -> None:
        """
        C{[standby]} is read and checked; C{[store] url} on PostgreSQL
        chooses the leader too.
        """
        config = parse_config(
            {
                "standby": {
                    "url": "postgresql://u@h:5432/d",
                    "advertise": "cp-1:7443",
                    "retry": "500ms",
                    "lease": "3s",
                }
            }
        )
        self.assertEqual(
            config.standby,
            StandbyConfig("postgresql://u@h:5432/d", "cp-1:7443", 0.5, 3.0),
        )
        self.assertEqual(config.leader_lock_url, "postgresql://u@h:5432/d")
        stored = parse_config({"store": {"url": "postgresql://u@h/d"}})
        self.assertEqual(stored.leader_lock_url, "postgresql://u@h/d")
        self.assertEqual(parse_config({}).leader_lock_url, "")
        for table, message in [
            ({"url": "mysql://x"}, "standby.url"),
            ({"advertise": "nohost"}, "standby.advertise"),
            ({"retry": "1ms"}, "standby.retry"),
            ({"retry": "2s", "lease": "3s"}, "standby.lease"),
            ({"bogus": 1}, "bogus"),
        ]:
            with self.assertRaises(ConfigError) as raised:
                parse_config({"standby": table})
            self.assertIn(message, str(raised.exception))

    def test_agent_servers(self) -> None:
        """
        An agent's C{server} and C{servers}, each once, in order.
        """
        config = parse_agent_config({"server": "a:1", "servers": ["b:2", "a:1"]})
        self.assertEqual(config.all_servers(), ("a:1", "b:2"))
        self.assertEqual(AgentConfig(servers=("b:2",)).all_servers(), ("b:2",))
        with self.assertRaises(ConfigError):
            parse_agent_config({"servers": "a:1"})

    def test_advertised(self) -> None:
        """
        The configured address, else the bound one with the host's name
        for a wildcard.
        """

        class Port:
            def __init__(self, host: str) -> None:
                self.host = host

            def getHost(self) -> Any:
                return type("A", (), {"host": self.host, "port": 7443})()

        self.assertEqual(advertised("x:1", Port("0.0.0.0")), "x:1")
        self.assertEqual(advertised("", Port("127.0.0.1")), "127.0.0.1:7443")
        self.assertNotIn("0.0.0.0", advertised("", Port("0.0.0.0")))
        self.assertEqual(advertised("", None), "")


class StandbyHubTests(SynchronousTestCase):
    def test_standby_redirects_register(self) -> None:
        """
        On a standby, a Register is answered with a Redirect naming the
        leader, the link closes, and no node is recorded; once the server
        leads, the next Register is welcomed.
        """
        hub = AgentHub(Clock(), Inventory(), insecure=True)
        hub.follow(lambda: "a:1")
        register = encode_frame(
            pb.AgentMessage(register=pb.Register(node_id="n1")).SerializeToString()
        )
        link = hub.buildProtocol(None)
        transport = StringTransport()
        link.makeConnection(transport)
        with capturedLogs():
            link.dataReceived(register)
        (answer,) = FrameDecoder().feed(transport.value())
        message = pb.ControlMessage.FromString(answer)
        self.assertEqual(message.redirect.leader, "a:1")
        self.assertTrue(transport.disconnecting)
        self.assertEqual(hub.inventory.nodes(), [])
        hub.lead()
        link = hub.buildProtocol(None)
        transport = StringTransport()
        link.makeConnection(transport)
        with capturedLogs():
            link.dataReceived(register)
        (answer,) = FrameDecoder().feed(transport.value())
        self.assertTrue(pb.ControlMessage.FromString(answer).HasField("welcome"))
        self.assertEqual(len(hub.inventory.nodes()), 1)


class _DrainStore:
    def __init__(self, answer: Deferred[dict[str, float]]) -> None:
        self.answer = answer

    def drains(self) -> Deferred[dict[str, float]]:
        return self.answer


class RelearnDrainsTests(SynchronousTestCase):
    def test_drains_read_again(self) -> None:
        """
        On taking the lead the store's drained nodes replace those read at
        start: one drained since is added, one undrained since removed.
        """
        inventory = Inventory(drained=["old"])
        store: Any = _DrainStore(Deferred())
        done = relearn_drains(store, inventory)
        self.assertNoResult(done)
        store.answer.callback({"new": 1.0})
        self.successResultOf(done)
        self.assertEqual(inventory.drained, {"new"})

    def test_store_down(self) -> None:
        """
        A store that cannot be read keeps what start read, with a warning.
        """
        inventory = Inventory(drained=["old"])
        store: Any = _DrainStore(Deferred())
        with capturedLogs() as events:
            done = relearn_drains(store, inventory)
            store.answer.errback(OSError("down"))
        self.successResultOf(done)
        self.assertEqual(inventory.drained, {"old"})
        self.assertTrue(
            any("cannot be read" in str(e.get("log_format")) for e in events)
        )
