"""
C{llmgw store migrate [--dry-run]}: the store's pending migrations, those
that rewrite rows included, applied with progress while no server runs on
the database (docs/store.md).  It reads the server's configuration file
for C{[store] url} and C{state_dir}, as the server does.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
import time

from llmgw.config import load_config
from llmgw.config_checks import ConfigError
from llmgw.store.db import SQLiteStore, StoreError, open_store
from llmgw.store.migrations import MIGRATIONS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgw store",
        description="The store's schema: apply the pending migrations.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    migrate = commands.add_parser(
        "migrate",
        help="apply the pending migrations (those that rewrite rows included)",
    )
    migrate.add_argument(
        "--config", "-c", help="the server's TOML configuration file ([store] url)"
    )
    migrate.add_argument(
        "--state-dir", help="the server's state directory (its default store)"
    )
    migrate.add_argument(
        "--dry-run",
        action="store_true",
        help="list what would run, and change nothing",
    )
    return parser


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _unheld(store: SQLiteStore) -> None:
    """
    @raise StoreError: a server holds the SQLite file (its lock file
        beside it, as C{llmgw.server.build} takes it).
    """
    lock = store.path + ".lock"
    if not os.path.exists(lock):
        return
    with open(lock, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise StoreError(
                f"{store.path!r} is in use by llmgw-server pid {holder}: stop it first"
            ) from None
        fcntl.flock(handle, fcntl.LOCK_UN)


def main(argv: list[str]) -> int:
    """
    @param argv: the arguments after C{llmgw store}.
    @return: the exit status: 0 done (or nothing to do), 1 the store
        cannot be opened or a migration failed (rolled back: run it
        again), 2 a usage or configuration error.
    """
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as e:
        sys.stderr.write(f"llmgw store: config error: {e}\n")
        return 2
    state_dir = args.state_dir or config.state_dir
    began = time.monotonic()
    try:
        store = open_store(config.store_url, state_dir)
    except StoreError as e:
        sys.stderr.write(f"llmgw store: {e}\n")
        return 1
    try:
        if isinstance(store, SQLiteStore) and not args.dry_run:
            _unheld(store)
        _say(
            f"llmgw store migrate: {store.path} (this llmgw: schema {len(MIGRATIONS)})"
        )
        version = store.migrate(_say, dry_run=args.dry_run)
    except StoreError as e:
        sys.stderr.write(f"llmgw store: {e}\n")
        return 1
    finally:
        store.close()
    if args.dry_run:
        _say(f"dry run: nothing changed; the database is at schema {version}")
    else:
        seconds = time.monotonic() - began
        _say(f"the database is at schema {version} ({seconds:.1f}s)")
    return 0
