"""
A throwaway PostgreSQL for the standby tests: C{initdb} and C{pg_ctl} in a
temporary folder, on a free loopback port, as the C{postgres} user (through
C{runuser}) when running as root, since PostgreSQL refuses root.

Engineer K's C{tests/pg_support.py} does the same for the store; on merge
this module gives way to it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile

from twisted.trial.unittest import SkipTest

from tests.support import free_port, hermetic_env


def _bin_dir() -> str | None:
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(os.path.join(folder, "initdb"), os.X_OK):
            return folder
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


class ThrowawayPostgres:
    """
    A PostgreSQL server for one test: L{start} it, use L{url}, L{stop} it.

    @raise SkipTest: from L{start}, when Debian's C{postgresql} package is
        not installed (outside CI; in CI that fails instead).
    """

    def __init__(self) -> None:
        self.url = ""
        self._folder = ""
        self._prefix: list[str] = []
        self._bin = ""

    def start(self) -> str:
        """
        @return: the database URL, C{postgresql://llmgw@127.0.0.1:PORT/postgres}.
        """
        found = _bin_dir()
        if found is None:
            why = "PostgreSQL not found: install Debian's postgresql package"
            if os.environ.get("CI") == "true":
                raise AssertionError(f"CI runs the PostgreSQL tests: {why}")
            raise SkipTest(why)
        self._bin = found
        self._folder = tempfile.mkdtemp(prefix="llmgw-pg-")
        if os.getuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self._folder, user.pw_uid, user.pw_gid)
            self._prefix = ["runuser", "-u", "postgres", "--"]
        data = os.path.join(self._folder, "data")
        port = free_port()
        self._run("initdb", "-D", data, "-A", "trust", "-U", "llmgw", "--no-sync")
        options = (
            f"-p {port} -c listen_addresses=127.0.0.1 -k {self._folder}"
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        log = os.path.join(self._folder, "postgres.log")
        self._run("pg_ctl", "-D", data, "-o", options, "-l", log, "-w", "start")
        self.url = f"postgresql://llmgw@127.0.0.1:{port}/postgres"
        return self.url

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self._prefix, os.path.join(self._bin, tool), *args],
            check=True,
            capture_output=True,
            timeout=120,
            env=hermetic_env(),
            cwd=self._folder,
        )

    def stop(self) -> None:
        """
        Stop the server at once and remove its folder.
        """
        if self._folder:
            data = os.path.join(self._folder, "data")
            try:
                self._run("pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
            except subprocess.CalledProcessError:
                pass
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = ""
