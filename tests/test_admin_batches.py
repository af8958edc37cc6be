"""
The admin API's batches routes (L{llmgw.admin.batches}) through
L{llmgw.admin.api.Admin}'s one resource and L{StubTreq}, on a store that
answers at once: every key's batches listed with filters and pages, one
with its lines by state, cancelled as the operator.  The store's own
queries are L{tests.test_store_batch_views}'s, on both engines; the
end-to-end test (L{tests.test_e2e_ctl_batches}) drives the same routes
through a running server and C{llmgw ctl}.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry
from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from llmgw.admin.api import Admin
from llmgw.control.inventory import Inventory
from llmgw.router.accounting.auth import KeyRing
from llmgw.store.batches import LINE_STATES, BatchRow, BatchUsage
from tests.test_batch_tally import batch
from tests.test_web import _keys
from tests.typing_support import stub_treq


class _Store:
    """
    The batches of the store as the admin routes read and change them.
    """

    def __init__(self, batches: list[BatchRow]) -> None:
        self.batches = {b.id: b for b in batches}
        self.lines: dict[str, dict[str, int]] = {}
        self.usage: dict[str, BatchUsage] = {}
        self.cancelled: list[str] = []

    def find_batch(self, batch_id: str) -> Deferred[BatchRow | None]:
        return succeed(self.batches.get(batch_id))

    def all_batches(
        self,
        status: str | None = None,
        key_id: int | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> Deferred[list[BatchRow]]:
        rows = sorted(self.batches.values(), key=lambda b: (-b.created_at, b.id))
        if after is not None:
            rows = rows[[b.id for b in rows].index(after) + 1 :]
        rows = [
            b for b in rows if status in (None, b.status) and key_id in (None, b.key_id)
        ]
        return succeed(rows[:limit])

    def line_counts(self, batch_id: str) -> Deferred[dict[str, int]]:
        # Every state, as the store's.
        counts = dict.fromkeys(LINE_STATES, 0)
        counts.update(self.lines.get(batch_id, {}))
        return succeed(counts)

    def batch_usage(self, batch_id: str, created_at: float) -> Deferred[BatchUsage]:
        return succeed(self.usage.get(batch_id, BatchUsage()))

    def update_batch(
        self, batch_id: str, changes: dict[str, Any], statuses: Any = None
    ) -> Deferred[bool]:
        row = self.batches[batch_id]
        if statuses is not None and row.status not in statuses:
            return succeed(False)
        self.batches[batch_id] = replace(row, **changes)
        return succeed(True)

    def cancel_lines(self, batch_id: str) -> Deferred[int]:
        self.cancelled.append(batch_id)
        lines = self.lines.setdefault(batch_id, {})
        count = lines.pop("pending", 0)
        lines["cancelled"] = lines.get("cancelled", 0) + count
        return succeed(count)


class BatchRoutesTests(SynchronousTestCase):
    def setUp(self) -> None:
        keys: KeyRing = _keys()
        ops, app = keys.find("ops"), keys.find("app")
        assert ops is not None and app is not None
        self.store = _Store(
            [
                replace(batch("batch_a", at=10.0), key_id=app.id, key_name="app"),
                replace(
                    batch("batch_b", "cancelled", 20.0),
                    key_id=ops.id,
                    key_name="ops",
                    total=150,
                    completed=64,
                ),
                replace(batch("batch_c", at=30.0), key_id=ops.id, key_name="ops"),
            ]
        )
        self.store.lines = {"batch_a": {"pending": 3, "running": 1, "done": 2}}
        self.store.usage = {
            "batch_a": BatchUsage(2, 10, 8, 1.5, 0.003),
            "batch_b": BatchUsage(64, 320, 256, 48.0, 0.096),
        }
        admin = Admin(
            CollectorRegistry(),
            Inventory(),
            keys=keys,
            store=self.store,  # type: ignore[arg-type]
            wall_clock=lambda: 99.0,
        )
        self.treq = stub_treq(admin.resource())

    def call(self, method: str, path: str) -> tuple[int, Any]:
        response = self.successResultOf(
            self.treq.request(method, "http://admin" + path)
        )
        content = self.successResultOf(response.content())
        return response.code, json.loads(content)

    def test_list_every_keys_batches(self) -> None:
        """
        Every key's batches, newest first, each with its key's name and
        request counts and usage, those not over with their lines by state
        (every state); filtered by status and by key name; paged by limit and
        after, saying whether more follow.
        """
        code, body = self.call("GET", "/api/v1/batches")
        self.assertEqual(code, 200, body)
        self.assertEqual(
            [(b["id"], b["key"]) for b in body["batches"]],
            [("batch_c", "ops"), ("batch_b", "ops"), ("batch_a", "app")],
        )
        first = body["batches"][2]
        self.assertEqual(first["lines"]["pending"], 3)
        self.assertEqual(first["lines"]["expired"], 0)
        self.assertEqual(first["request_counts"]["total"], 0)
        self.assertEqual(first["progress"], {"ended": 2, "total": 6})
        self.assertEqual(
            first["usage"],
            {
                "requests": 2,
                "prompt_tokens": 10,
                "completion_tokens": 8,
                "gpu_seconds": 1.5,
                "cost": 0.003,
            },
        )
        over = body["batches"][1]
        self.assertNotIn("lines", over)
        self.assertEqual(
            (over["usage"]["requests"], over["usage"]["cost"]), (64, 0.096)
        )
        self.assertEqual(body["batches"][0]["usage"]["requests"], 0)
        # Over, every line ended, the cancelled ones (in neither count) too.
        self.assertEqual(over["progress"], {"ended": 150, "total": 150})
        self.assertEqual((body["has_more"], body["last_id"]), (False, "batch_a"))
        _, body = self.call("GET", "/api/v1/batches?status=cancelled")
        self.assertEqual([b["id"] for b in body["batches"]], ["batch_b"])
        _, body = self.call("GET", "/api/v1/batches?key=app")
        self.assertEqual([b["id"] for b in body["batches"]], ["batch_a"])
        _, body = self.call("GET", "/api/v1/batches?limit=1")
        self.assertEqual([b["id"] for b in body["batches"]], ["batch_c"])
        self.assertEqual((body["has_more"], body["last_id"]), (True, "batch_c"))
        _, body = self.call("GET", "/api/v1/batches?limit=1&after=batch_c")
        self.assertEqual([b["id"] for b in body["batches"]], ["batch_b"])

    def test_bad_filters(self) -> None:
        """
        An unknown status or a limit out of range is a 400 naming what is
        expected; an unknown key a 404.
        """
        code, body = self.call("GET", "/api/v1/batches?status=running")
        self.assertEqual((code, body["error"]["code"]), (400, "bad_request"))
        self.assertIn("in_progress", body["error"]["message"])
        for limit in ("0", "101", "x"):
            code, body = self.call("GET", f"/api/v1/batches?limit={limit}")
            self.assertEqual(code, 400, limit)
            self.assertIn("limit", body["error"]["message"])
        code, body = self.call("GET", "/api/v1/batches?key=nobody")
        self.assertEqual((code, body["error"]["code"]), (404, "not_found"))

    def test_one_batch(self) -> None:
        """
        One batch, whichever key made it, with its lines by state and its
        lines' usage; an unknown one is 404.
        """
        code, body = self.call("GET", "/api/v1/batches/batch_a")
        self.assertEqual(code, 200, body)
        self.assertEqual((body["key"], body["status"]), ("app", "in_progress"))
        self.assertEqual(body["lines"]["running"], 1)
        self.assertEqual(
            (body["usage"]["prompt_tokens"], body["usage"]["gpu_seconds"]), (10, 1.5)
        )
        code, body = self.call("GET", "/api/v1/batches/batch_z")
        self.assertEqual((code, body["error"]["code"]), (404, "not_found"))

    def test_cancel_as_operator(self) -> None:
        """
        A batch in progress, another key's, is cancelled: cancelling since
        now, its pending lines cancelled (ended, in its progress);
        cancelling it again answers it as it is; a completed batch is 409
        C{cannot_cancel}, unchanged; an unknown one 404.
        """
        code, body = self.call("POST", "/api/v1/batches/batch_a/cancel")
        self.assertEqual(code, 200, body)
        self.assertEqual((body["status"], body["cancelling_at"]), ("cancelling", 99.0))
        self.assertEqual((body["lines"]["pending"], body["lines"]["cancelled"]), (0, 3))
        self.assertEqual(body["progress"], {"ended": 5, "total": 6})
        code, body = self.call("POST", "/api/v1/batches/batch_a/cancel")
        self.assertEqual((code, body["status"]), (200, "cancelling"))
        code, body = self.call("POST", "/api/v1/batches/batch_b/cancel")
        self.assertEqual((code, body["error"]["code"]), (409, "cannot_cancel"))
        self.assertIn("is cancelled", body["error"]["message"])
        self.assertEqual(self.store.batches["batch_b"].status, "cancelled")
        self.assertNotIn("batch_b", self.store.cancelled)
        code, _ = self.call("POST", "/api/v1/batches/batch_z/cancel")
        self.assertEqual(code, 404)

    def test_no_store(self) -> None:
        """
        A server without a store answers 404 C{not_found}.
        """
        admin = Admin(CollectorRegistry(), Inventory(), wall_clock=time.time)
        self.treq = stub_treq(admin.resource())
        code, body = self.call("GET", "/api/v1/batches")
        self.assertEqual((code, body["error"]["code"]), (404, "not_found"))
