"""
The store's upgrade and retention at size, through the real processes (run
by hand; docs/store.md has the figures):

1. a usage table of ROWS generated rows, as an older llmgw left it (SQLite:
   schema 2, 1% of the request ids repeated; PostgreSQL with --url: schema
   5, before the partitioning), its times from 800 to 400 days ago;
2. C{twistd -n llmgw-server} refused at start (the exit status and line);
3. C{llmgw store migrate}, timed, its progress printed;
4. the server started with C{usage_retention = "100000d"} (nothing
   rolled): the usage API's sums by model and by key;
5. the server started again with the default (a year): its retention job
   rolls every row into daily totals (timed from its log line), and the
   usage API's sums again, compared.

Usage::

    .venv/bin/python bench/store_bench.py [--rows 10000000] [--url postgresql://...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

BIN = os.path.dirname(sys.executable)
DAY = 86400.0

_COLUMNS = (
    "time, request_id, key_id, key_name, model, replica, status, stream,"
    " prompt_tokens, completion_tokens, latency, time_to_first_token"
)


def _values(n: str, start: float, step: float, unique: str) -> str:
    # Three keys and none, two models, one in eight an error without TTFT.
    return (
        f"{start} + {n} * {step}, 'r' || ({n} % {unique}),"
        f" CASE WHEN {n} % 4 = 0 THEN NULL ELSE {n} % 4 END,"
        f" CASE WHEN {n} % 4 = 0 THEN NULL ELSE 'key' || ({n} % 4) END,"
        f" CASE WHEN {n} % 2 = 0 THEN 'model-a' ELSE 'model-b' END, 'r1',"
        f" CASE WHEN {n} % 8 = 7 THEN 429 ELSE 200 END, 0,"
        f" {n} % 100, {n} % 30, 0.5,"
        f" CASE WHEN {n} % 8 = 7 THEN NULL ELSE 0.125 END"
    )


def make_sqlite(path: str, rows: int) -> None:
    from llmgw.store.migrations import MIGRATIONS

    connection = sqlite3.connect(path)
    for migration in MIGRATIONS[:2]:
        for statement in migration.statements_for(False):
            connection.execute(statement)
    connection.execute("PRAGMA user_version = 2")
    start = time.time() - 800 * DAY
    step = 400 * DAY / rows
    unique = str(rows - rows // 100)
    connection.execute(
        f"WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n"
        f" WHERE i + 1 < {rows}) INSERT INTO usage ({_COLUMNS})"
        f" SELECT {_values('i', start, step, unique)} FROM n"
    )
    connection.commit()
    connection.close()


def make_postgres(url: str, rows: int) -> None:
    import psycopg

    from llmgw.store.migrations import MIGRATIONS

    with psycopg.connect(url, autocommit=True) as connection:
        for migration in MIGRATIONS[:5]:
            for statement in migration.statements_for(True):
                connection.execute(statement.encode())
            for statement in migration.concurrent:
                connection.execute(statement.encode())
        connection.execute("CREATE TABLE llmgw_schema (version BIGINT NOT NULL)")
        connection.execute("INSERT INTO llmgw_schema VALUES (5)")
        start = time.time() - 800 * DAY
        step = 400 * DAY / rows
        connection.execute(
            f"INSERT INTO usage ({_COLUMNS}) SELECT"
            f" {_values('i', start, step, str(rows))}"
            f" FROM generate_series(0, {rows - 1}) AS i".encode()
        )


class Server:
    def __init__(self, state: str, config: str) -> None:
        path = os.path.join(state, f"config-{time.monotonic_ns()}.toml")
        with open(path, "w") as f:
            f.write(config)
        self.log = open(os.path.join(state, f"server-{time.monotonic_ns()}.log"), "w+")
        self.process = subprocess.Popen(
            [
                os.path.join(BIN, "twistd"),
                "-n",
                "--pidfile=",
                "llmgw-server",
                "--config",
                path,
                "--state-dir",
                state,
                "--listen",
                "tcp:0:interface=127.0.0.1",
                "--admin-listen",
                "tcp:0:interface=127.0.0.1",
                "--endpoint",
                "a=http://127.0.0.1:9=x",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.log.seek(0)
            match = re.search(pattern, self.log.read())
            if match is not None or self.process.poll() is not None:
                return match
            time.sleep(0.2)
        return None

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=120)
        self.log.close()


def usage(admin: str) -> dict[str, Any]:
    sums = {}
    for by in ("model", "key"):
        url = f"{admin}/api/v1/usage?by={by}&since=0"
        with urllib.request.urlopen(url, timeout=300) as answer:
            groups = json.load(answer)["usage"]
        sums[by] = [
            (
                g[by],
                g["requests"],
                g["errors"],
                g["prompt_tokens"],
                g["completion_tokens"],
                round(g["mean_latency"] or 0, 6),
                round(g["mean_time_to_first_token"] or 0, 6),
            )
            for g in groups
        ]
    return sums


def serve(state: str, config: str, pattern: str | None) -> tuple[dict[str, Any], float]:
    server = Server(state, config)
    try:
        began = time.monotonic()
        match = server.wait_for(r"admin on [\d.]+:(\d+)", 120)
        if match is None:
            raise SystemExit(f"the server did not start:\n{server.output()}")
        waited = 0.0
        if pattern is not None:
            if server.wait_for(pattern, 3600) is None:
                raise SystemExit(f"no {pattern!r}:\n{server.output()}")
            waited = time.monotonic() - began
            print("  " + re.search(pattern + ".*", server.output()).group(0))  # type: ignore[union-attr]
        return usage(f"http://127.0.0.1:{match.group(1)}"), waited
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument(
        "--url", default="", help="postgresql://... (an empty database)"
    )
    args = parser.parse_args()
    state = tempfile.mkdtemp(prefix="llmgw-store-bench-")
    store = f'[store]\nurl = "{args.url}"\n' if args.url else "[store]\n"
    began = time.monotonic()
    if args.url:
        make_postgres(args.url, args.rows)
    else:
        make_sqlite(os.path.join(state, "llmgw.db"), args.rows)
    print(f"generated {args.rows:,} rows in {time.monotonic() - began:.1f}s ({state})")

    refused = Server(state, store)
    refused.process.wait(timeout=600)
    print(
        f"server refused: exit {refused.process.returncode}: {refused.output().strip()}"
    )
    refused.stop()

    began = time.monotonic()
    migrate = subprocess.run(
        [os.path.join(BIN, "llmgw"), "store", "migrate", "--state-dir", state]
        + (["--config", _config(state, store)] if args.url else []),
        text=True,
    )
    seconds = time.monotonic() - began
    print(f"llmgw store migrate: exit {migrate.returncode} in {seconds:.1f}s")

    before, _ = serve(state, store + 'usage_retention = "100000d"\n', None)
    after, seconds = serve(state, store, r"usage retention: rolled \d+ records")
    print(f"retention: done {seconds:.1f}s after the server started")
    for by in ("model", "key"):
        for row in after[by]:
            print(f"  by {by}: {row}")
    same = before == after
    verdict = "the same" if same else "DIFFERENT"
    print(f"usage API sums before and after retention: {verdict}")
    if not same:
        print(f"  before: {before}\n  after:  {after}")
    return 0 if same and migrate.returncode == 0 else 1


def _config(state: str, text: str) -> str:
    path = os.path.join(state, "migrate.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
