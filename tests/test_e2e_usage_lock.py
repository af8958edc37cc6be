"""
The usage API and the usage writer while another process holds the write
lock on the server's SQLite file (issue 13, case 9): C{twistd -n
llmgw-server} with its store, the sim engine as the replica, and a child
C{python} holding C{BEGIN IMMEDIATE} on the same file.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.support import Processes, hermetic_env, http

CHAT = json.dumps(
    {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
).encode()

# Holds the write lock (in WAL mode the RESERVED lock is the writer's) for
# argv[2] seconds, after saying so.
HOLDER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA busy_timeout=5000")
db.execute("BEGIN IMMEDIATE")
db.execute("UPDATE api_keys SET name = name WHERE id < 0")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("ROLLBACK")
print("released", flush=True)
"""


class LockedStoreTests(SynchronousTestCase, Processes):
    timeout = 90

    def test_usage_api_while_locked(self) -> None:
        """
        While another process holds the write lock for 6 s: chat requests
        and C{GET /api/v1/usage} each answer within 2 s (the usage API from
        what is committed, with the records still pending counted, or a
        503 JSON error); the server logs one warning with the pending count
        and one line when the lock goes, no traceback; afterwards every
        request's record is in the store, once.
        """
        _, sim_url = self.start_sim("--max-tokens", "3")
        state = os.path.join(self._directory(), "server-state")
        server, url, admin_url = self.start_server(
            "--endpoint",
            f"sim-0={sim_url}=sim-model",
            "--state-dir",
            state,
            config='[store]\nflush_interval = "200ms"\n',
        )

        def chat() -> float:
            started = time.monotonic()
            status, _, _ = http(
                "POST",
                url + "/v1/chat/completions",
                CHAT,
                {"content-type": "application/json"},
                timeout=10,
            )
            self.assertEqual(status, 200)
            return time.monotonic() - started

        def usage() -> tuple[float, int, dict[str, object]]:
            started = time.monotonic()
            status, headers, body = http(
                "GET", admin_url + "/api/v1/usage?by=model", timeout=10
            )
            self.assertEqual(headers.get("content-type"), "application/json")
            return time.monotonic() - started, status, json.loads(body)

        def requests(answer: dict[str, object]) -> int:
            groups = answer["usage"]
            assert isinstance(groups, list)
            return sum(g["requests"] for g in groups)

        for _ in range(3):
            chat()
        _, status, before = usage()
        self.assertEqual((status, requests(before)), (200, 3))

        # WAL: readers see the last commit while a writer holds the lock.
        with sqlite3.connect(os.path.join(state, "llmgw.db")) as db:
            self.assertEqual(db.execute("PRAGMA journal_mode").fetchone()[0], "wal")
        db.close()

        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, os.path.join(state, "llmgw.db"), "6"],
            stdout=subprocess.PIPE,
            text=True,
            env=hermetic_env(),
        )
        self.addCleanup(holder.wait, 20)
        self.addCleanup(holder.kill)
        assert holder.stdout is not None
        self.assertEqual(holder.stdout.readline().strip(), "locked")
        locked_at = time.monotonic()

        latencies = []
        answers = []
        made = 3
        # Bounded: 8 rounds, each well under a second unless something
        # hangs (and then the 2 s assertions below say so).
        for _ in range(8):
            latencies.append(chat())
            made += 1
            took, status, answer = usage()
            latencies.append(took)
            answers.append((status, answer))
            if time.monotonic() - locked_at > 4:
                break
        self.assertIsNone(holder.poll(), "the lock was released too early")
        self.assertLess(max(latencies), 2.0, latencies)
        print(
            f"\nwhile locked: {len(latencies)} calls, slowest {max(latencies):.2f}s;"
            f" answers {[status for status, _ in answers]}"
        )
        for status, answer in answers:
            if status == 200:
                # What was committed before the lock, at least; the rest
                # pending, none counted twice.
                self.assertGreaterEqual(requests(answer), 3)
                pending = answer["pending"]
                assert isinstance(pending, int)
                self.assertLessEqual(requests(answer) + pending, made)
            else:
                self.assertEqual(status, 503)
                error = answer["error"]
                assert isinstance(error, dict)
                self.assertEqual(error["code"], "store_busy")
        self.assertTrue(
            any(s == 200 and a["pending"] for s, a in answers),
            f"no answer counted pending records: {answers}",
        )

        self.assertEqual(holder.stdout.readline().strip(), "released")
        deadline = time.monotonic() + 10
        while True:
            _, status, after = usage()
            if status == 200 and requests(after) == made or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.assertEqual((status, requests(after), after["pending"]), (200, made, 0))
        server.wait_for("the store is writable again", timeout=10)

        log = server.output()
        self.assertNotIn("Traceback", log)
        self.assertEqual(log.count("usage: cannot write to the store"), 1, log[-3000:])
        self.assertRegex(
            log,
            r"cannot write to the store \(database is locked\);"
            r" keeping \d+ records",
        )
