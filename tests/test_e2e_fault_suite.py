"""
The fault suite (issue 14): faults replayed on a fleet of real processes
(server, two agents, C{llmgw sim} or stand-in engines, the C{openai}
client), each with its numbers checked and recorded (L{report}, in
C{_trial_temp/fault-suite.jsonl}): requests failed that were not on the
failed part, duplicate engines, seconds to serve again, usage records
lost.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.fault_support import engines_running, report
from tests.support import http, sim_stats
from tests.test_e2e_faults import SIM, STAND_IN, _Faults
from tests.test_e2e_fleet_metrics import samples, values

ADDRESS = {"gpu-01": "127.0.0.1", "gpu-02": "127.0.0.2"}


class FaultSuite(_Faults, SynchronousTestCase):
    def settle(self, replicas: int, timeout: float = 20) -> int:
        """
        Wait until at least C{replicas} replicas are ready, none starting
        or draining, and as many engines run as replicas are ready.

        @return: the duplicate engines then: engines running beyond the
            ready replicas (an engine started twice, or one nothing
            claims).
        """

        def counts() -> tuple[int, int, bool]:
            listed = self.replicas()
            ready = sum(1 for r in listed if r["state"] == "ready")
            busy = any(r["state"] in ("starting", "draining") for r in listed)
            return len(engines_running(self.dir)), ready, busy

        def settled() -> bool:
            engines, ready, busy = counts()
            return ready >= replicas and not busy and engines == ready

        try:
            self.until(settled, timeout, f"{replicas} engines and replicas")
        except AssertionError:
            pass
        engines, ready, _ = counts()
        return engines - ready

    def test_engine_killed_mid_stream(self) -> None:
        """
        kill -9 of an engine during a stream: the client gets an error
        event within 1 s; the replica is replaced after the backoff (1 s);
        requests to the other replica all succeed; no duplicate engine.
        """
        self.fleet(
            SIM.format(low=2, args='["--itl", "0.05"]'),
            "gpu-01",
            "gpu-02",
            startup_grace="6s",
        )
        ready = self.ready(2)
        chunks: list[str] = []
        errors: list[Any] = []
        thread = threading.Thread(target=self.stream, args=(2000, chunks, errors))
        thread.start()
        self.until(lambda: len(chunks) >= 3, 10, "the stream started")
        (victim,) = [
            r
            for r in ready
            if sim_stats(
                f"http://{ADDRESS[r['shards'][0]['node']]}:{r['shards'][0]['port']}"
            )["running"]
        ]
        stop, failures, served = self.background()
        time.sleep(1)
        killed = time.monotonic()
        os.killpg(victim["shards"][0]["pid"], signal.SIGKILL)
        thread.join(10)
        ((ended, error),) = errors
        ids = {r["id"] for r in ready}
        self.until(
            lambda: (
                len(
                    [
                        r
                        for r in self.ready(2)
                        if r["id"] not in ids and r["state"] == "ready"
                    ]
                )
                == 1
            ),
            30,
            "the replica replaced",
        )
        replaced = time.monotonic() - killed
        time.sleep(1)
        stop.set()
        duplicates = self.settle(2)
        report(
            "kill -9 of an engine mid-stream",
            seconds_to_error_event=round(ended - killed, 2),
            seconds_to_replaced=round(replaced, 2),
            failed_not_on_failed_part=len(failures),
            served_meanwhile=served[0],
            duplicate_engines=duplicates,
        )
        self.assertLess(ended - killed, 1.0)
        # A short request in flight on the killed engine is on the failed
        # part; none other may fail.
        self.assertLessEqual(len(failures), 1, failures)
        self.assertEqual(duplicates, 0)

    def test_agent_stopped_past_lost_after(self) -> None:
        """
        SIGSTOP of an agent for longer than lost_after (6 s), then SIGCONT:
        its node goes lost and its replica is placed again on the other
        node; once the agent is back, the fleet settles to 2 engines for 2
        replicas; requests keep being served.
        """
        self.fleet(SIM.format(low=2, args="[]"), "gpu-01", "gpu-02", startup_grace="6s")
        self.ready(2)
        stop, failures, served = self.background()
        agent = self.agents["gpu-01"].popen.pid
        os.kill(agent, signal.SIGSTOP)
        self.addCleanup(os.kill, agent, signal.SIGCONT)
        stopped = time.monotonic()

        def lost() -> bool:
            nodes = self.admin("/api/v1/nodes")["nodes"]
            return any(n["id"] == "gpu-01" and n["state"] == "lost" for n in nodes)

        self.until(lost, 20, "gpu-01 lost")
        time.sleep(2)
        os.kill(agent, signal.SIGCONT)
        self.until(
            lambda: [
                n
                for n in self.admin("/api/v1/nodes")["nodes"]
                if n["id"] == "gpu-01" and n["state"] == "ready"
            ],
            20,
            "gpu-01 back",
        )
        back = time.monotonic() - stopped
        duplicates = self.settle(2, 30)
        time.sleep(1)
        stop.set()
        report(
            "SIGSTOP of an agent past lost_after, then SIGCONT",
            seconds_stopped_until_back=round(back, 2),
            failed_not_on_failed_part=len(failures),
            served_meanwhile=served[0],
            duplicate_engines=duplicates,
        )
        # The engine on the stopped node kept serving: nothing failed.
        self.assertLessEqual(len(failures), 1, failures)
        self.assertEqual(duplicates, 0)

    def test_server_killed_during_streams(self) -> None:
        """
        kill -9 of the server while 20 streams and a run of short requests
        go on: the streams break (they were on the failed part); restarted
        on its state, the server adopts its engines (no duplicate) and
        serves again.  Of the short requests that had finished before the
        kill, at most those of the last flush interval (1 s) lack a usage
        record; the 20 streams cut by the kill have none.
        """
        config = self.config(
            SIM.format(low=1, args='["--itl", "0.05"]'), startup_grace="3s"
        )
        self.start_fleet_server(config)
        self.start_agent("gpu-01")
        self.ready(1)
        finished: list[float] = []
        stop = threading.Event()

        def short() -> None:
            while not stop.is_set():
                try:
                    self.chat()
                    finished.append(time.monotonic())
                except Exception:
                    return

        runner = threading.Thread(target=short)
        runner.start()
        self.addCleanup(runner.join, 30)
        self.addCleanup(stop.set)
        streams: list[tuple[list[str], list[Any]]] = []
        threads = []
        for _ in range(20):
            chunks: list[str] = []
            errors: list[Any] = []
            streams.append((chunks, errors))
            thread = threading.Thread(target=self.stream, args=(400, chunks, errors))
            thread.start()
            threads.append(thread)
        self.until(lambda: all(c for c, _ in streams), 20, "20 streams flowing")
        time.sleep(1)
        self.server.popen.kill()
        self.server.popen.wait(10)
        killed = time.monotonic()
        stop.set()
        runner.join(20)
        for thread in threads:
            thread.join(20)
        broken = sum(1 for _, e in streams if e)
        self.start_fleet_server(config)
        seconds = self.serve_again(killed)
        duplicates = self.settle(1)
        status, _, body = http("GET", self.admin_url + "/api/v1/usage?by=model")
        self.assertEqual(status, 200, body)
        recorded = sum(
            g["requests"] for g in json.loads(body)["usage"] if g["model"] == "chat"
        )
        # The request that found the server back has its record too.
        lost = len(finished) + 1 - recorded
        last_interval = sum(1 for t in finished if t > killed - 1.0)
        report(
            "kill -9 of the server during 20 streams",
            streams_broken=broken,
            seconds_to_serve_again=round(seconds, 2),
            duplicate_engines=duplicates,
            requests_finished_before_kill=len(finished),
            finished_in_last_flush_interval=last_interval,
            usage_records_lost=lost,
            usage_records_lost_note="short requests finished before the kill"
            " without a record; [store] flush_interval is 1 s; the 20 streams"
            " cut by the kill have no record",
        )
        self.assertEqual(broken, 20)
        self.assertGreaterEqual(lost, 0)
        self.assertLessEqual(lost, last_interval)
        self.assertEqual(duplicates, 0)
        self.assertLess(seconds, 15)

    def test_agent_restarted_while_starting(self) -> None:
        """
        The agent restarts while its engine loads (4 s): the new agent
        adopts the loading engine, which becomes ready; no second engine
        is started.
        """
        self.fleet(STAND_IN.format(low=1, args='["--load", "4"]'), "gpu-01")

        def starting() -> list[dict[str, Any]]:
            return [
                r
                for r in self.replicas()
                if r["state"] == "starting" and r["shards"][0]["pid"]
            ]

        (replica,) = self.until(starting, 20, "a replica starting")
        self.agents["gpu-01"].stop()
        restarted = time.monotonic()
        self.start_agent("gpu-01")
        seconds = self.serve_again(restarted)
        duplicates = self.settle(1)
        (now,) = self.ready(1)
        report(
            "agent restart while a replica is starting",
            seconds_to_serve_again=round(seconds, 2),
            duplicate_engines=duplicates,
            same_engine=now["shards"][0]["pid"] == replica["shards"][0]["pid"],
        )
        self.assertEqual(duplicates, 0)
        self.assertEqual(now["id"], replica["id"])

    def test_start_fails_twice_then_succeeds(self) -> None:
        """
        An engine whose first two starts fail: the model backs off (1 s,
        2 s) and a later start serves, one engine; each engine start is one
        of the plane's, and each of those a replica known now or a failure
        counted: three in all, unless a node missed its heartbeats past
        lost_after on a loaded machine and its replica was started anew.
        """
        counter = os.path.join(self.dir, "starts")
        self.fleet(
            STAND_IN.format(
                low=1, args=json.dumps(["--counter", counter, "--fail-times", "2"])
            ),
            "gpu-01",
        )
        began = time.monotonic()
        seconds = self.serve_again(began, 40)
        duplicates = self.settle(1)
        with open(counter) as f:
            starts = int(f.read())
        report(
            "a start that fails twice then succeeds",
            starts=starts,
            seconds_to_serve=round(seconds, 2),
            duplicate_engines=duplicates,
        )
        found = samples(self.admin_url)
        model = (("model", "chat"),)
        placed = values(found, "llmgw_engine_starts_total")[model]
        failures = values(found, "llmgw_engine_failures_total").get(model, 0)
        known = sum(
            count
            for labels, count in values(found, "llmgw_replicas").items()
            if labels[0] == model[0]
        )
        self.assertGreaterEqual(starts, 3)
        self.assertGreaterEqual(failures, 2)
        self.assertEqual((placed, known + failures), (starts, starts))
        self.assertEqual(duplicates, 0)
