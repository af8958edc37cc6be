"""
The dashboard in a real headless Chromium (Debian's C{chromium}, driven by
Playwright's Python package with C{executable_path}; nothing downloaded),
served by C{twistd llmgw-server} with two C{twistd llmgw-agent} on
simulated GPUs and C{llmgw sim} engines (L{tests.test_e2e_control}).

Screenshots of each page go to C{$LLMGW_SCREENSHOTS}, by default
C{screenshots/} in trial's working folder (C{_trial_temp/screenshots}).

Skipped, with a reason naming the package, without C{/usr/bin/chromium}
or Playwright; failed instead when C{CI=true}.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import sys
import tempfile
import urllib.parse
from typing import Any

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from tests.support import http
from tests.test_e2e_control import MODELS, _Fleet

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _browser_or_skip() -> Any:
    """
    @return: Playwright's sync API module.
    @raise SkipTest: no Chromium or no Playwright (outside CI).
    """
    why = None
    if not os.access(CHROMIUM, os.X_OK):
        why = f"{CHROMIUM} not found: install Debian's chromium package"
    try:
        from playwright import sync_api
    except ImportError:
        why = why or "the playwright Python package (test extras) is not installed"
        # Absent: the tests that need it skip.
        sync_api = None  # type: ignore[assignment]
    if why is not None:
        if os.environ.get("CI") == "true":
            raise AssertionError(f"CI runs the browser tests: {why}")
        raise SkipTest(why)
    return sync_api


def _screens() -> str:
    folder = os.environ.get("LLMGW_SCREENSHOTS") or os.path.abspath("screenshots")
    os.makedirs(folder, exist_ok=True)
    return folder


class _Browser(_Fleet):
    """
    A fleet (server, gpu-01 and gpu-02, one ready replica of C{chat}) and a
    fresh Chromium profile per test.
    """

    timeout = 240

    def setUp(self) -> None:
        sync_api = _browser_or_skip()
        super().setUp()
        self.start_fleet_server(self.config(MODELS.format(min_replicas=1, idle="1h")))
        self.start_agent("gpu-01")
        self.start_agent("gpu-02")
        (self.replica,) = self.ready(1)
        self.playwright = sync_api.sync_playwright().start()
        self.addCleanup(self.playwright.stop)
        profile = tempfile.mkdtemp(prefix="llmgw-chromium-")
        self.addCleanup(shutil.rmtree, profile, True)
        self.context = self.playwright.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            viewport={"width": 1280, "height": 900},
        )
        self.addCleanup(self.context.close)
        self.page = (
            self.context.pages[0] if self.context.pages else self.context.new_page()
        )
        self.page.set_default_timeout(20_000)
        self.screens = _screens()
        self.expect = sync_api.expect

    def shot(self, name: str) -> None:
        self.page.screenshot(path=os.path.join(self.screens, name), full_page=True)

    def node_draining(self, node: str) -> bool:
        for row in self.admin("/api/v1/nodes")["nodes"]:
            if row["id"] == node:
                return bool(row["draining"])
        raise AssertionError(f"no node {node}")

    def make_key(self, name: str, admin: bool) -> str:
        status, _, body = http(
            "POST",
            self.admin_url + "/api/v1/keys",
            json.dumps({"name": name, "admin": admin}).encode(),
        )
        self.assertEqual(status, 201, body)
        secret: str = json.loads(body)["key"]
        return secret


class AdminListenerTests(_Browser, SynchronousTestCase):
    def test_pages_drain_and_csrf(self) -> None:
        """
        Every page loads in Chromium from the admin listener and shows the
        fleet (node names, one bar per simulated GPU, replica states); the
        drain button, once confirmed, drains the node on the page and in
        C{/api/v1/nodes}, and not when the confirmation is dismissed; the
        page follows a change made elsewhere without a reload; a POST
        without the CSRF token gets 403.
        """
        page = self.page
        page.goto(self.admin_url + "/")
        page.wait_for_selector("[data-node=gpu-02]")
        self.assertEqual(page.locator("[data-node]").count(), 2)
        self.assertEqual(page.locator(".nodes .gpu").count(), 4)
        # The one replica holds one GPU; each bar says its memory.
        self.assertEqual(page.locator(".nodes .gpu.alloc").count(), 1)
        self.assertIn("/141 GiB", page.inner_text(".nodes"))
        self.assertIn("gpu-01", page.inner_text("main"))
        self.assertIn("ready 1", page.inner_text("#replica-states"))
        self.assertIn("chat", page.inner_text("main"))
        # Traffic reaches the sparklines (sampled every 5 s) and the page
        # shows it by its refresh.
        for _ in range(5):
            self.chat()
        rate = page.locator(".card .big").first
        self.expect(rate).to_have_text(
            re.compile(r"^(?!0\.0$)\d+\.\d$"), timeout=20_000
        )
        self.shot("overview-1280.png")
        page.set_viewport_size({"width": 390, "height": 844})
        self.shot("overview-phone.png")
        # Narrow as a phone, nothing wider than the screen but tables.
        width = page.evaluate("document.querySelector('.nodes').scrollWidth")
        self.assertLessEqual(width, 390)
        page.set_viewport_size({"width": 1280, "height": 900})

        replica = self.replica["id"]
        node = self.replica["shards"][0]["node"]
        page.goto(f"{self.admin_url}/replicas/{replica}")
        self.assertEqual(page.inner_text("#replica-state"), "ready")
        self.assertIn(node, page.inner_text("main"))
        self.assertIn("Engine load", page.inner_text("main"))
        # Its states as the agent reported them, newest first.
        history = page.locator("#history li").all_inner_texts()
        self.assertRegex(history[0], r"ago: ready$")
        self.assertRegex(history[-1], r"ago: starting$")
        self.shot("replica.png")
        page.goto(self.admin_url + "/models/chat")
        self.assertIn("one-h200", page.inner_text("main"))
        self.assertIn(replica, page.inner_text("main"))
        self.shot("model.png")
        page.fill("input[name=max_replicas]", "1")
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("button:has-text('Scale')")
        self.until(
            lambda: self.admin("/api/v1/models")["models"][0]["max_replicas"] == 1,
            10,
            "max_replicas 1 through the scale form",
        )
        page.goto(self.admin_url + "/keys")
        self.shot("keys.png")

        page.goto(f"{self.admin_url}/nodes/{node}")
        self.assertEqual(page.locator("table .gpu").count(), 2)
        self.assertIn("H200", page.inner_text("main"))
        self.assertIn(replica, page.inner_text("main"))
        self.shot("node.png")
        page.once("dialog", lambda dialog: dialog.dismiss())
        page.click("button:has-text('Drain')")
        page.wait_for_timeout(500)
        self.assertEqual(page.inner_text("#node-state"), "ready")
        self.assertFalse(self.node_draining(node))
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("button:has-text('Drain')")
        self.expect(page.locator("#node-state")).to_have_text("draining")
        self.assertTrue(self.node_draining(node))
        # Kept in the store, as through the admin API.
        database = os.path.join(self._directory(), "server-state", "llmgw.db")
        with sqlite3.connect(database) as db:
            rows = db.execute("SELECT node_id FROM node_drains").fetchall()
        db.close()
        self.assertEqual(rows, [(node,)])
        self.shot("node-draining.png")

        # Undrained through the API: the page shows it by its refresh.
        page.evaluate("window.llmgwMarker = 1")
        self.admin(f"/api/v1/nodes/{node}/undrain", "POST")
        self.expect(page.locator("#node-state")).to_have_text("ready", timeout=15_000)
        self.assertEqual(page.evaluate("window.llmgwMarker"), 1)

        cookies = {c["name"]: c for c in self.context.cookies()}
        csrf = cookies["llmgw_csrf"]
        self.assertTrue(csrf["httpOnly"])
        self.assertEqual(csrf["sameSite"], "Strict")
        url = f"{self.admin_url}/nodes/{node}/drain"
        for body in (b"", b"csrf=" + b"x" * 43):
            status, _, _ = http(
                "POST",
                url,
                body,
                {
                    "cookie": f"llmgw_csrf={csrf['value']}",
                    "content-type": "application/x-www-form-urlencoded",
                },
            )
            self.assertEqual(status, 403)
        # Without the page's cookie, its token is no good either.
        status, _, _ = http("POST", url, f"csrf={csrf['value']}".encode())
        self.assertEqual(status, 403)
        self.assertFalse(self.node_draining(node))

        # An engine killed: its agent's report, output tail and all,
        # reaches the overview's failures and the replica's page.
        # (The drain above moved the replica: the one ready now.)
        (current,) = self.ready(1)
        os.killpg(current["shards"][0]["pid"], signal.SIGKILL)
        page.goto(self.admin_url + "/")
        failure = page.locator("details.failure").first
        self.expect(failure).to_contain_text("killed by signal 9", timeout=20_000)
        failure.locator("summary").click()
        self.assertIn("llmgw sim", failure.locator("pre").inner_text())
        self.shot("overview-failure.png")


class ClientListenerTests(_Browser, SynchronousTestCase):
    def test_login(self) -> None:
        """
        On the client listener, C{/admin} sends the browser to a login
        form; a non-admin key is refused; an admin key opens the same
        pages, with an C{HttpOnly}, C{SameSite=Strict} session cookie; no
        key's secret is on any page; a POST without the CSRF token gets
        403; logout ends the session; failed logins are limited per
        address.
        """
        admin_key = self.make_key("ops", True)
        app_key = self.make_key("app", False)
        page = self.page
        base = self.api_url + "/admin"
        page.goto(base + "/")
        self.assertTrue(page.url.endswith("/admin/login"), page.url)
        self.shot("login.png")
        page.fill("input[name=key]", app_key)
        page.click("button:has-text('Log in')")
        self.assertIn("not an admin", page.inner_text("#login-error"))
        page.goto(base + "/")
        self.assertTrue(page.url.endswith("/admin/login"), page.url)

        page.fill("input[name=key]", admin_key)
        page.click("button:has-text('Log in')")
        page.wait_for_selector("[data-node=gpu-01]")
        self.assertEqual(page.locator(".nodes .gpu").count(), 4)
        self.shot("admin-overview.png")
        (session,) = [c for c in self.context.cookies() if c["name"] == "llmgw_session"]
        self.assertTrue(session["httpOnly"])
        self.assertEqual(session["sameSite"], "Strict")
        self.assertEqual(session["path"], "/admin")
        for path in ("/keys", "/models/chat", "/nodes/gpu-02"):
            page.goto(base + path)
            html = page.content()
            self.assertNotIn(admin_key, html)
            self.assertNotIn(app_key, html)
        page.goto(base + "/keys")
        self.assertIn(admin_key[:11], page.inner_text("main"))
        self.assertNotIn(admin_key, page.content())
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("form[action$='/keys/app/revoke'] button")
        self.expect(page.locator("main")).to_contain_text("revoked")
        (app,) = [k for k in self.admin("/api/v1/keys")["keys"] if k["name"] == "app"]
        self.assertIsNotNone(app["revoked"])

        answer = page.request.post(
            base + "/nodes/gpu-01/drain",
            form={"csrf": "wrong"},
            max_redirects=0,
        )
        self.assertEqual(answer.status, 403)
        self.assertFalse(self.node_draining("gpu-01"))

        page.click("button:has-text('Log out')")
        page.wait_for_url("**/admin/login")
        page.goto(base + "/nodes/gpu-01")
        self.assertTrue(page.url.endswith("/admin/login"), page.url)

        # The non-admin key above was the first failure from 127.0.0.1.
        statuses = []
        for _ in range(6):
            status, _, _ = http(
                "POST",
                base + "/login",
                urllib.parse.urlencode({"key": "sk-wrong"}).encode(),
            )
            statuses.append(status)
        self.assertEqual(statuses, [403] * 4 + [429] * 2)


class SkipRuleTests(SynchronousTestCase):
    def test_no_chromium(self) -> None:
        """
        Without Chromium the browser tests skip with a reason naming the
        package, and fail instead under C{CI=true}.
        """
        self.patch(sys.modules[__name__], "CHROMIUM", "/nonexistent/chromium")
        self.patch(os, "environ", {**os.environ, "CI": "false"})
        with self.assertRaises(SkipTest) as skipped:
            _browser_or_skip()
        self.assertIn("chromium package", str(skipped.exception))
        self.patch(os, "environ", {**os.environ, "CI": "true"})
        with self.assertRaises(AssertionError) as failed:
            _browser_or_skip()
        self.assertIn("chromium", str(failed.exception))
