"""
One set of numbers whatever the process layout (docs/metrics.md, "Router
workers and tiers"): a C{twistd -n llmgw-server} whose client traffic is
served by its C{--router-workers 2}, and one followed by two C{twistd
llmgw-router}s, in front of one C{llmgw sim}; Debian's Prometheus scraping
the server's metrics-only listener reads every request the routers
served and every error, and the dashboard on the admin listener shows the
rate and the 5xx share.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

from twisted.trial.unittest import SynchronousTestCase

from tests import prometheus_support
from tests.support import Process, Processes, free_port, http
from tests.test_e2e_fleet_metrics import samples, values
from tests.test_e2e_tier import spawn_router

MODEL = "sim-model"

REQUESTS = 60
"""
Requests per round; every tenth asks the engine for a 500 (never two in
a row, so that no replica is ejected).
"""

SCRAPE = """
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: llmgw
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


def chat(url: str, fail: bool) -> int:
    """
    @return: the status of one chat completion through C{url}; the engine
        answers 500 when C{fail}.
    """
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    if fail:
        body["llmgw_sim"] = {"status": 500}
    status, _, _ = http(
        "POST",
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    return status


def card(page: str, name: str) -> str:
    """
    @return: the big figure of the overview's card C{name} (C{rate},
        C{errors}).
    """
    match = re.search(
        rf'id="card-{name}".*?<div class="big">([^<]*)</div>', page, re.DOTALL
    )
    assert match is not None, page[:2000]
    return match.group(1)


class TierMetricsTests(Processes, SynchronousTestCase):
    """
    The server's C{/metrics}, metrics listener and dashboard count the
    traffic its routers serve.
    """

    timeout = 120

    def serve(self, *args: str) -> tuple[Process, str, str, str]:
        """
        @return: the server, its client API's and admin API's base URLs,
            and its metrics listener's C{HOST:PORT}.
        """
        _, sim = self.start_sim()
        port = free_port()
        server, url, admin = self.start_server(
            "--endpoint",
            f"e1={sim}={MODEL}",
            "--metrics-listen",
            f"tcp:{port}:interface=127.0.0.1",
            *args,
        )
        return server, url, admin, f"127.0.0.1:{port}"

    def send(self, urls: list[str], count: int) -> None:
        """
        C{count} chats, each tenth failing, spread over C{urls} in turn;
        each answered with the engine's status.
        """
        statuses = [chat(urls[i % len(urls)], i % 10 == 9) for i in range(count)]
        errors = count // 10
        self.assertEqual(
            sorted(statuses), [200] * (count - errors) + [500] * errors, statuses
        )

    def read(
        self, prometheus: prometheus_support.PrometheusServer, query: str, want: str
    ) -> None:
        """
        Wait (at most 30 s) until C{query} reads C{want} in Prometheus.
        """
        deadline = time.monotonic() + 30
        result = prometheus.query(query)
        while not (result and result[0]["value"][1] == want):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{query} is not {want} within 30 s: {result}\n"
                    f"up: {prometheus.query('up')}\n{prometheus.log()[-2000:]}"
                )
            time.sleep(0.25)
            result = prometheus.query(query)

    def counted(
        self,
        prometheus: prometheus_support.PrometheusServer,
        admin: str,
        requests: int,
    ) -> None:
        """
        Prometheus reads C{requests} requests and a tenth of them answered
        500 for the model, and so does the admin listener's C{/metrics},
        which C{promtool check metrics} passes.
        """
        errors = requests // 10
        total = f'sum(llmgw_requests_total{{model="{MODEL}"}})'
        self.read(prometheus, total, str(requests))
        failed = f'sum(llmgw_requests_total{{model="{MODEL}",status="500"}})'
        self.read(prometheus, failed, str(errors))
        found = values(samples(admin), "llmgw_requests_total")
        mine = {
            dict(k)["status"]: v
            for k, v in found.items()
            if (MODEL in dict(k).values())
        }
        self.assertEqual(
            (mine.get("200"), mine.get("500")), (requests - errors, errors), found
        )
        # The routers' samples merged in keep the scrape well-formed.
        _, _, body = http("GET", admin + "/metrics")
        self.assertEqual(prometheus_support.check_metrics(body), (0, ""))

    def assert_dashboard(self, admin: str) -> None:
        """
        The dashboard's overview shows a rate above 0 and a 5xx share of
        10 % over its last minute.
        """
        status, _, body = http("GET", admin + "/")
        self.assertEqual(status, 200, body[:300])
        page = body.decode()
        self.assertGreater(float(card(page, "rate")), 0.0, card(page, "rate"))
        self.assertEqual(card(page, "errors"), "10.0%")

    def test_router_workers(self) -> None:
        """
        With C{--router-workers 2}, Prometheus scraping the server's
        metrics listener reads the 60 requests and 6 errors the workers
        served, as the admin listener's C{/metrics} does, and the dashboard
        shows their rate and 10 % errors.  A worker killed with SIGKILL and
        started again resets nothing: 10 more requests read 70 and 7, and
        Prometheus sees no counter reset.
        """
        server, url, admin, target = self.serve("--router-workers", "2")
        server.wait_for(r"(?s)following the control plane.*following the control")
        prometheus = prometheus_support.start_prometheus(
            self, SCRAPE.format(port=target.split(":")[1])
        )
        self.send([url], REQUESTS)
        self.counted(prometheus, admin, REQUESTS)
        self.assert_dashboard(admin)

        match = re.search(r"router worker 1 started: pid (\d+)", server.output())
        assert match is not None
        os.kill(int(match.group(1)), signal.SIGKILL)
        again = server.wait_for(
            r"router worker 1 started: pid \d+\n(?s:.*)"
            r"router worker 1 started: pid (\d+)"
        )
        server.wait_for(rf"listening on [\d.]+:\d+ \(pid {again.group(1)}\)")
        self.send([url], 10)
        self.counted(prometheus, admin, REQUESTS + 10)
        resets = f'sum(resets(llmgw_requests_total{{model="{MODEL}"}}[5m]))'
        self.assertEqual(prometheus.query(resets)[0]["value"][1], "0")

    def test_tier_of_two_routers(self) -> None:
        """
        With two C{llmgw-router}s following the server, the requests they
        served in turn are read by Prometheus on the server's metrics
        listener, 60 and 6 errors, and shown on its dashboard; the report
        route refuses a body that is no report with a 400.
        """
        server, _, admin, target = self.serve()
        routers = [spawn_router(self, admin, f"router-{n}") for n in (1, 2)]
        for router, _ in routers:
            router.wait_for(r"following the control plane: version \d+, 1 endpoints")
        prometheus = prometheus_support.start_prometheus(
            self, SCRAPE.format(port=target.split(":")[1])
        )
        self.send([u for _, u in routers], REQUESTS)
        self.counted(prometheus, admin, REQUESTS)
        self.assert_dashboard(admin)
        # A body that is no report is refused, naming what is wrong.
        status, _, body = http("POST", admin + "/api/v1/report", b'{"reporter": 1}')
        self.assertEqual(status, 400, body)
        self.assertIn("reporter must be a string", json.loads(body)["error"]["message"])
