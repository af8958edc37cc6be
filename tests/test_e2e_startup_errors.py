"""
Start-up mistakes of the three daemons, C{llmgw ctl} and C{llmgw certs}
(issue 20, finding 8), each made as an operator would make it and each
started as a user does (C{twistd -n ...}, C{llmgw ...}): every one ends
with one line naming the file, key or flag, no traceback, and the exit
status docs/server.md gives for its kind: 2 for a mistake in the
configuration (a file, key or flag, a certificate or key, the state
directory), 1 for a listener that cannot open.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence

from twisted.trial.unittest import SynchronousTestCase

from tests.support import BIN, TWISTD, hermetic_env, llmgw_certs, make_certs

LOOPBACK = "tcp:0:interface=127.0.0.1"


def _twistd(
    daemon: str, args: Sequence[str], twistd: Sequence[str] = ("--pidfile=",)
) -> list[str]:
    """
    @param twistd: twistd's own flags (C{--pidfile}, C{--logfile}).
    @return: C{twistd -n TWISTD DAEMON ARGS}.
    """
    return [TWISTD, "-n", *twistd, daemon, *args]


def _server(*args: str, twistd: Sequence[str] = ("--pidfile=",)) -> list[str]:
    listeners = ["--listen", LOOPBACK, "--admin-listen", LOOPBACK]
    listeners += ["--agent-listen", LOOPBACK]
    return _twistd("llmgw-server", [*listeners, *args], twistd)


def _agent(
    *args: str, node: str = "gpu-01", twistd: Sequence[str] = ("--pidfile=",)
) -> list[str]:
    dial = ["--server", "127.0.0.1:1", "--node-id", node]
    return _twistd("llmgw-agent", [*dial, *args], twistd)


def _router(*args: str) -> list[str]:
    return _twistd("llmgw-router", args)


class StartupErrorTests(SynchronousTestCase):
    """
    Each mistake: one line, the file or key named, its kind's status.
    """

    timeout = 300

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="llmgw-startup-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.ca = make_certs(self.dir, "127.0.0.1", ["gpu-01"])
        self.other = os.path.join(self.dir, "other-ca")
        llmgw_certs("init", "--dir", self.other)
        llmgw_certs("server", "--dir", self.other, "--host", "127.0.0.1")
        llmgw_certs("agent", "--dir", self.other, "--node-id", "gpu-01")
        self.junk = self.file("junk.pem", "not a certificate\n")
        self.folder = os.path.join(self.dir, "a-folder.pem")
        os.makedirs(self.folder)
        self.plain = self.file("plain-file", "")

    def file(self, name: str, text: str) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def tls_config(self, ca: str, cert: str, key: str) -> str:
        return self.file(
            f"server-{len(os.listdir(self.dir))}.toml",
            f'[agent_tls]\nca = "{ca}"\ncert = "{cert}"\nkey = "{key}"\n',
        )

    def agent_tls(self, replaced: dict[str, str]) -> str:
        """
        @param replaced: file names of gpu-01's TLS folder (C{ca.pem},
            C{agent.pem}, C{agent-key.pem}) to the files put in their place.
        @return: a copy of the folder with those replaced.
        """
        folder = tempfile.mkdtemp(dir=self.dir)
        source = os.path.join(self.ca, "agents", "gpu-01")
        for name in ("ca.pem", "agent.pem", "agent-key.pem"):
            path = replaced.get(name, os.path.join(source, name))
            shutil.copy(path, os.path.join(folder, name))
        return folder

    def refused(self, argv: Sequence[str], status: int, *texts: str) -> str:
        """
        Run C{argv}; it must exit with C{status} after one line holding
        each of C{texts}, and no traceback.

        @return: the line.
        """
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=60,
            env=hermetic_env(),
            stdin=subprocess.DEVNULL,
            cwd=self.dir,
        )
        output = done.stdout + done.stderr
        where = f"{' '.join(argv)}:\n{output[-3000:]}"
        self.assertNotIn("Traceback", output, where)
        self.assertEqual(len(output.strip().splitlines()), 1, where)
        for text in texts:
            self.assertIn(text, output, where)
        self.assertEqual(done.returncode, status, where)
        return output.strip()

    def state(self) -> list[str]:
        return ["--state-dir", tempfile.mkdtemp(dir=self.dir)]

    def test_server_certificates(self) -> None:
        """
        [agent_tls]: a key that is not the certificate's (a 34-line
        traceback before), a missing, unreadable or non-PEM file, and a
        certificate the CA did not sign (before: started, and every agent
        failed its handshake).
        """
        ca, cert, key = (
            os.path.join(self.ca, name)
            for name in ("ca.pem", "server.pem", "server-key.pem")
        )
        other_key = os.path.join(self.other, "server-key.pem")
        other_cert = os.path.join(self.other, "server.pem")
        missing = os.path.join(self.dir, "nowhere", "ca.pem")
        for files, texts in (
            ((ca, cert, other_key), (other_key, "is not the private key of", cert)),
            ((missing, cert, key), (missing, "cannot read")),
            ((ca, cert, self.folder), (self.folder, "cannot read")),
            ((ca, self.junk, key), (self.junk, "not a PEM certificate")),
            ((self.junk, cert, key), (self.junk, "not a PEM certificate")),
            ((ca, cert, self.junk), (self.junk, "not a PEM private key")),
            (
                (ca, other_cert, other_key),
                (other_cert, "is not signed by the CA", ca),
            ),
        ):
            config = self.tls_config(*files)
            self.refused(
                _server("--config", config, *self.state()),
                2,
                "llmgw-server: config error: agent_tls:",
                *texts,
            )

    def test_server_configuration_and_state(self) -> None:
        """
        A bad config file (missing, not TOML, an unknown key), a bad
        endpoint string, a state dir that cannot be made, a log file or
        pid file that cannot be written: status 2.  A port in use: 1.
        """
        good = self.tls_config(
            *(
                os.path.join(self.ca, name)
                for name in ("ca.pem", "server.pem", "server-key.pem")
            )
        )
        cases: list[tuple[list[str], int, tuple[str, ...]]] = [
            (_server("--config", "/nonexistent.toml"), 2, ("/nonexistent.toml",)),
            (
                _server("--config", self.file("bad.toml", "listen = [\n")),
                2,
                ("bad.toml", "not valid TOML"),
            ),
            (
                _server("--config", self.file("key.toml", "lisen = 1\n")),
                2,
                ("lisen: unknown key",),
            ),
            (
                _server("--config", good, "--admin-listen", "nonsense:1"),
                2,
                ("admin_listen: bad endpoint 'nonsense:1'",),
            ),
            (
                _server("--config", good, "--state-dir", self.plain),
                2,
                ("state_dir", self.plain),
            ),
            (
                _server("--config", good, "--state-dir", self.plain + "/sub"),
                2,
                ("state_dir", self.plain + "/sub"),
            ),
        ]
        log = os.path.join(self.dir, "no-folder", "server.log")
        pid = os.path.join(self.dir, "no-folder", "server.pid")
        cases += [
            (
                _server(
                    "--config",
                    good,
                    *self.state(),
                    twistd=("--pidfile=", f"--logfile={log}"),
                ),
                2,
                ("--logfile", log),
            ),
            (
                _server("--config", good, *self.state(), twistd=(f"--pidfile={pid}",)),
                2,
                ("--pidfile", pid),
            ),
        ]
        for argv, status, texts in cases:
            self.refused(argv, status, *texts)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            address = f"tcp:{port}:interface=127.0.0.1"
            for flag, key in (
                ("--listen", "listen"),
                ("--admin-listen", "admin_listen"),
                ("--agent-listen", "agent_listen"),
                ("--metrics-listen", "metrics_listen"),
            ):
                self.refused(
                    _server("--config", good, *self.state(), flag, address),
                    1,
                    f"llmgw-server: {key}: cannot listen on",
                    "in use",
                )

    def test_agent(self) -> None:
        """
        The agent's TLS folder: a key that is not its certificate's, a
        non-PEM file; a bad node id (before: '../gpu-01' started), state
        dir, config file and log file (a traceback before): one line each,
        status 2.  (A certificate another CA signed is the server's to
        refuse, in the handshake, which the agent then tells.)
        """
        other_key = os.path.join(self.other, "agents", "gpu-01", "agent-key.pem")
        for replaced, texts in (
            (
                {"agent-key.pem": other_key},
                ("agent-key.pem is not the private key of",),
            ),
            ({"agent.pem": self.junk}, ("agent.pem: not a PEM certificate",)),
            ({"ca.pem": self.junk}, ("ca.pem: not a PEM certificate",)),
            ({"agent-key.pem": self.junk}, ("agent-key.pem: not a PEM private key",)),
        ):
            folder = self.agent_tls(replaced)
            self.refused(
                _agent("--tls-dir", folder, *self.state()),
                2,
                "llmgw-agent: config error: tls_dir:",
                folder,
                *texts,
            )
        good = os.path.join(self.ca, "agents", "gpu-01")
        log = os.path.join(self.dir, "no-folder", "agent.log")
        cases: tuple[tuple[list[str], tuple[str, ...]], ...] = (
            (
                _agent("--tls-dir", good, *self.state(), node="../gpu-01"),
                ("node_id: bad value '../gpu-01'",),
            ),
            (
                _agent("--tls-dir", good, "--state-dir", self.plain),
                ("state_dir", self.plain),
            ),
            (_agent("--tls-dir", self.dir + "/none"), ("tls_dir", "has no ca.pem")),
            (_agent("--config", "/nonexistent.toml"), ("/nonexistent.toml",)),
            (
                _agent(
                    "--tls-dir",
                    good,
                    *self.state(),
                    twistd=("--pidfile=", f"--logfile={log}"),
                ),
                ("--logfile", log),
            ),
        )
        for argv, wanted in cases:
            self.refused(argv, 2, "llmgw-agent: config error:", *wanted)

    def test_router(self) -> None:
        """
        llmgw-router: no or a bad --control, a --control-ca that is not
        PEM (a traceback before), a bad --routers (twistd's usage text
        before), a bad endpoint string (status 1 before): 2; its port in
        use: 1.
        """
        control = ["--control", "http://127.0.0.1:1"]
        for argv, texts in (
            (_router("--listen", LOOPBACK), ("--control URL is required",)),
            (_router("--listen", LOOPBACK, "--control", "ftp:x"), ("--control",)),
            (
                _router(
                    "--listen",
                    LOOPBACK,
                    "--control",
                    "https://127.0.0.1:1",
                    "--control-ca",
                    self.junk,
                ),
                ("--control-ca", self.junk, "not a PEM certificate"),
            ),
            (
                _router("--listen", LOOPBACK, *control, "--routers", "two"),
                ("--routers: expected a whole number",),
            ),
            (
                _router("--listen", "bogus:3", *control, *self.state()),
                ("listen: bad endpoint 'bogus:3'",),
            ),
            (
                _router("--listen", LOOPBACK, *control, "--state-dir", self.plain),
                (self.plain,),
            ),
        ):
            self.refused(argv, 2, "llmgw-router: config error:", *texts)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            address = f"tcp:{taken.getsockname()[1]}:interface=127.0.0.1"
            for extra in ((), ("--reuse-port",)):
                self.refused(
                    _router("--listen", address, *control, *self.state(), *extra),
                    1,
                    "llmgw-router: listen: cannot listen on",
                    "in use",
                )

    def test_server_file_named(self) -> None:
        """
        A mistake in the server's configuration file is told after the
        file's path (issue 37, item 4), with the value as TOML writes it.
        """
        server = self.file("named.toml", '[control]\nlost_after = "0s"\n')
        self.refused(
            _server("--config", server, *self.state()),
            2,
            f"llmgw-server: config error: {server}: control.lost_after:",
            "'0s'",
        )
        spelled = self.file("spelled.toml", "log_format = true\n")
        self.refused(
            _server("--config", spelled, *self.state()),
            2,
            f"llmgw-server: config error: {spelled}: log_format:",
            "got true",
        )
        # Checked once the flags are merged in: the file named all the same.
        standby = self.file("standby.toml", '[standby]\nurl = "postgresql://h/d"\n')
        self.refused(
            _server("--local", "--config", standby, *self.state()),
            2,
            f"llmgw-server: config error: {standby} with the flags: standby:",
        )

    def test_router_file_named(self) -> None:
        """
        llmgw-router reads the server's file: a mistake there is told after
        the file's path too.
        """
        router = self.file("router.toml", "[router]\nmax_retries = -1\n")
        self.refused(
            _router(
                "--listen",
                LOOPBACK,
                "--control",
                "http://127.0.0.1:1",
                "--config",
                router,
            ),
            2,
            f"llmgw-router: config error: {router}: router.max_retries:",
            "got -1",
        )

    def test_agent_file_named(self) -> None:
        """
        A mistake in the agent's file is told after the file's path.
        """
        agent = self.file(
            "agent.toml", '[[simulated_gpus]]\nname = "g0"\nmemory_gb = 0\n'
        )
        self.refused(
            _agent("--insecure", "--config", agent, *self.state()),
            2,
            f"llmgw-agent: config error: {agent}: simulated_gpus[0].memory_gb:",
        )
        # Checked once the flags are merged in: the file named all the same.
        ram = self.file("ram.toml", 'sleep_memory = "1000000GiB"\n')
        self.refused(
            _agent("--insecure", "--config", ram, *self.state()),
            2,
            f"llmgw-agent: config error: {ram} with the flags: sleep_memory:",
            "more than this node's RAM",
        )

    def test_certs_and_ctl(self) -> None:
        """
        llmgw certs with a CA folder whose files are not PEM (a message
        naming no file before), and llmgw ctl with a bad URL or nothing
        listening: one line, status 1.
        """
        broken = os.path.join(self.dir, "broken-ca")
        os.makedirs(broken)
        for name in ("ca.pem", "ca-key.pem"):
            shutil.copy(self.junk, os.path.join(broken, name))
        llmgw = os.path.join(BIN, "llmgw")
        self.refused(
            [llmgw, "certs", "agent", "--dir", broken, "--node-id", "n1"],
            1,
            "llmgw certs:",
            os.path.join(broken, "ca.pem"),
            "not PEM",
        )
        self.refused(
            [llmgw, "certs", "init", "--dir", self.plain],
            1,
            "llmgw certs:",
            self.plain,
        )
        self.refused([llmgw, "ctl", "--admin-url", "nope", "status"], 1, "--admin-url")
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        self.refused(
            [llmgw, "ctl", "--admin-url", url, "status"],
            1,
            f"cannot reach the admin API at {url}",
        )
