"""
The dashboard's numbers in a real headless Chromium (as
L{tests.test_e2e_dashboard}): C{twistd llmgw-server}, two C{twistd
llmgw-agent} with two simulated 80 GB GPUs each and labels, and C{llmgw
sim} engines for two models, one of 2 x 20 GB replicas and one of a
2-GPU replica at 40 GB per GPU.  Read from the pages as an operator
reads them and checked against what the harness sent and what
C{/metrics} says.

Screenshots under load go to C{$LLMGW_SCREENSHOTS} (as the other browser
tests' do).
"""

from __future__ import annotations

import math
import random
import re
import shutil
import tempfile
import threading
import time

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import http
from tests.test_e2e_control import _Fleet
from tests.test_e2e_dashboard import CHROMIUM, FLAGS, _browser_or_skip, _screens

AGENT = """
address = "{address}"
[labels]
rack = "{rack}"
zone = "lab"
[[simulated_gpus]]
name = "A100"
memory_gb = 80
[[simulated_gpus]]
name = "A100"
memory_gb = 80
"""

# The 2-GPU model first: placed first, it finds a whole node.
MODELS = """
[[models]]
name = "big"
min_replicas = 1
max_replicas = 1
idle_timeout = "1h"
[[models.profiles]]
name = "two-a100"
engine = "sim"
source = "sim"
gpus = 2
gpu_memory_gb = 40
args = ["--ttft", "0.3", "--itl", "0.01"]

[[models]]
name = "small"
min_replicas = 2
max_replicas = 2
idle_timeout = "1h"
[[models.profiles]]
name = "one-a100"
engine = "sim"
source = "sim"
gpus = 1
gpu_memory_gb = 20
args = ["--ttft", "0.05", "--itl", "0.01"]
"""

ERRORS = 0.1
"""
The share of each model's requests that ask for a 500: drawn at random
(seeded), a steady 10 % over a minute and a noisy one over 5 s.
"""


class _Load:
    """
    Streams to one model at a steady C{rate} per second from a thread;
    each asks the sim engine for a 500 (C{llmgw_sim}, which the client
    sees as a 5xx) with probability L{ERRORS}.

    @ivar done: C{(monotonic end, ok, seconds to the first chunk)} per
        request.
    """

    def __init__(self, client: openai.OpenAI, model: str, rate: float) -> None:
        self.client = client
        self.model = model
        self.period = 1 / rate
        self.done: list[tuple[float, bool, float | None]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.random = random.Random(model)

    def _one(self, k: int) -> None:
        fault = {"llmgw_sim": {"status": 500}} if self.random.random() < ERRORS else {}
        started = time.monotonic()
        first: float | None = None
        ok = True
        try:
            stream = self.client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": f"hello {k}"}],
                max_tokens=4,
                stream=True,
                extra_body=fault,
            )
            for _ in stream:
                if first is None:
                    first = time.monotonic() - started
        except openai.APIError:
            ok = False
        self.done.append((time.monotonic(), ok, first))

    def _run(self) -> None:
        start = time.monotonic()
        k = 0
        while not self.stop.is_set():
            self._one(k)
            k += 1
            wait = start + k * self.period - time.monotonic()
            if wait > 0:
                self.stop.wait(wait)

    def since(self, seconds: float) -> list[tuple[float, bool, float | None]]:
        cut = time.monotonic() - seconds
        return [d for d in list(self.done) if d[0] >= cut]


def _percent(text: str) -> float:
    match = re.search(r"([\d.]+)%", text)
    assert match is not None, text
    return float(match.group(1))


def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+) (ms|s)", text.strip())
    assert match is not None, text
    return float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)


class DashboardNumbersTests(_Fleet, SynchronousTestCase):
    timeout = 400

    def setUp(self) -> None:
        sync_api = _browser_or_skip()
        super().setUp()
        self.start_fleet_server(self.config(MODELS, startup_grace="6s"))
        for node, rack in (("gpu-01", "r1"), ("gpu-02", "r2")):
            self.start_agent(node, AGENT.replace("{rack}", rack))
        self.until(
            lambda: (
                sum(
                    1
                    for r in self.admin("/api/v1/replicas")["replicas"]
                    if r["state"] == "ready"
                )
                == 3
            ),
            60,
            "3 ready replicas (big, 2 x small)",
        )
        self.playwright = sync_api.sync_playwright().start()
        self.addCleanup(self.playwright.stop)
        profile = tempfile.mkdtemp(prefix="llmgw-chromium-")
        self.addCleanup(shutil.rmtree, profile, True)
        self.context = self.playwright.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            viewport={"width": 1400, "height": 900},
        )
        self.addCleanup(self.context.close)
        self.page = (
            self.context.pages[0] if self.context.pages else self.context.new_page()
        )
        self.page.set_default_timeout(20_000)
        self.screens = _screens()
        self.expect = sync_api.expect

    def shot(self, name: str) -> None:
        self.page.screenshot(path=f"{self.screens}/{name}", full_page=True)

    def allocated_by_metrics(self) -> dict[tuple[str, int], float]:
        """
        @return: GiB per (node, GPU) as C{/metrics} reports it.
        """
        _, _, body = http("GET", self.admin_url + "/metrics")
        found = {}
        for line in body.decode().splitlines():
            match = re.match(
                r'llmgw_gpu_memory_allocated_bytes\{gpu="(\d+)",node="([^"]+)"\}'
                r" (\S+)",
                line,
            )
            if match:
                found[match.group(2), int(match.group(1))] = float(match.group(3))
        return {k: v / 1024**3 for k, v in found.items()}

    def test_gpu_memory(self) -> None:
        """
        Each GPU's bar on the overview and its row on the node page read
        the memory allocated to it (20 GiB for a small replica, 40 for
        each GPU of the big one), as C{llmgw_gpu_memory_allocated_bytes}
        has it, and say "simulated" (nothing measured).
        """
        expected = self.allocated_by_metrics()
        self.assertEqual(sorted(expected.values()), [20.0, 20.0, 40.0, 40.0])
        page = self.page
        page.goto(self.admin_url + "/")
        page.wait_for_selector("[data-node=gpu-02]")
        for node in ("gpu-01", "gpu-02"):
            bars = page.locator(f".nodes [data-node={node}] .gpu").all_inner_texts()
            self.assertEqual(len(bars), 2, bars)
            for index, text in enumerate(bars):
                match = re.search(r"(\d+)/(\d+) GiB", text)
                assert match is not None, text
                self.assertEqual(
                    (float(match.group(1)), match.group(2)),
                    (expected[node, index], "80"),
                    text,
                )
                self.assertIn("allocated", text)
                self.assertIn("simulated", text)
        # The bar's filled part is the allocated share.
        width = page.evaluate(
            "[...document.querySelectorAll('.nodes .gpu b i')].map(i => i.style.width)"
        )
        self.assertEqual(
            sorted(width),
            sorted(f"{round(100 * v / 80)}%" for v in expected.values()),
        )
        self.shot("numbers-overview-idle.png")

        page.goto(self.admin_url + "/nodes/gpu-01")
        for index in (0, 1):
            row = page.locator(f"#gpus tr[data-gpu='{index}']")
            self.assertEqual(
                row.locator("[data-figure=allocated]").inner_text(),
                f"{expected['gpu-01', index]:.1f} GiB",
            )
            self.assertEqual(
                row.locator("[data-figure=used]").inner_text(), "not measured"
            )
            self.assertIn("simulated", row.inner_text())

    def test_node_labels(self) -> None:
        """
        Each node's labels (its agent's C{[labels]}) are on its card on
        the overview and on its page.
        """
        page = self.page
        page.goto(self.admin_url + "/")
        page.wait_for_selector("[data-node=gpu-02]")
        for node, rack in (("gpu-01", "r1"), ("gpu-02", "r2")):
            card = page.locator(f".nodes [data-node={node}]").inner_text()
            self.assertIn(f"rack={rack}", card)
            self.assertIn("zone=lab", card)
        page.goto(self.admin_url + "/nodes/gpu-02")
        self.assertIn("rack=r2", page.inner_text("main"))
        self.assertIn("zone=lab", page.inner_text("main"))

    def test_chart_axes(self) -> None:
        """
        The headline charts have labelled axes: times from -10m to now,
        values from 0.
        """
        page = self.page
        page.goto(self.admin_url + "/")
        page.wait_for_selector("[data-node=gpu-02]")
        charts = page.locator(".cards .card svg")
        self.assertEqual(charts.count(), 3)
        for i in range(3):
            labels = charts.nth(i).locator("text").all_text_contents()
            self.assertIn("-10m", labels)
            self.assertIn("-2m", labels)
            self.assertIn("now", labels)
            self.assertTrue(any(re.match(r"^0(\D|$)", t) for t in labels), labels)

    def test_traffic_under_load(self) -> None:
        """
        Under steady streams (small 4/s, big 1/s, 10 % of each answered
        5xx at random): the headline error rate, stated over the last
        minute, reads the harness's share over that minute at every
        refresh (one 5 s sample of 25 requests strays); the models table
        gives each model's rate and error share over 1 and 5 minutes (the
        harness's own) and a time to first token near its engine's (50 ms,
        300 ms); the model
        page splits small's requests between its two replicas.
        """
        loads = [
            _Load(self.client, "small", 4.0),
            _Load(self.client, "big", 1.0),
        ]
        for load in loads:
            load.thread.start()
        for load in loads:
            self.addCleanup(load.stop.set)
        page = self.page
        page.goto(self.admin_url + "/")
        # A full minute of traffic (and one more slot) before reading.
        time.sleep(66)
        card = page.locator(".card", has=page.locator(".label", has_text="errors"))
        readings = []
        for _ in range(6):
            page.reload()
            text = card.locator(".big").inner_text()
            sent = [d for load in loads for d in load.since(60)]
            share = 100 * sum(1 for d in sent if not d[1]) / len(sent)
            readings.append((_percent(text), share))
            time.sleep(5)
        for shown, share in readings:
            # 300 requests a minute: the share itself is 10 +- 1.7 %.
            self.assertTrue(5.0 <= shown <= 15.0, readings)
            self.assertLess(abs(shown - share), 2.0, readings)
        self.assertIn("last 1 min", card.inner_text())
        self.shot("numbers-overview-load.png")

        rows = {
            name: page.locator(f"#models tr[data-model={name}]")
            for name in ("small", "big")
        }
        for load, rate in zip(loads, (4.0, 1.0), strict=True):
            row = rows[load.model]
            for window, low, seconds in (("1m", 0.75, 60), ("5m", 0.5, 300)):
                # The 5 min window also covers the start, before traffic.
                shown_rate = float(
                    row.locator(f"[data-f='{window}-rate']").inner_text()
                )
                self.assertTrue(
                    low * rate <= shown_rate <= 1.25 * rate,
                    (load.model, window, shown_rate),
                )
                sent = load.since(seconds)
                share = 100 * sum(1 for d in sent if not d[1]) / len(sent)
                shown = _percent(
                    row.locator(f"[data-f='{window}-errors']").inner_text()
                )
                # One request more or less in the window: 100 / len(sent).
                self.assertLess(
                    abs(shown - share),
                    1 + 200 / len(sent),
                    (load.model, window, shown, share, len(sent)),
                )
        big_p50, big_p95 = (
            _ms(t)
            for t in rows["big"].locator("[data-f='1m-ttft']").inner_text().split(" / ")
        )
        small_p50, _ = (
            _ms(t)
            for t in rows["small"]
            .locator("[data-f='1m-ttft']")
            .inner_text()
            .split(" / ")
        )
        # The engines' own first-token delays, plus the way through.
        self.assertTrue(0.28 <= big_p50 <= 0.6, big_p50)
        self.assertTrue(big_p50 <= big_p95 <= 1.0, big_p95)
        self.assertTrue(0.04 <= small_p50 <= 0.3, small_p50)
        firsts = sorted(d[2] for d in loads[1].since(60) if d[1] and d[2])
        client_p50 = firsts[len(firsts) // 2]
        self.assertLess(abs(big_p50 - client_p50), 0.1, (big_p50, client_p50))

        page.goto(self.admin_url + "/models/small")
        replicas = page.locator("#replicas tr[data-replica]")
        self.assertEqual(replicas.count(), 2)
        split = [
            float(replicas.nth(i).locator("[data-f='1m-rate']").inner_text())
            for i in range(2)
        ]
        self.assertTrue(all(r > 0.5 for r in split), split)
        self.assertLess(abs(sum(split) - 4.0), 1.0, split)
        self.assertIn("last 1 min", page.inner_text("#model-traffic"))
        self.assertIn("last 5 min", page.inner_text("#model-traffic"))
        self.shot("numbers-model-small.png")
        page.goto(self.admin_url + "/models/big")
        self.shot("numbers-model-big.png")

        node = next(
            r["shards"][0]["node"]
            for r in self.admin("/api/v1/replicas")["replicas"]
            if r["model"] == "big"
        )
        page.goto(f"{self.admin_url}/nodes/{node}")
        cell = page.locator("#shards [data-f='1m-rate']")
        self.assertTrue(math.isclose(float(cell.first.inner_text()), 1.0, abs_tol=0.3))
        self.shot("numbers-node-big.png")
        other = "gpu-02" if node == "gpu-01" else "gpu-01"
        page.goto(f"{self.admin_url}/nodes/{other}")
        self.shot("numbers-node-small.png")
