"""
The store's behaviour, the same on both engines: each test runs on a
SQLite file and on a real PostgreSQL (L{tests.pg_support}): migrations,
a newer database refused, keys, usage written once per request id, the
usage report, runtime models and drained nodes.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from typing import TYPE_CHECKING, Any

from twisted.trial.unittest import TestCase

from llmgw.store.base import MIGRATIONS, Store, StoreError, UsageRow
from llmgw.store.db import SQLiteStore, open_store
from llmgw.store.responses import StoredResponse
from tests import test_store
from tests.pg_support import fresh_database


def _row(
    rid: str, key_id: int | None, prompt: int, completion: int, **kw: Any
) -> UsageRow:
    values: dict[str, Any] = {
        "request_id": rid,
        "key_id": key_id,
        "key_name": "k" if key_id is not None else None,
        "model": "m",
        "replica": "r1",
        "status": 200,
        "stream": False,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "latency": 0.5,
        "time_to_first_token": 0.25,
    }
    values.update(kw)
    return UsageRow(**values)


def _key(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "prefix": "sk-" + name[:8],
        "hash": "h-" + name,
        "models": ["m"],
        "rpm": 10,
        "tpm": None,
        "budget_tokens": 1000,
        "admin": False,
        "created": 1e9,
    }


def _response(rid: str, key_id: int | None, created: float) -> StoredResponse:
    return StoredResponse(
        id=rid,
        key_id=key_id,
        model="m",
        created_at=created,
        previous_response_id="resp_before" if key_id else None,
        input_items=[
            {"type": "message", "role": "user", "content": "h\u00e9llo \ud800"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        output_items=[{"id": "msg_1", "type": "message", "role": "assistant"}],
        response={"id": rid, "object": "response", "usage": {"total_tokens": 3}},
    )


if TYPE_CHECKING:
    _Base = TestCase
else:
    _Base = object


class _Behaviour(_Base):
    """
    The tests; a subclass gives the engine.
    """

    def make_store(self) -> Store:
        raise NotImplementedError

    def raw(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """
        Run one statement on a connection of the test's own, committed.
        """
        raise NotImplementedError

    def schema_version(self) -> int:
        raise NotImplementedError

    def set_schema_version(self, version: int) -> None:
        raise NotImplementedError

    def store(self) -> Store:
        store = self.make_store()
        self.addCleanup(store.close)
        return store

    def test_fresh_then_again(self) -> None:
        """
        A new database gets every migration; opening it again changes
        nothing and reads what was written.
        """
        store = self.store()
        self.assertEqual(store.prepare(), ([], []))
        self.assertEqual(self.schema_version(), len(MIGRATIONS))
        self.raw("INSERT INTO models (name, spec, added) VALUES ('m', '{}', 1)")
        again = self.store()
        self.assertEqual(again.prepare(), ([], [("m", "{}")]))

    def test_newer_refused(self) -> None:
        """
        A database from a newer llmgw is refused with one line, not
        altered.
        """
        self.store().prepare()
        self.set_schema_version(len(MIGRATIONS) + 1)
        with self.assertRaises(StoreError) as raised:
            self.store().prepare()
        message = str(raised.exception)
        self.assertIn(f"schema version {len(MIGRATIONS) + 1}", message)
        self.assertNotIn("\n", message)
        self.assertEqual(self.schema_version(), len(MIGRATIONS) + 1)

    async def test_keys(self) -> None:
        """
        Keys get ids; a name used twice is one of the store's integrity
        errors; a revocation is kept.
        """
        store = self.store()
        store.prepare()
        first = await store.add_key(_key("a"))
        second = await store.add_key(_key("b"))
        self.assertNotEqual(first, second)
        with self.assertRaises(store.integrity_errors):
            await store.add_key({**_key("a"), "hash": "other"})
        await store.revoke_key(first, 2e9)
        keys, _ = self.store().prepare()
        self.assertEqual(
            [(k["id"], k["name"], k["models"], k["admin"], k["revoked"]) for k in keys],
            [(first, "a", ["m"], False, 2e9), (second, "b", ["m"], False, None)],
        )

    async def test_usage_once_per_request(self) -> None:
        """
        A batch written again (its commit's answer lost, say) adds no row
        and no tokens: one record per request id, the key's count exact.
        """
        store = self.store()
        store.prepare()
        key_id = await store.add_key(_key("a"))
        one = [(100.0, _row("r1", key_id, 10, 5)), (101.0, _row("r2", key_id, 3, 4))]
        await store.add_usage(one, {key_id: (22, 101.0)})
        await store.add_usage(one, {key_id: (22, 101.0)})
        two = [(102.0, _row("r2", key_id, 3, 4)), (103.0, _row("r3", key_id, 1, 1))]
        await store.add_usage(two, {key_id: (9, 103.0)})
        await store.add_usage([(104.0, _row("r4", None, 7, 0, status=502))], {})
        count = self.raw("SELECT COUNT(*), COUNT(DISTINCT request_id) FROM usage")
        self.assertEqual([tuple(int(v) for v in count[0])], [(4, 4)])
        keys, _ = self.store().prepare()
        self.assertEqual((keys[0]["tokens_used"], keys[0]["last_used"]), (24, 103.0))
        by_key = await store.usage("key", 100.0, 105.0)
        self.assertEqual(
            by_key,
            [
                {
                    "key": None,
                    "requests": 1,
                    "errors": 1,
                    "prompt_tokens": 7,
                    "completion_tokens": 0,
                    "mean_latency": 0.5,
                    "mean_time_to_first_token": 0.25,
                    "estimated_requests": 0,
                    "answered": 1,
                },
                {
                    "key": "k",
                    "requests": 3,
                    "errors": 0,
                    "prompt_tokens": 14,
                    "completion_tokens": 10,
                    "mean_latency": 0.5,
                    "mean_time_to_first_token": 0.25,
                    "estimated_requests": 0,
                    "answered": 3,
                },
            ],
        )
        by_model = await store.usage("model", 101.0, 103.0)
        self.assertEqual([(g["model"], g["requests"]) for g in by_model], [("m", 1)])

    async def test_usage_once_within_one_write(self) -> None:
        """
        Two rows of one request id in one write (a batch line run twice
        between two writes of the usage writer): one row is kept, and its
        tokens alone are counted to the key.
        """
        store = self.store()
        store.prepare()
        key_id = await store.add_key(_key("a"))
        twice = [
            (100.0, _row("batch_1-1", key_id, 10, 5, batch_id="batch_1")),
            (101.0, _row("batch_1-1", key_id, 10, 5, batch_id="batch_1")),
        ]
        await store.add_usage(twice, {key_id: (30, 101.0)})
        count = self.raw("SELECT COUNT(*) FROM usage")
        self.assertEqual([tuple(int(v) for v in count[0])], [(1,)])
        keys, _ = self.store().prepare()
        self.assertEqual(keys[0]["tokens_used"], 15)

    async def test_usage_batch_id(self) -> None:
        """
        A batch line's usage row keeps its batch; a client's request has
        none.
        """
        store = self.store()
        store.prepare()
        rows = [
            (100.0, _row("batch_1-1", None, 1, 1, batch_id="batch_1")),
            (100.0, _row("r2", None, 1, 1)),
        ]
        await store.add_usage(rows, {})
        self.assertEqual(
            self.raw("SELECT request_id, batch_id FROM usage ORDER BY request_id"),
            [("batch_1-1", "batch_1"), ("r2", None)],
        )

    async def test_usage_same_client_id_two_rows(self) -> None:
        """
        Two requests whose clients sent the same X-Request-ID (a retry, two
        agents reusing an id) are two rows, each with its tokens and the
        client's id beside llmgw's own; the same batch written again (the
        writer's retry) still adds none.
        """
        store = self.store()
        store.prepare()
        key_id = await store.add_key(_key("a"))
        batch = [
            (100.0, _row("own-1", key_id, 10, 5, client_request_id="retry-me")),
            (101.0, _row("own-2", key_id, 3, 4, client_request_id="retry-me")),
        ]
        await store.add_usage(batch, {key_id: (22, 101.0)})
        await store.add_usage(batch, {key_id: (22, 101.0)})
        rows = self.raw(
            "SELECT request_id, client_request_id, prompt_tokens, completion_tokens"
            " FROM usage ORDER BY time"
        )
        self.assertEqual(
            [tuple(r) for r in rows],
            [("own-1", "retry-me", 10, 5), ("own-2", "retry-me", 3, 4)],
        )
        keys, _ = self.store().prepare()
        self.assertEqual(keys[0]["tokens_used"], 22)
        (group,) = await store.usage("key", 100.0, 102.0)
        self.assertEqual(
            (group["requests"], group["prompt_tokens"], group["completion_tokens"]),
            (2, 13, 9),
        )

    async def test_usage_means_over_answered(self) -> None:
        """
        Mean latency and mean time to first token are over the same
        requests, those answered: a quick refusal with no first byte
        does not pull the mean latency below the mean time to first token.
        """
        store = self.store()
        store.prepare()
        rows = [
            (100.0, _row("a1", None, 1, 1, latency=2.0, time_to_first_token=1.0)),
            (100.0, _row("a2", None, 1, 1, latency=4.0, time_to_first_token=1.5)),
            *(
                (
                    100.0,
                    _row(
                        f"r{i}",
                        None,
                        0,
                        0,
                        status=429,
                        latency=0.001,
                        time_to_first_token=None,
                    ),
                )
                for i in range(8)
            ),
        ]
        await store.add_usage(rows, {})
        (group,) = await store.usage("model", 99.0, 101.0)
        self.assertEqual(
            (
                group["requests"],
                group["errors"],
                group["answered"],
                group["mean_latency"],
                group["mean_time_to_first_token"],
            ),
            (10, 8, 2, 3.0, 1.25),
        )

    async def test_update_key(self) -> None:
        """
        A key's models, limits and expiry change; the rest stays, and a
        column outside those is refused before any write.
        """
        store = self.store()
        store.prepare()
        key_id = await store.add_key({**_key("a"), "expires": 3e9})
        await store.update_key(key_id, {"models": ["x", "y"], "rpm": 7, "tpm": None})
        await store.update_key(key_id, {"expires": None, "budget_tokens": 99})
        with self.assertRaises(ValueError):
            await store.update_key(key_id, {"admin": True})
        (key,), _ = self.store().prepare()
        self.assertEqual(
            {
                n: key[n]
                for n in ("name", "models", "rpm", "tpm", "budget_tokens", "expires")
            },
            {
                "name": "a",
                "models": ["x", "y"],
                "rpm": 7,
                "tpm": None,
                "budget_tokens": 99,
                "expires": None,
            },
        )
        self.assertFalse(key["admin"])

    async def test_models(self) -> None:
        """
        Runtime models: added, replaced by name, deleted.
        """
        store = self.store()
        store.prepare()
        await store.put_model("a", '{"x": 1}', 1.0)
        await store.put_model("b", "{}", 2.0)
        await store.put_model("a", '{"x": 2}', 3.0)
        self.assertEqual(await store.models(), [("a", '{"x": 2}'), ("b", "{}")])
        await store.delete_model("a")
        self.assertEqual(await store.models(), [("b", "{}")])

    async def test_drains(self) -> None:
        """
        Drained nodes: set (a second set keeps the first time), read back
        by L{Store.drains} and by the next start's L{Store.prepare},
        cleared (clearing an unknown node does nothing).
        """
        store = self.store()
        store.prepare()
        self.assertEqual(store.drained, {})
        await store.set_drain("gpu-01", 1.5)
        await store.set_drain("gpu-02", 2.0)
        await store.set_drain("gpu-01", 3.0)
        self.assertEqual(await store.drains(), {"gpu-01": 1.5, "gpu-02": 2.0})
        await store.clear_drain("gpu-02")
        await store.clear_drain("nowhere")
        self.assertEqual(await store.drains(), {"gpu-01": 1.5})
        again = self.store()
        again.prepare()
        self.assertEqual(again.drained, {"gpu-01": 1.5})

    async def test_responses_per_key(self) -> None:
        """
        A stored response is read back whole (items and Response object
        as they were put) by the key that made it only: another key, or
        none, finds nothing, as for an unknown id; one made without a key
        is read without one.  A response put again replaces its row.
        """
        store = self.store()
        store.prepare()
        mine = _response("resp_a", 7, 1000.5)
        await store.put_response(mine)
        await store.put_response(_response("resp_b", None, 1001.0))
        self.assertEqual(await store.get_response("resp_a", 7), mine)
        self.assertIsNone(await store.get_response("resp_a", 8))
        self.assertIsNone(await store.get_response("resp_a", None))
        self.assertIsNone(await store.get_response("resp_none", 7))
        self.assertEqual(
            await store.get_response("resp_b", None), _response("resp_b", None, 1001.0)
        )
        self.assertIsNone(await store.get_response("resp_b", 7))
        again = StoredResponse(**{**vars(mine), "output_items": []})
        await store.put_response(again)
        self.assertEqual(await store.get_response("resp_a", 7), again)

    async def test_responses_deleted_per_key(self) -> None:
        """
        Another key cannot delete a response (it says there was none); its
        own key deletes it once.
        """
        store = self.store()
        store.prepare()
        await store.put_response(_response("resp_a", 7, 1000.0))
        self.assertFalse(await store.delete_response("resp_a", 8))
        self.assertFalse(await store.delete_response("resp_a", None))
        self.assertTrue(await store.delete_response("resp_a", 7))
        self.assertFalse(await store.delete_response("resp_a", 7))
        self.assertIsNone(await store.get_response("resp_a", 7))

    async def test_responses_dropped_by_age(self) -> None:
        """
        Responses made before the cutoff are dropped, of every key; those
        made at or after it stay, and survive the store's reopening.
        """
        store = self.store()
        store.prepare()
        for rid, key_id, created in [
            ("resp_old", 7, 100.0),
            ("resp_old2", None, 199.5),
            ("resp_edge", 8, 200.0),
            ("resp_new", 7, 300.0),
        ]:
            await store.put_response(_response(rid, key_id, created))
        self.assertEqual(await store.drop_responses(200.0), 2)
        self.assertEqual(await store.drop_responses(200.0), 0)
        again = self.store()
        again.prepare()
        self.assertIsNone(await again.get_response("resp_old", 7))
        self.assertIsNone(await again.get_response("resp_old2", None))
        self.assertIsNotNone(await again.get_response("resp_edge", 8))
        self.assertIsNotNone(await again.get_response("resp_new", 7))


class SQLiteStoreTests(_Behaviour, TestCase):
    def setUp(self) -> None:
        self.path = os.path.join(tempfile.mkdtemp(prefix="llmgw-store-"), "llmgw.db")

    def make_store(self) -> Store:
        store = open_store(f"sqlite://{self.path}", "/nonexistent")
        self.assertIsInstance(store, SQLiteStore)
        return store

    def raw(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self.path) as connection:
            rows = connection.execute(sql, params).fetchall()
        connection.close()
        return rows

    def schema_version(self) -> int:
        return int(self.raw("PRAGMA user_version")[0][0])

    def set_schema_version(self, version: int) -> None:
        self.raw(f"PRAGMA user_version = {version}")


class PostgresStoreTests(_Behaviour, TestCase):
    def setUp(self) -> None:
        self.url = fresh_database(self)

    def make_store(self) -> Store:
        from llmgw.store.pg import PostgresStore

        store = open_store(self.url, "/nonexistent")
        self.assertIsInstance(store, PostgresStore)
        return store

    def raw(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as connection:
            cursor = connection.execute(sql.replace("?", "%s").encode(), params)
            return cursor.fetchall() if cursor.description else []

    def schema_version(self) -> int:
        return int(self.raw("SELECT version FROM llmgw_schema")[0][0])

    def set_schema_version(self, version: int) -> None:
        self.raw("UPDATE llmgw_schema SET version = ?", (version,))

    def test_unreachable(self) -> None:
        """
        No server at the URL: one line naming it, password hidden.
        """
        from tests.support import closed_port

        store = open_store(
            f"postgresql://u:secret@127.0.0.1:{closed_port()}/x", "/nonexistent"
        )
        self.addCleanup(store.close)
        with self.assertRaises(StoreError) as raised:
            store.prepare()
        message = str(raised.exception)
        self.assertIn("cannot connect to postgresql://u:***@127.0.0.1:", message)
        self.assertNotIn("secret", message)
        self.assertNotIn("\n", message)


class PostgresKeyRingTests(test_store.KeyRingTests):
    """
    The key ring's tests (windows, aliases, header forms and revocation)
    with its keys kept in PostgreSQL.
    """

    def setUp(self) -> None:
        from llmgw.router.accounting.auth import KeyRing
        from llmgw.store.pg import PostgresStore

        self.now = 1000.0
        store = PostgresStore(fresh_database(self))
        self.addCleanup(store.close)
        store.prepare()
        self.ring = KeyRing(store, clock=lambda: self.now, wall_clock=lambda: 1e9)
