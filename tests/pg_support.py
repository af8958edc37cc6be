"""
A throwaway PostgreSQL for tests: C{initdb} and C{pg_ctl start} in a
temporary folder, listening on a free loopback port, stopped and removed
when the test (or the test process) ends.

Binaries come from Debian's C{postgresql} package
(C{/usr/lib/postgresql/VERSION/bin}) or C{PATH}.  PostgreSQL refuses to run
as root (C{initdb}: "cannot be run as root"), so a harness running as root
runs them as the C{postgres} user through C{runuser -u postgres --} and
gives that user the temporary folder.

Use::

    url = start_postgres(self)           # a server of the test's own
    url = fresh_database(self)           # a new database on one server
                                         # shared by the test process

Both return C{postgresql://postgres@127.0.0.1:PORT/DB} (trust
authentication on loopback only), and raise L{SkipTest} naming the package
when PostgreSQL is absent, or fail when C{CI=true}.
"""

from __future__ import annotations

import atexit
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from typing import Any

from tests.support import free_port, missing

PACKAGE = "postgresql"
_USER = "postgres"


def _version_key(path: str) -> tuple[int, ...]:
    version = os.path.basename(os.path.dirname(os.path.dirname(path)))
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def find_bindir() -> str | None:
    """
    The folder holding C{initdb}, C{pg_ctl} and C{createdb}: Debian's
    newest C{/usr/lib/postgresql/*/bin}, else the one on C{PATH}.

    @return: the folder, or L{None} when PostgreSQL is not installed.
    """
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version_key)
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    if initdb is not None:
        return os.path.dirname(os.path.realpath(initdb))
    return None


def require_postgres() -> str:
    """
    @return: the binaries' folder (see L{find_bindir}).
    @raise SkipTest: PostgreSQL (or, as root, the C{postgres} user and
        C{runuser}) is missing and C{CI} is not C{true}.
    @raise AssertionError: the same, under C{CI=true}: CI must not skip.
    """
    why = None
    bindir = find_bindir()
    if bindir is None:
        why = f"PostgreSQL not found: install Debian's {PACKAGE!r} package"
    elif os.geteuid() == 0:
        try:
            pwd.getpwnam(_USER)
        except KeyError:
            why = f"running as root without a {_USER!r} user (Debian's {PACKAGE!r})"
        if shutil.which("runuser") is None:
            why = "running as root without runuser (util-linux)"
    if why is None:
        assert bindir is not None
        return bindir
    missing(why)


class PostgresServer:
    """
    One PostgreSQL cluster in a temporary folder.

    @ivar port: its TCP port on 127.0.0.1.
    @ivar directory: the temporary folder (data in C{data/}, its log in
        C{postgres.log}, its Unix socket in the folder itself).
    """

    def __init__(self, bindir: str) -> None:
        self.bindir = bindir
        self.port = free_port()
        self.directory = tempfile.mkdtemp(prefix="llmgw-pg-")
        self._as_root = os.geteuid() == 0
        if self._as_root:
            entry = pwd.getpwnam(_USER)
            os.chown(self.directory, entry.pw_uid, entry.pw_gid)
        self._names = itertools.count(1)
        self.running = False

    def _run(self, *argv: str, timeout: float = 120.0) -> None:
        command = [os.path.join(self.bindir, argv[0]), *argv[1:]]
        if self._as_root:
            command = ["runuser", "-u", _USER, "--", *command]
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("PG", "LLMGW_"))
        }
        env["LC_ALL"] = "C"
        result = subprocess.run(
            command,
            cwd=self.directory,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} exited {result.returncode}:\n"
                f"{result.stdout.decode(errors='replace')}"
                f"{result.stderr.decode(errors='replace')}"
            )

    def start(self) -> None:
        """
        C{initdb}, then C{pg_ctl start -w} (which waits until it accepts
        connections).  Durability is off (C{fsync}, C{synchronous_commit},
        C{full_page_writes}): a test database dies with the test.

        @raise RuntimeError: a step failed (its output in the message).
        """
        data = os.path.join(self.directory, "data")
        self._run(
            "initdb",
            "-D",
            data,
            "-U",
            _USER,
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        )
        self._pg_ctl_start()

    def _pg_ctl_start(self) -> None:
        data = os.path.join(self.directory, "data")
        options = " ".join(
            [
                "-c listen_addresses=127.0.0.1",
                f"-p {self.port}",
                f"-k {self.directory}",
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
                "-c max_connections=200",
            ]
        )
        self._run(
            "pg_ctl",
            "start",
            "-w",
            "-t",
            "60",
            "-D",
            data,
            "-l",
            os.path.join(self.directory, "postgres.log"),
            "-o",
            options,
        )
        self.running = True

    def halt(self) -> None:
        """
        C{pg_ctl stop -m immediate}, keeping the folder, the data and the
        port, for L{resume} (an outage).
        """
        self._run(
            "pg_ctl",
            "stop",
            "-w",
            "-m",
            "immediate",
            "-D",
            os.path.join(self.directory, "data"),
            timeout=60,
        )
        self.running = False

    def resume(self) -> None:
        """
        Start again after L{halt}, on the same port with the same data.
        """
        self._pg_ctl_start()

    def create_database(self, name: str | None = None, *options: str) -> str:
        """
        C{createdb} a new, empty database.

        @param name: its name; by default C{llmgw_N}, new each call.
        @param options: more of C{createdb}'s options (a collation).
        @return: its URL, C{postgresql://postgres@127.0.0.1:PORT/NAME}.
        """
        if name is None:
            name = f"llmgw_{next(self._names)}"
        self._run(
            "createdb",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            _USER,
            *options,
            name,
        )
        return self.url(name)

    def url(self, name: str) -> str:
        """
        @return: the URL of database C{name} on this server.
        """
        return f"postgresql://{_USER}@127.0.0.1:{self.port}/{name}"

    def log(self) -> str:
        """
        @return: the server's log so far (for a failing test's message).
        """
        try:
            with open(
                os.path.join(self.directory, "postgres.log"), errors="replace"
            ) as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> None:
        """
        C{pg_ctl stop -m immediate} and remove the folder.  Safe to call
        twice, and after a failed start.
        """
        if self.running:
            self.running = False
            try:
                self._run(
                    "pg_ctl",
                    "stop",
                    "-w",
                    "-m",
                    "immediate",
                    "-D",
                    os.path.join(self.directory, "data"),
                    timeout=60,
                )
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(self.directory, ignore_errors=True)


def start_postgres(case: Any) -> str:
    """
    A PostgreSQL server of this test's own, stopped and removed in its
    cleanup, with one database C{llmgw}.

    @param case: a trial test case (for C{addCleanup}).
    @return: the database's URL.
    @raise SkipTest: see L{require_postgres}.
    """
    server = PostgresServer(require_postgres())
    case.addCleanup(server.stop)
    server.start()
    return server.create_database("llmgw")


_shared: list[PostgresServer] = []


def shared_server() -> PostgresServer:
    """
    One server for the whole test process, started on first use and
    stopped at exit: C{initdb} costs seconds, a database a fraction.

    @raise SkipTest: see L{require_postgres}.
    """
    if not _shared:
        server = PostgresServer(require_postgres())
        atexit.register(server.stop)
        try:
            server.start()
        except BaseException:
            server.stop()
            raise
        _shared.append(server)
    return _shared[0]


def fresh_database(case: Any, *options: str) -> str:
    """
    A new, empty database on the process's shared server (see
    L{shared_server}); the server outlives the test.

    @param case: a trial test case (unused today; for symmetry with
        L{start_postgres} and a later drop in its cleanup).
    @param options: more of C{createdb}'s options (a collation).
    @return: the database's URL.
    @raise SkipTest: see L{require_postgres}.
    """
    del case
    return shared_server().create_database(
        f"llmgw_{os.getpid()}_{time.monotonic_ns()}", *options
    )
