"""
The admin listener and the dashboard's mounts against what a browser or a
careless client sends them, end to end: C{twistd -n llmgw-server} with a
sim engine, cross-site writes and rebound C{Host}s from loopback, forms of
too many fields, static names that must never reach the file system.
"""

from __future__ import annotations

import json
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from tests.support import Processes, http
from tests.test_e2e_store import _Ctl


class AdminGuardTests(SynchronousTestCase, Processes, _Ctl):
    timeout = 120

    def setUp(self) -> None:
        _, self.sim_url = self.start_sim("--max-tokens", "7")
        self.server_state = tempfile.mkdtemp(prefix="llmgw-db-")
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint",
            f"sim-0={self.sim_url}=sim-model,other-model",
            config='[store]\nflush_interval = "1h"\n',
            state="server-state",
        )

    def test_browser_pages_of_other_sites_refused(self) -> None:
        """
        The admin listener needs no key from loopback, and a browser on
        this machine (or one through an SSH tunnel) is such a peer: a page
        of another site that POSTs a form to it (text/plain, no preflight)
        is refused 403 and changes nothing, as is any request naming a
        DNS name in Host (DNS rebinding).  The dashboard's own POSTs (same
        origin), ctl and curl (neither header) pass.
        """
        made = json.dumps({"name": "evil", "admin": True}).encode()
        for headers in (
            {"Origin": "https://evil.example", "Content-Type": "text/plain"},
            {"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"},
            {"Origin": "null", "Content-Type": "text/plain"},
        ):
            code, _, body = http("POST", self.admin_url + "/api/v1/keys", made, headers)
            self.assertEqual(code, 403, (headers, body))
        for method, path in (("GET", "/api/v1/keys"), ("POST", "/api/v1/keys")):
            code, _, body = http(
                method,
                self.admin_url + path,
                made if method == "POST" else None,
                {"Host": "evil.example:9090"},
            )
            self.assertEqual(code, 403, (method, body))
        self.assertEqual(self.ctl_json("keys", "list")["keys"], [])
        host = self.admin_url.split("://", 1)[1]
        code, _, body = http(
            "POST",
            self.admin_url + "/api/v1/keys",
            made,
            {"Origin": self.admin_url, "Host": host, "Sec-Fetch-Site": "same-origin"},
        )
        self.assertEqual(code, 201, body)
        code, _, _ = http(
            "GET", self.admin_url + "/api/v1/keys", None, {"Host": "localhost"}
        )
        self.assertEqual(code, 200)

    def test_login_form_with_many_fields(self) -> None:
        """
        A login POST to the client listener's C{/admin/login} with more
        form fields than are read (a hostile client, no key) is refused
        like a wrong key (403), with no traceback in the log (it was a
        500 and a traceback per request: parse_qs's field cap raised).
        """
        fields = "&".join(f"f{i}=x" for i in range(30)).encode()
        for _ in range(2):
            code, _, body = http(
                "POST",
                self.url + "/admin/login",
                fields,
                {"Content-Type": "application/x-www-form-urlencoded"},
            )
            self.assertEqual(code, 403, body[:300])
        output = self.server.output()
        self.assertNotIn("Traceback", output)
        self.assertNotIn("Unhandled", output)

    def test_static_names_never_reach_the_file_system(self) -> None:
        """
        C{/admin/static/NAME} is open without a login: a name longer than
        a file name may be (it was a 500 and a critical traceback per
        request, from the stat of it), with a NUL or a dot path, is a 404,
        on both listeners; the dashboard's own files are served.
        """
        for base in (self.url + "/admin", self.admin_url):
            for name in ("a" * 5000 + ".css", "%00.css", "..%2fx.css", ".css"):
                code, _, body = http("GET", f"{base}/static/{name}")
                self.assertEqual(code, 404, (base, name[:20], body[:200]))
            code, _, _ = http("GET", base + "/static/dash.css")
            self.assertEqual(code, 200)
        output = self.server.output()
        self.assertNotIn("Traceback", output)
        self.assertNotIn("critical", output)
