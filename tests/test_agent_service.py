"""
The agent's service on a Clock: the uplink's backoff (a link refused before
the server's Welcome is a failed attempt; a welcomed one starts the backoff
again), its stop, and the GPUs' part of the heartbeats with a fake NVML
module (there is no GPU on the machines the tests run on: the module
stands in for C{pynvml}, with its names and its error class).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import capturedLogs, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.gpus import GpuMonitor, Nvml, discover
from llmgw.agent.link import AgentFactory
from llmgw.agent.service import AgentService
from llmgw.reactors import IEngineReactor
from llmgw.wire import agent_pb2 as pb
from llmgw.wire.codec import encode_frame

WELCOME = encode_frame(
    pb.ControlMessage(
        welcome=pb.Welcome(server_version="test", heartbeat_interval_seconds=5)
    ).SerializeToString()
)


class _Transport(StringTransport):
    protocol: Any

    def abortConnection(self) -> None:
        self.loseConnection()
        self.protocol.connectionLost(Failure(ConnectionDone()))


class _Endpoint:
    """
    Connects at once to a L{StringTransport}; keeps the protocols.
    """

    def __init__(self) -> None:
        self.connected: list[Any] = []

    def connect(self, factory: Any) -> Deferred[Any]:
        protocol = factory.buildProtocol(None)
        transport = _Transport()
        transport.protocol = protocol
        protocol.makeConnection(transport)
        self.connected.append(protocol)
        return succeed(protocol)


class UplinkTests(SynchronousTestCase):
    """
    L{AgentService}: a L{ClientService} whose connection counts once the
    server welcomed it, on the given clock.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.endpoint = _Endpoint()
        self.factory = AgentFactory(
            lambda: pb.Register(node_id="n1"),
            pb.Heartbeat,
            cast(IEngineReactor, self.clock),
            tempfile.mkdtemp(),
        )
        self.service = AgentService(
            self.factory, lambda _: self.endpoint, ["127.0.0.1:1"], self.clock
        )

    def next_delay(self) -> float:
        (call,) = self.clock.getDelayedCalls()
        return call.getTime() - self.clock.seconds()

    def refuse(self) -> float:
        """
        The server closes the newest link before welcoming it.

        @return: the delay before the next attempt.
        """
        self.endpoint.connected[-1].connectionLost(Failure(ConnectionDone()))
        delay = self.next_delay()
        self.clock.advance(delay)
        return delay

    def test_refusals_back_off(self) -> None:
        """
        Links closed before the Welcome: the delays double (plus up to 1 s
        of jitter) from 1 s; after a welcomed link is lost, they start
        again from the first.
        """
        self.service.startService()
        self.assertEqual(len(self.endpoint.connected), 1)
        delays = [self.refuse() for _ in range(4)]
        self.assertEqual(len(self.endpoint.connected), 5)
        for delay, low in zip(delays, [1.0, 2.0, 4.0, 8.0], strict=True):
            self.assertTrue(low <= delay < low + 1, delays)
        self.endpoint.connected[-1].dataReceived(WELCOME)
        self.assertTrue(self.factory.current is not None)
        assert self.factory.current is not None
        self.assertTrue(self.factory.current.welcomed)
        self.endpoint.connected[-1].connectionLost(Failure(ConnectionDone()))
        self.assertIsNone(self.factory.current)
        delay = self.next_delay()
        self.assertTrue(1.0 <= delay < 2.0, delay)
        self.successResultOf(self.service.stopService())
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_stop_aborts_the_link(self) -> None:
        """
        Stopping aborts the welcomed link at once and leaves nothing
        scheduled (no retry, no heartbeat).
        """
        self.service.startService()
        self.endpoint.connected[-1].dataReceived(WELCOME)
        self.assertNotEqual(self.clock.getDelayedCalls(), [])
        self.successResultOf(self.service.stopService())
        self.assertIsNone(self.factory.current)
        self.assertEqual(self.clock.getDelayedCalls(), [])


class _NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"error {value}")
        self.value = value


def fake_nvml(
    count: int = 2, used_mib: int = 100, xids: list[tuple[int, int]] | None = None
) -> SimpleNamespace:
    """
    A stand-in for C{pynvml} (no GPU here): C{count} GPUs of 80 GiB,
    C{used_mib} in use; C{xids} are C{(gpu index, xid)} events waiting.
    The calls are counted in C{calls}.
    """
    calls: dict[str, int] = {}
    state = SimpleNamespace(
        failing=set(), used=used_mib, xids=list(xids or []), events_broken=False
    )

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)

        return call

    def memory(handle: int) -> Any:
        if handle in state.failing:
            raise _NVMLError(15)
        return SimpleNamespace(total=80 * 1024**3, used=state.used * 1024**2)

    def wait(events: Any, timeout_ms: int) -> Any:
        if state.events_broken:
            raise _NVMLError(999)
        if not state.xids:
            raise _NVMLError(10)
        index, xid = state.xids.pop(0)
        return SimpleNamespace(device=index, eventType=0x8, eventData=xid)

    module = SimpleNamespace(
        NVMLError=_NVMLError,
        calls=calls,
        state=state,
        nvmlInit=counted("init", lambda: None),
        nvmlShutdown=counted("shutdown", lambda: None),
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=counted("memory", memory),
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlDeviceGetIndex=lambda h: h,
        nvmlEventSetCreate=lambda: object(),
        nvmlDeviceRegisterEvents=lambda h, kinds, events: None,
        nvmlEventSetWait_v2=wait,
    )
    return module


def _no_nvml() -> Any:
    raise RuntimeError("pynvml is not installed")


class GpuMonitorTests(SynchronousTestCase):
    """
    NVML initialised once and read off the heartbeat's path; its errors and
    Xid events become the GPUs' problems.  (A fake C{pynvml}: no GPU here.)
    """

    def setUp(self) -> None:
        self.nvml = fake_nvml()
        self.gpus, started = discover("n1", [("sim", 8.0)], lambda: self.nvml)
        assert started is not None
        self.started: Nvml = started
        self.pending: list[tuple[Callable[[], Any], Deferred[Any]]] = []
        self.monitor = GpuMonitor(self.gpus, started, self.in_thread)

    def in_thread(self, call: Callable[[], Any]) -> Deferred[Any]:
        """
        Hold the call, as a thread not yet run; L{run_threads} runs them.
        """
        d: Deferred[Any] = Deferred()
        self.pending.append((call, d))
        return d

    def run_threads(self) -> None:
        pending, self.pending = self.pending, []
        for call, d in pending:
            maybeDeferred(call).chainDeferred(d)

    def usage(self, message: pb.Heartbeat) -> dict[int, tuple[int, list[str]]]:
        return {
            g.index: (g.memory_used_mib, list(g.new_problems)) for g in message.gpus
        }

    def test_discover(self) -> None:
        """
        NVML's GPUs, then the simulated ones after them.
        """
        self.assertEqual(
            [(g.index, g.name, g.simulated) for g in self.gpus],
            [(0, "NVIDIA H200", False), (1, "NVIDIA H200", False), (2, "sim", True)],
        )
        self.assertEqual(self.gpus[0].memory_total_mib, 80 * 1024)
        gpus, none = discover("n1", [("sim", 8.0)], _no_nvml)
        self.assertIsNone(none)
        self.assertEqual([g.index for g in gpus], [0])

    def test_heartbeat_does_not_call_nvml(self) -> None:
        """
        A heartbeat answers from the last reading and asks for another in
        a thread, one at a time; NVML is initialised once, never shut down
        between heartbeats.
        """
        memory_calls = self.nvml.calls["memory"]
        self.nvml.state.used = 300
        first = self.monitor.heartbeat()
        self.assertEqual(self.nvml.calls["memory"], memory_calls)
        self.assertEqual(self.usage(first)[0], (100, []))
        self.monitor.heartbeat()
        self.assertEqual(len(self.pending), 1)
        self.run_threads()
        self.assertEqual(self.nvml.calls["memory"], memory_calls + 2)
        self.assertEqual(self.usage(self.monitor.heartbeat())[0], (300, []))
        self.run_threads()
        self.assertEqual(self.nvml.calls["init"], 1)
        self.assertNotIn("shutdown", self.nvml.calls)

    def test_problems_reported_once(self) -> None:
        """
        A failed NVML call for a GPU and a critical Xid are new problems of
        that GPU in the next heartbeat, once; an application's Xid is not;
        the Register after a reconnect carries them all.
        """
        self.nvml.state.failing.add(1)
        self.nvml.state.xids += [(0, 79), (0, 31)]
        self.monitor.heartbeat()
        self.run_threads()
        usage = self.usage(self.monitor.heartbeat())
        self.assertEqual(usage[0], (100, ["xid 79"]))
        self.assertEqual(usage[1], (100, ["nvml memory info: error 15"]))
        self.assertEqual(usage[2], (0, []))
        self.run_threads()
        usage = self.usage(self.monitor.heartbeat())
        self.assertEqual([usage[0][1], usage[1][1]], [[], []])
        self.assertEqual(list(self.gpus[0].problems), ["xid 79"])
        self.assertEqual(list(self.gpus[1].problems), ["nvml memory info: error 15"])

    def test_event_error_logged_on_the_reactor_thread(self) -> None:
        """
        An NVML event read that fails (not a timeout) is logged when the
        reading is applied, on the reactor thread, not from the thread
        that read it (twisted.logger's observers are not for other
        threads).
        """
        self.nvml.state.events_broken = True
        self.monitor.heartbeat()
        with capturedLogs() as events:
            ((call, d),) = self.pending
            self.pending = []
            result = call()
        self.assertEqual(events, [])
        with capturedLogs() as events:
            d.callback(result)
        self.assertEqual(
            [formatEvent(e) for e in events], ["reading NVML events: error 999"]
        )

    def test_processes_managed_or_not(self) -> None:
        """
        The heartbeat lists NVML's compute and graphics processes on each
        GPU, one row per pid: those in an engine's session are managed;
        others (a pid of another namespace too) hold what placement may not
        use, C{foreign_used_mib}.
        """
        engine = os.getpid()  # this process's session stands for an engine's
        session = os.getsid(engine)
        listed = {
            0: [
                SimpleNamespace(pid=engine, usedGpuMemory=60 * 1024**3),
                SimpleNamespace(pid=2**22 + 1, usedGpuMemory=30 * 1024**3),
            ]
        }
        self.nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: listed.get(h, [])
        self.nvml.nvmlDeviceGetGraphicsRunningProcesses = lambda h: [
            SimpleNamespace(pid=engine, usedGpuMemory=None)
        ]
        monitor = GpuMonitor(
            self.gpus,
            self.started,
            self.in_thread,
            sessions=lambda: frozenset({session}),
        )
        monitor.heartbeat()
        self.run_threads()
        by_index = {g.index: g for g in monitor.heartbeat().gpus}
        self.assertEqual(
            [(p.pid, p.used_mib, p.managed) for p in by_index[0].processes],
            [(engine, 60 * 1024, True), (2**22 + 1, 30 * 1024, False)],
        )
        self.assertEqual(by_index[0].foreign_used_mib, 30 * 1024)
        self.assertEqual(
            [(p.pid, p.used_mib) for p in by_index[1].processes], [(engine, 0)]
        )
        self.assertEqual(by_index[1].foreign_used_mib, 0)
        self.assertEqual((by_index[2].processes, by_index[2].foreign_used_mib), ([], 0))

    def test_processes_unreadable_logged_once(self) -> None:
        """
        A GPU whose processes NVML cannot list keeps its last list, and the
        reason is logged once, not at every heartbeat.
        """

        def broken(handle: int) -> Any:
            raise _NVMLError(999)

        self.nvml.nvmlDeviceGetComputeRunningProcesses = broken
        with capturedLogs() as events:
            for _ in range(3):
                self.monitor.heartbeat()
                self.run_threads()
        lines = [formatEvent(e) for e in events]
        self.assertEqual(
            lines,
            ["nvmlDeviceGetComputeRunningProcesses: error 999"],
        )
        self.assertEqual(list(self.monitor.heartbeat().gpus[0].processes), [])

    def test_without_nvml(self) -> None:
        """
        Simulated GPUs only: heartbeats with no reading asked for.
        """
        gpus, nvml = discover("n1", [("sim", 8.0)], _no_nvml)
        self.assertIsNone(nvml)
        monitor = GpuMonitor(gpus, None, self.in_thread)
        self.assertEqual(self.usage(monitor.heartbeat()), {0: (0, [])})
        self.assertEqual(self.pending, [])
