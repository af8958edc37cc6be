"""
Swaps on the dashboard (issue 25 item 5) in a real headless Chromium
(L{tests.test_e2e_dashboard}'s), served by C{twistd llmgw-server} with one
C{twistd llmgw-agent} on one simulated 80 GB GPU and C{llmgw sim} engines:
models C{a} and C{b} of 60 GB each, so that a request for C{b} evicts C{a}.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from tests.support import http
from tests.test_e2e_dashboard import CHROMIUM, FLAGS, _browser_or_skip, _screens
from tests.test_e2e_swap import _Swaps, model


class SwapsOnTheDashboardTests(_Swaps, SynchronousTestCase):
    timeout = 240

    def test_pinned_and_swaps_shown(self) -> None:
        """
        After C{a} was evicted for C{b} and C{b} was pinned: the overview's
        models table marks C{b} pinned (not C{a}) and counts one swap for
        C{a} (its title says why: evicted), none for C{b}; C{a}'s page
        says it was swapped out once, evicted; replica states keep their
        own style (C{.st.ready} styled, and C{.st.sleeping} and
        C{.st.waking} styles differ from every other state's).
        """
        sync_api = _browser_or_skip()
        self.setup_fleet(model("a") + model("b"))
        self.assertTrue(self.chat("a"))
        self.assertTrue(self.chat("b"))
        status, _, body = http("POST", self.admin_url + "/api/v1/models/b/pin", b"")
        self.assertEqual(status, 200, body)
        playwright = sync_api.sync_playwright().start()
        self.addCleanup(playwright.stop)
        profile = tempfile.mkdtemp(prefix="llmgw-chromium-")
        self.addCleanup(shutil.rmtree, profile, True)
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=FLAGS
        )
        self.addCleanup(context.close)
        page = context.pages[0] if context.pages else context.new_page()
        page.set_default_timeout(20_000)
        page.goto(self.admin_url + "/")
        row_a = page.locator('#models tr[data-model="a"]')
        row_b = page.locator('#models tr[data-model="b"]')
        self.assertEqual(row_b.locator(".pin").inner_text(), "pinned")
        self.assertEqual(row_a.locator(".pin").count(), 0)
        self.assertEqual(row_a.locator("td.swaps").inner_text(), "1")
        self.assertIn("evicted 1", row_a.locator("td.swaps").get_attribute("title"))
        self.assertEqual(row_b.locator("td.swaps").inner_text(), "0")
        page.screenshot(
            path=os.path.join(_screens(), "swaps-overview.png"), full_page=True
        )
        colours = page.evaluate(
            """() => ["ready", "starting", "draining", "failed", "sleeping",
                      "waking", "unknown"].map(state => {
                const span = document.createElement("span");
                span.className = "st " + state;
                document.body.appendChild(span);
                const colour = getComputedStyle(span).backgroundColor;
                span.remove();
                return colour;
            })"""
        )
        self.assertEqual(len(set(colours)), len(colours), colours)
        page.goto(self.admin_url + "/models/a")
        self.assertIn("evicted 1", page.locator("#swaps").inner_text())
        page.goto(self.admin_url + "/models/b")
        self.assertEqual(page.locator("h1 .pin").inner_text(), "pinned")
