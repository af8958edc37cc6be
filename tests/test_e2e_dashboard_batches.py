"""
The dashboard's batches page (issue on Files and Batches, item 6) in a
real headless Chromium (L{tests.test_e2e_dashboard}'s), served by C{twistd
llmgw-server} with the batches of L{tests.test_e2e_ctl_batches}: two in
progress (C{team}'s of 5 lines, C{ops}'s of 3) and one completed.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from tests.test_e2e_ctl_batches import _Batches
from tests.test_e2e_dashboard import CHROMIUM, FLAGS, _browser_or_skip, _screens


class BatchesOnTheDashboardTests(_Batches, SynchronousTestCase):
    timeout = 120

    def test_batches_page(self) -> None:
        """
        The header's "Batches" link opens the page; it lists the batches
        not over (the completed one not among them), the oldest first,
        each with its key, endpoint, status, lines by state and progress
        (an empty bar); all their lines by state; the batch tokens a
        second card (0/s: nothing ran).  Once one is cancelled (C{llmgw
        ctl}) and so over, the page's own refresh takes its row away,
        without a reload.
        """
        sync_api = _browser_or_skip()
        self.start_with_batches()
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
        page.click("nav >> text=Batches")
        page.wait_for_url("**/batches")
        # The store is read every 5 s: the seeded batches appear then.
        page.wait_for_selector('tr[data-batch="batch_ops"]', timeout=15_000)
        rows = page.locator("#batches tr[data-batch]")
        self.assertEqual(
            [rows.nth(i).get_attribute("data-batch") for i in range(rows.count())],
            ["batch_team", "batch_ops"],
        )
        team = page.locator('tr[data-batch="batch_team"]')
        cells = [c.strip() for c in team.locator("td").all_inner_texts()]
        self.assertEqual(
            cells[:4], ["batch_team", "team", "/v1/chat/completions", "in_progress"]
        )
        # Pending, or claimed by the runner (none can be answered).
        pending, running, done, failed, total = map(int, cells[4:9])
        self.assertEqual((pending + running, done, failed, total), (5, 0, 0, 5))
        self.assertEqual(cells[9], "0/5 · 0%")
        self.assertEqual(
            team.locator("td.progress i").evaluate(
                "bar => bar.getBoundingClientRect().width"
            ),
            0,
        )
        states = dict(
            (state, int(count))
            for state, count in (
                badge.rsplit(" ", 1)
                for badge in page.locator("#batch-lines .st").all_inner_texts()
            )
        )
        self.assertEqual(states["pending"] + states["running"], 8)
        self.assertEqual(page.inner_text("#card-batch-tokens .big"), "0/s")
        page.screenshot(path=os.path.join(_screens(), "batches.png"), full_page=True)
        self.ctl("batches", "cancel", "batch_team")
        # Cancelled, it is over: the page's own refresh takes it away.
        team.wait_for(state="detached", timeout=20_000)
        self.assertEqual(page.locator("#batches tr[data-batch]").count(), 1)
        self.assertIn("cancelled 0", page.inner_text("#batch-lines"))
