"""
The store's migrations on a real SQLite file, the key ring's windows on a
fake clock, and the admin guard of an admin listener off loopback.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from typing import Any
from urllib.parse import unquote_to_bytes

from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.test.requesthelper import DummyRequest

from llmgw.admin.guard import AdminGuard
from llmgw.router.accounting.api_key import hash_key
from llmgw.router.accounting.auth import KeyRing
from llmgw.router.errors import APIError
from llmgw.store.db import MIGRATIONS, SQLiteStore, StoreError, sqlite_path
from tests.typing_support import as_request


def _store(test: Any) -> SQLiteStore:
    folder = tempfile.mkdtemp(prefix="llmgw-store-")
    store = SQLiteStore(os.path.join(folder, "sub", "llmgw.db"))
    test.addCleanup(store.close)
    return store


class MigrationTests(SynchronousTestCase):
    def test_fresh_then_again(self) -> None:
        """
        A new file gets every migration, in WAL mode; opening it again
        changes nothing and reads what was written.
        """
        store = _store(self)
        keys, models = store.prepare()
        self.assertEqual((keys, models), ([], []))
        connection = sqlite3.connect(store.path)
        self.addCleanup(connection.close)
        self.assertEqual(
            connection.execute("PRAGMA user_version").fetchone()[0], len(MIGRATIONS)
        )
        self.assertEqual(connection.execute("PRAGMA journal_mode").fetchone()[0], "wal")
        connection.execute(
            "INSERT INTO models (name, spec, added) VALUES ('m', '{}', 1)"
        )
        connection.commit()
        self.assertEqual(store.prepare(), ([], [("m", "{}")]))

    def test_newer_refused(self) -> None:
        """
        A database from a newer llmgw is refused with one line, not
        altered.
        """
        store = _store(self)
        store.prepare()
        connection = sqlite3.connect(store.path)
        connection.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
        connection.commit()
        connection.close()
        with self.assertRaises(StoreError) as raised:
            store.prepare()
        self.assertIn(f"schema version {len(MIGRATIONS) + 1}", str(raised.exception))

    def test_not_a_database(self) -> None:
        """
        A file that is not SQLite: one line naming it.
        """
        store = _store(self)
        with open(store.path, "wb") as f:
            f.write(b"not a database at all" * 100)
        with self.assertRaises(StoreError) as raised:
            store.prepare()
        self.assertIn(store.path, str(raised.exception))

    def test_urls(self) -> None:
        self.assertEqual(sqlite_path("", "/s"), "/s/llmgw.db")
        self.assertEqual(sqlite_path("sqlite:///var/x.db", "/s"), "/var/x.db")
        for bad in ("postgres://h/db", "sqlite://host/x.db", "x.db"):
            self.assertRaises(StoreError, sqlite_path, bad, "/s")


class KeyRingTests(TestCase):
    def setUp(self) -> None:
        self.now = 1000.0
        store = _store(self)
        self.ring = KeyRing(store, clock=lambda: self.now, wall_clock=lambda: 1e9)
        store.prepare()

    async def test_windows(self) -> None:
        """
        rpm counts requests over the last 60 s and says when one frees;
        tpm counts tokens once a request is over; the budget is total.
        """
        key, secret = await self.ring.create("k", rpm=2, tpm=100, budget_tokens=250)
        self.assertEqual(key.hash, hash_key(secret))
        self.assertIs(self.ring.authenticate(b"Bearer " + secret.encode()), key)
        self.ring.admit(key, ["m"])
        self.now += 10
        self.ring.admit(key, ["m"])
        with self.assertRaises(APIError) as raised:
            self.ring.admit(key, ["m"])
        self.assertEqual(
            (raised.exception.status, raised.exception.retry_after), (429, 50)
        )
        self.now += 50.5
        self.ring.admit(key, ["m"])
        self.ring.used(key, 120)
        self.now += 30
        with self.assertRaises(APIError) as raised:
            self.ring.admit(key, ["m"])
        self.assertEqual(raised.exception.code, "rate_limit_exceeded")
        self.assertEqual(raised.exception.retry_after, 30)
        self.now += 31
        self.ring.admit(key, ["m"])
        self.ring.used(key, 140)
        self.now += 61
        with self.assertRaises(APIError) as raised:
            self.ring.admit(key, ["m"])
        self.assertEqual(raised.exception.code, "insufficient_quota")

    async def test_models_by_alias(self) -> None:
        """
        A key's models may be named by alias: the model and its other
        names are allowed; other models are 403.
        """
        names = {"chat": "chat-a", "chat-a": "chat-a", "c": "chat-a", "other": "other"}
        self.ring.resolve = names.get
        key, _ = await self.ring.create("k", models=["chat"])
        for name in ("chat", "chat-a", "c"):
            self.ring.admit(key, [name])
        with self.assertRaises(APIError) as raised:
            self.ring.admit(key, ["other"])
        self.assertEqual(raised.exception.status, 403)

    async def test_header_forms(self) -> None:
        """
        Bearer in any case; anything else is 401 once a key exists.
        """
        key, secret = await self.ring.create("k")
        header: bytes | None
        for header in (b"Bearer " + secret.encode(), b"bearer  " + secret.encode()):
            self.assertIs(self.ring.authenticate(header), key)
        for header in (
            None,
            b"",
            b"Bearer",
            b"Basic " + secret.encode(),
            secret.encode(),
            b"Bearer " + secret.encode() + b"x",
            b"Bearer \xff\xfe",
        ):
            with self.assertRaises(APIError) as raised:
                self.ring.authenticate(header)
            self.assertEqual(raised.exception.status, 401, header)
        await self.ring.revoke(key)
        with self.assertRaises(APIError):
            self.ring.authenticate(b"Bearer " + secret.encode())
        # Revoking the last key does not open the gateway.
        self.assertTrue(self.ring.required)


class _Inner(Resource):
    isLeaf = True

    def render(self, request: Any) -> bytes:
        return b"inner"


class AdminGuardTests(TestCase):
    async def test_guard(self) -> None:
        """
        Off loopback, /api/ needs an admin key; a plain key or none gets
        401; loopback peers and /metrics pass.
        """
        store = _store(self)
        ring = KeyRing(store, clock=lambda: 0.0, wall_clock=lambda: 1e9)
        store.prepare()
        _, admin = await ring.create("ops", admin=True)
        _, plain = await ring.create("app")
        guard = AdminGuard(_Inner(), ring)

        def call(path: bytes, host: str, key: str | None) -> tuple[int, bytes]:
            # As twisted.web.server.Request.process splits and decodes it.
            request = DummyRequest([unquote_to_bytes(p) for p in path[1:].split(b"/")])
            # DummyRequest has no path; twisted.web's Request sets one.
            request.path = path  # type: ignore[attr-defined]
            request.client = type("A", (), {"host": host, "port": 1})()
            if key is not None:
                request.requestHeaders.setRawHeaders(
                    b"authorization", [b"Bearer " + key.encode()]
                )
            body = guard.render(as_request(request))
            return request.responseCode or 200, body

        self.assertEqual(call(b"/api/v1/keys", "10.0.0.9", None)[0], 401)
        self.assertEqual(call(b"/api/v1/keys", "10.0.0.9", plain)[0], 401)
        self.assertEqual(call(b"/api/v1/keys", "10.0.0.9", admin), (200, b"inner"))
        self.assertEqual(call(b"/api/v1/keys", "127.0.0.1", None), (200, b"inner"))
        self.assertEqual(call(b"/metrics", "10.0.0.9", None), (200, b"inner"))
        # Percent-encoded, the path routes to the same place: guarded too.
        for path in (b"/%61pi/v1/keys", b"/api%2Fv1%2Fkeys", b"/API/v1/keys", b"/"):
            self.assertEqual(call(path, "10.0.0.9", None)[0], 401, path)
        # The server's own router workers (--router-workers): its token.
        self.assertEqual(call(b"/api/v1/watch", "10.0.0.9", "t0ken")[0], 401)
        guard.internal = b"t0ken"
        self.assertEqual(call(b"/api/v1/watch", "10.0.0.9", "t0ken"), (200, b"inner"))
        self.assertEqual(call(b"/api/v1/watch", "10.0.0.9", "t0ke")[0], 401)
