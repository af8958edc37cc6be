"""
Fleet metrics, engine load, the metrics-only listener and JSON logs, seen
as an operator sees them: scrapes of a running C{twistd -n llmgw-server}
(with two C{twistd llmgw-agent} on simulated GPUs and C{llmgw sim}
engines, or one static C{llmgw sim} endpoint), compared with the admin API
and the agents' simulated figures.
"""

from __future__ import annotations

import json
import os
import random
import re
import string
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.client import HTTPConnection

import openai
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from twisted.trial.unittest import SynchronousTestCase

from tests.support import Processes, free_port, http
from tests.test_e2e_control import MODELS, _Fleet

GIB = 1024**3


def samples(base_url: str) -> list[Sample]:
    """
    @return: every sample of a scrape of C{base_url}/metrics.
    """
    status, _, body = http("GET", base_url + "/metrics")
    assert status == 200, (status, body[:200])
    return [
        sample
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    ]


def values(found: list[Sample], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """
    @return: the samples named C{name}, by their sorted labels.
    """
    return {tuple(sorted(s.labels.items())): s.value for s in found if s.name == name}


def until_router_reads(
    admin_url: str, replica: str, waiting: int, timeout: float = 10
) -> None:
    """
    Wait (every 50 ms, at most C{timeout} seconds) until the router's own
    reading of C{replica}'s engine, on its admin C{/metrics}, is fresh
    (C{llmgw_engine_load_stale} 0) and shows at least C{waiting} requests
    queued (C{llmgw_engine_requests_waiting}): what its overload room
    decides on, where a fixed sleep only hopes for a poll.

    @raise AssertionError: the time ran out first.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = samples(admin_url)

        def of(name: str, found: list[Sample] = found) -> list[float]:
            return [
                value
                for labels, value in values(found, name).items()
                if ("replica", replica) in labels
            ]

        queued, stale = (
            of("llmgw_engine_requests_waiting"),
            of("llmgw_engine_load_stale"),
        )
        if queued and max(queued) >= waiting and stale and max(stale) == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the router never read {waiting} queued on {replica}")


class FleetMetricsTests(_Fleet, SynchronousTestCase):
    """
    A server with two agents (two simulated H200s each) and two replicas
    of C{chat}.
    """

    def test_fleet_figures(self) -> None:
        """
        A scrape during load shows each GPU's memory as the agents simulate
        it (141 GB per H200, also what C{/api/v1/nodes} says), desired and
        ready per model as C{/api/v1/models} says, nodes and replicas by
        state, engine starts that add up (each a replica known now or a
        failure counted), and each replica's engine load read from its
        C{/metrics};
        the metrics-only listener serves the same and 404 elsewhere; with
        C{--log-format json} every line of the server's output is a JSON
        object and the request lines carry the request's fields.
        """
        metrics_port = free_port()
        config = self.config(MODELS.format(min_replicas=2, idle="60s"))
        config = config.replace(
            "[router]\n", '[router]\nload_poll_interval = "250ms"\n'
        )
        self.server, self.api_url, self.admin_url = self.start_server(
            "--agent-listen",
            f"tcp:{self.agent_port}:interface=127.0.0.1",
            "--metrics-listen",
            f"tcp:{metrics_port}:interface=127.0.0.1",
            "--log-format",
            "json",
            config=config,
            state="server-state",
        )
        self.client = openai.OpenAI(
            base_url=self.api_url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        self.start_agent("gpu-01")
        self.start_agent("gpu-02")
        self.ready(2)

        # Load while scraping: streams held open on the engines.
        stop = threading.Event()
        threads = [
            threading.Thread(target=self._stream_until, args=(stop,)) for _ in range(4)
        ]
        for thread in threads:
            thread.start()

        def stop_clients() -> None:
            stop.set()
            for thread in threads:
                thread.join(30)

        self.addCleanup(stop_clients)

        def load_seen() -> list[Sample] | None:
            found = samples(self.admin_url)
            running = values(found, "llmgw_engine_requests_running")
            return found if len(running) == 2 and sum(running.values()) > 0 else None

        found = self.until(load_seen, 20, "engine load on both replicas")
        stop.set()

        nodes = self.admin("/api/v1/nodes")["nodes"]
        total = values(found, "llmgw_gpu_memory_total_bytes")
        self.assertEqual(len(total), 4)
        for node in nodes:
            for gpu in node["gpus"]:
                key = (("gpu", str(gpu["index"])), ("node", node["id"]))
                self.assertEqual(total[key], 141 * GIB)
                self.assertEqual(total[key], gpu["memory_total_mib"] * 1024**2)
        used = values(found, "llmgw_gpu_memory_used_bytes")
        self.assertEqual(set(used), set(total))
        allocated = values(found, "llmgw_gpu_memory_allocated_bytes")
        self.assertEqual(sum(allocated.values()), 2 * 40 * GIB)

        (model,) = [m for m in self.admin("/api/v1/models")["models"]]
        self.assertEqual(
            values(found, "llmgw_model_replicas_desired")[(("model", "chat"),)],
            model["desired"],
        )
        self.assertEqual(
            values(found, "llmgw_model_replicas_ready")[(("model", "chat"),)],
            model["ready"],
        )
        self.assertEqual(model["ready"], 2)
        self.assertEqual(values(found, "llmgw_nodes")[(("state", "ready"),)], 2)
        self.assertEqual(
            values(found, "llmgw_replicas")[(("model", "chat"), ("state", "ready"))], 2
        )
        # Starts are not a fixed figure: on a loaded machine a node may miss
        # its heartbeats past lost_after, and its replica is failed and
        # started anew.  What holds is the plane's ledger: at least the two
        # ready replicas were started, and each start is a replica known now
        # (in any state) or a failure counted (nothing drains here: desired
        # stays 2), so no start is made for nothing.
        chat = (("model", "chat"),)
        starts = values(found, "llmgw_engine_starts_total")[chat]
        failures = values(found, "llmgw_engine_failures_total").get(chat, 0)
        known = sum(
            count
            for labels, count in values(found, "llmgw_replicas").items()
            if dict(labels)["model"] == "chat"
        )
        self.assertGreaterEqual(starts, 2)
        self.assertEqual(starts, known + failures, (starts, known, failures))
        available = values(found, "llmgw_engine_metrics_available")
        self.assertEqual(list(available.values()), [1.0, 1.0])
        self.assertEqual(
            sorted(dict(k)["replica"] for k in available),
            sorted(r["id"] for r in self.replicas()),
        )
        self.assertIn("llmgw_reconcile_pass_seconds_count", {s.name for s in found})
        self.assertIn("llmgw_usage_records_pending", {s.name for s in found})

        # The metrics-only listener: the same families, nothing else.
        only = f"http://127.0.0.1:{metrics_port}"
        names = {s.name for s in samples(only)}
        self.assertIn("llmgw_gpu_memory_total_bytes", names)
        self.assertIn("llmgw_requests_in_flight", names)
        for path in ("/", "/api/v1/nodes", "/healthz", "/metrics/x", "/v1/models"):
            status, _, _ = http("GET", only + path)
            self.assertEqual(status, 404, path)
        self.assertEqual(http("POST", only + "/metrics", b"")[0], 405)
        self.assertEqual(http("GET", self.admin_url + "/metrics")[0], 200)

        # JSON logs: every line an object; the request lines have fields.
        for thread in threads:
            thread.join(30)
        answer = self.client.chat.completions.with_raw_response.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        request_id = answer.headers["x-request-id"]

        def request_line() -> dict[str, object] | None:
            for event in self._json_lines():
                if event.get("request_id") == request_id:
                    return event
            return None

        event = self.until(request_line, 10, "the request's log line")
        self.assertEqual(event["model"], "chat")
        self.assertEqual(event["status"], 200)
        self.assertIn(event["replica"], [r["id"] for r in self.replicas()])
        self.assertIsInstance(event["latency"], float)
        self.assertIn("time_to_first_token", event)
        self.assertIn(f"request {request_id}", str(event["text"]))

    def _json_lines(self) -> Iterator[dict[str, object]]:
        lines = [line for line in self.server.output().splitlines() if line.strip()]
        self.assertGreater(len(lines), 5)
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                self.fail(f"not a JSON line: {line!r}")
            self.assertIsInstance(event, dict)
            yield event

    def _stream_until(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                stream = self.client.chat.completions.create(
                    model="chat",
                    messages=[{"role": "user", "content": "hello"}],
                    max_tokens=40,
                    stream=True,
                )
                for _ in stream:
                    pass
            except Exception:
                time.sleep(0.1)


class SeriesBoundedTests(Processes, SynchronousTestCase):
    """
    What clients send cannot grow the number of series.
    """

    timeout = 300

    def test_random_models_and_users(self) -> None:
        """
        After 2,000 requests naming random models (unknown: 404) and random
        C{user} fields, the scrape has as many sample lines as before.
        """
        _, sim_url = self.start_sim("--itl", "0", model="m")
        _, url, admin_url = self.start_server(
            "--endpoint",
            f"s1={sim_url}=m",
            config='[router]\nload_poll_interval = "100ms"\n',
        )

        def post(connection: HTTPConnection, model: str) -> int:
            body = json.dumps(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 1,
                    "user": _word(),
                }
            )
            connection.request(
                "POST",
                "/v1/chat/completions",
                body,
                {"content-type": "application/json", "x-request-id": _word()},
            )
            response = connection.getresponse()
            response.read()
            return response.status

        address = urllib.parse.urlsplit(url)
        assert address.hostname is not None
        hostname = address.hostname
        warm = HTTPConnection(hostname, address.port, timeout=30)
        # Each kind once, so that every series exists before counting.
        self.assertEqual(post(warm, "m"), 200)
        self.assertEqual(post(warm, "unknown-" + _word()), 404)
        time.sleep(0.5)
        before = len(samples(admin_url))

        def client(count: int, statuses: list[int]) -> None:
            connection = HTTPConnection(hostname, address.port, timeout=30)
            for i in range(count):
                model = "m" if i % 2 else _word()
                statuses.append(post(connection, model))
            connection.close()

        statuses: list[int] = []
        threads = [
            threading.Thread(target=client, args=(500, statuses)) for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(240)
        self.assertEqual(len(statuses), 2000)
        self.assertEqual(statuses.count(200), 1000)
        self.assertEqual(statuses.count(404), 1000)
        found = samples(admin_url)
        self.assertEqual(len(found), before)
        requests = values(found, "llmgw_requests_total")
        self.assertEqual(
            requests[(("model", "other"), ("status", "404"))], 1001, requests
        )


def _word() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=12))


BOARD = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "contrib",
    "grafana",
    "llmgw.json",
)
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("_count", "_sum"),
}


def board_metric_names(board: dict[str, object]) -> set[str]:
    """
    @return: every C{llmgw_...} name the board's queries use.
    """
    names: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            expr = node.get("expr")
            if isinstance(expr, str):
                names.update(re.findall(r"\bllmgw_[a-z0-9_]+", expr))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(board)
    return names


class GrafanaBoardTests(Processes, SynchronousTestCase):
    """
    C{contrib/grafana/llmgw.json} queries only metrics a running server has.
    """

    timeout = 120

    def test_board_names_exist(self) -> None:
        """
        Every metric name in the board's C{expr}s is a family (with its
        type's suffix: C{_total}, C{_bucket}, C{_count}, C{_sum}) in a
        scrape of a running server with one engine.
        """
        with open(BOARD) as f:
            board = json.load(f)
        used = board_metric_names(board)
        self.assertGreater(len(used), 25)
        _, sim_url = self.start_sim("--itl", "0", model="m")
        _, _, admin_url = self.start_server("--endpoint", f"s1={sim_url}=m")
        status, _, body = http("GET", admin_url + "/metrics")
        self.assertEqual(status, 200)
        served: set[str] = set()
        for family in text_string_to_metric_families(body.decode()):
            served.add(family.name)
            served.update(family.name + s for s in SUFFIXES.get(family.type, ()))
        self.assertEqual(sorted(used - served), [])
