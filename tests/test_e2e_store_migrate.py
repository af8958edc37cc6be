"""
An upgrade as an operator does it, through real processes: a SQLite store
left by an older llmgw (schema 2, usage rows with duplicate request ids)
makes C{twistd -n llmgw-server} refuse to start with one line naming
C{llmgw store migrate}; C{llmgw store migrate --dry-run} lists what would
run and changes nothing; C{llmgw store migrate} applies it with progress;
the server then starts, its retention job rolls the rows (older than a
year) into daily totals, and C{llmgw ctl usage} reports the same sums;
a migration killed with SIGKILL leaves the database at a version, whole.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import tempfile
import time

from twisted.trial.unittest import SynchronousTestCase

from llmgw.store.migrations import MIGRATIONS
from tests.support import BIN, CtlMixin, Processes, hermetic_env

UNIQUE = 900
ROWS = 1000


def old_store(path: str, rows: int = ROWS, unique: int = UNIQUE) -> None:
    """
    A SQLite store at schema 2, as llmgw left it before migration 3: rows
    from 2023-11-14 on (one a minute), the last repeating request ids.
    """
    connection = sqlite3.connect(path)
    for migration in MIGRATIONS[:2]:
        for statement in migration.statements_for(False):
            connection.execute(statement)
    connection.execute("PRAGMA user_version = 2")
    connection.executemany(
        "INSERT INTO usage (time, request_id, key_id, key_name, model, replica,"
        " status, stream, prompt_tokens, completion_tokens, latency,"
        " time_to_first_token) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            (
                1.7e9 + 60 * i,
                f"r{i % unique}",
                None,
                None,
                "m",
                "r1",
                200,
                0,
                3,
                4,
                0.5,
                0.25,
            )
            for i in range(rows)
        ),
    )
    connection.commit()
    connection.close()


def version(path: str) -> int:
    connection = sqlite3.connect(path)
    try:
        return int(connection.execute("PRAGMA user_version").fetchone()[0])
    finally:
        connection.close()


class UpgradeTests(SynchronousTestCase, Processes, CtlMixin):
    timeout = 180

    def setUp(self) -> None:
        self.state = tempfile.mkdtemp(prefix="llmgw-upgrade-")
        self.database = os.path.join(self.state, "llmgw.db")

    def migrate(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                os.path.join(BIN, "llmgw"),
                "store",
                "migrate",
                "--state-dir",
                self.state,
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=hermetic_env(),
        )

    def test_refused_then_migrated(self) -> None:
        """
        Refused (exit 2, one line, no traceback, the database untouched);
        the dry run lists migrations 3 to the last and changes nothing; the
        migration brings it to the last version; the server starts, rolls
        the 900 rows into totals, and reports the same sums.
        """
        old_store(self.database)
        with self.assertRaises(AssertionError) as raised:
            self.start_server(
                "--endpoint", "a=http://127.0.0.1:9=x", "--state-dir", self.state
            )
        output = str(raised.exception)
        self.assertIn("process exited with 2", output)
        self.assertIn("llmgw-server: store: ", output)
        self.assertIn("run `llmgw store migrate`", output)
        self.assertNotIn("Traceback", output)
        self.assertEqual(version(self.database), 2)

        dry = self.migrate("--dry-run")
        self.assertEqual(dry.returncode, 0, dry.stderr)
        self.assertIn("migration 3: usage: one record per request id", dry.stdout)
        self.assertIn(f"[rewrites usage: {ROWS:,} rows]", dry.stdout)
        self.assertIn(f"migration {len(MIGRATIONS)}: ", dry.stdout)
        self.assertIn(
            "dry run: nothing changed; the database is at schema 2", dry.stdout
        )
        self.assertEqual(version(self.database), 2)

        done = self.migrate()
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("migration 3: done in ", done.stdout)
        self.assertIn(f"the database is at schema {len(MIGRATIONS)}", done.stdout)
        self.assertEqual(version(self.database), len(MIGRATIONS))

        server, _, self.admin_url = self.start_server(
            "--endpoint", "a=http://127.0.0.1:9=x", "--state-dir", self.state
        )
        server.wait_for(rf"usage retention: rolled {UNIQUE} records from before")
        report = self.ctl_json("usage", "--by", "model", "--since", "1690000000")
        (group,) = report["usage"]
        self.assertEqual(
            (
                group["model"],
                group["requests"],
                group["prompt_tokens"],
                group["completion_tokens"],
            ),
            ("m", UNIQUE, 3 * UNIQUE, 4 * UNIQUE),
        )
        self.assertAlmostEqual(group["mean_latency"], 0.5)

    def test_killed_halfway(self) -> None:
        """
        C{llmgw store migrate} killed (SIGKILL) while it rewrites: the
        database is at a version and whole at it (at 2 all the rows, no
        unique index; past it the duplicates gone); run again, it ends at
        the last version with the duplicates gone.
        """
        rows = 300_000
        old_store(self.database, rows=rows, unique=rows - 1000)
        process = subprocess.Popen(
            [os.path.join(BIN, "llmgw"), "store", "migrate", "--state-dir", self.state],
            stdout=subprocess.PIPE,
            text=True,
            env=hermetic_env(),
        )
        assert process.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if line.startswith("migration 3: ") or not line:
                break
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        process.stdout.close()
        connection = sqlite3.connect(self.database)
        at = int(connection.execute("PRAGMA user_version").fetchone()[0])
        count = connection.execute("SELECT COUNT(*) FROM usage").fetchone()[0]
        indexes = connection.execute(
            "SELECT name FROM sqlite_master WHERE name = 'usage_request_id'"
        ).fetchall()
        connection.close()
        if at == 2:
            self.assertEqual((count, indexes), (rows, []))
        else:
            self.assertEqual((count, indexes), (rows - 1000, [("usage_request_id",)]))
        again = self.migrate()
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertEqual(version(self.database), len(MIGRATIONS))
