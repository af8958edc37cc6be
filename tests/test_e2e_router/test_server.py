"""
End to end: the server's start, its TLS listener, and its stop.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import tempfile

from twisted.trial.unittest import SynchronousTestCase

from tests.support import TWISTD, Processes, hermetic_env
from tests.test_e2e_router import MESSAGES, client


class StartupTests(SynchronousTestCase, Processes):
    """
    What an operator sees when the configuration is wrong.
    """

    timeout = 60

    def run_server(self, *args: str, config: str | None = None) -> tuple[int, str]:
        # Its own state directory and admin port, not the defaults that a
        # server the user runs (make run) holds.
        argv = [
            TWISTD,
            "-n",
            "--pidfile=",
            "llmgw-server",
            "--state-dir",
            tempfile.mkdtemp(prefix="llmgw-state-"),
            "--admin-listen",
            "tcp:0:interface=127.0.0.1",
            *args,
        ]
        if config is not None:
            path = tempfile.mktemp(suffix=".toml")
            with open(path, "w") as f:
                f.write(config)
            self.addCleanup(os.remove, path)
            argv += ["--config", path]
        done = subprocess.run(
            argv, capture_output=True, timeout=30, text=True, env=hermetic_env()
        )
        return done.returncode, done.stdout + done.stderr

    def assertOneLineError(self, output: str, *fragments: str) -> None:
        self.assertNotIn("Traceback", output)
        lines = output.strip().splitlines()
        self.assertEqual(len(lines), 1, output)
        for fragment in fragments:
            self.assertIn(fragment, lines[0])

    def test_config_errors(self) -> None:
        """
        An unknown key, a bad duration, a bad URL and a missing field each
        exit non-zero with one line naming the key and the value.
        """
        endpoint = (
            '[[endpoints]]\nid = "a"\nurl = "http://127.0.0.1:1"\nmodels = ["m"]\n'
        )
        cases = [
            ("colour = 1\n" + endpoint, ["colour", "unknown key"]),
            (
                '[router]\nidle_timeout = "5x"\n' + endpoint,
                ["router.idle_timeout", "'5x'"],
            ),
            (
                '[[endpoints]]\nid = "a"\nurl = "ftp:/x"\nmodels = ["m"]\n',
                ["endpoints[0].url", "'ftp:/x'"],
            ),
            (
                '[[endpoints]]\nid = "a"\nmodels = ["m"]\n',
                ["endpoints[0].url", "missing"],
            ),
            ("listen = \n", ["not valid TOML"]),
        ]
        for config, fragments in cases:
            code, output = self.run_server(config=config)
            self.assertNotEqual(code, 0, config)
            self.assertOneLineError(output, *fragments)

    def test_nothing_to_serve(self) -> None:
        """
        No replica at all is an error that says what to add.
        """
        code, output = self.run_server()
        self.assertNotEqual(code, 0)
        self.assertOneLineError(
            output, "nothing to serve", "--endpoint", "[[endpoints]]"
        )

    def test_bad_endpoint_flag_and_port_in_use(self) -> None:
        """
        A malformed --endpoint and a listener that cannot bind are one line
        each, not a traceback or a process that serves nothing.
        """
        code, output = self.run_server("--endpoint", "just-a-name")
        self.assertNotEqual(code, 0)
        self.assertOneLineError(output, "--endpoint", "just-a-name")
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            code, output = self.run_server(
                "--endpoint",
                "a=http://127.0.0.1:1=m",
                "--listen",
                f"tcp:{port}:interface=127.0.0.1",
            )
        self.assertNotEqual(code, 0)
        self.assertNotIn("Traceback", output)
        self.assertIn(f"cannot listen on 'tcp:{port}", output)

    def test_flag_overrides_file(self) -> None:
        """
        --endpoint replaces the file's endpoints.
        """
        _, sim_url = self.start_sim(model="from-flag")
        _, url, _ = self.start_server(
            "--endpoint",
            f"flag={sim_url}=from-flag",
            config='[[endpoints]]\nid = "file"\nurl = "http://127.0.0.1:1"\n'
            'models = ["from-file"]\n',
        )
        self.assertEqual([m.id for m in client(url).models.list().data], ["from-flag"])


class TLSTests(SynchronousTestCase, Processes):
    """
    The client listener over TLS through an ssl: endpoint string.
    """

    timeout = 60

    def test_tls_offers_h2(self) -> None:
        """
        An ssl: listener negotiates HTTP/2 over ALPN and serves over it.
        """
        import h2.config
        import h2.connection
        import h2.events

        from llmgw.wire.certs import init_ca, issue_server

        directory = tempfile.mkdtemp()
        ca = init_ca(directory)
        cert = issue_server(directory, ["127.0.0.1"])
        key = os.path.join(directory, "server-key.pem")
        _, sim_url = self.start_sim()
        _, url, _ = self.start_server(
            "--endpoint",
            f"s={sim_url}=sim-model",
            "--listen",
            f"ssl:0:interface=127.0.0.1:privateKey={key}:certKey={cert}",
        )
        port = int(url.rsplit(":", 1)[1])
        context = ssl.create_default_context(cafile=ca)
        context.set_alpn_protocols(["h2", "http/1.1"])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                self.assertEqual(tls.selected_alpn_protocol(), "h2")
                connection = h2.connection.H2Connection(
                    h2.config.H2Configuration(client_side=True)
                )
                connection.initiate_connection()
                connection.send_headers(
                    1,
                    [
                        (":method", "GET"),
                        (":path", "/v1/models"),
                        (":authority", "127.0.0.1"),
                        (":scheme", "https"),
                    ],
                    end_stream=True,
                )
                tls.sendall(connection.data_to_send())
                body = b""
                status = None
                ended = False
                while not ended:
                    data = tls.recv(65536)
                    self.assertTrue(data, "connection closed")
                    for event in connection.receive_data(data):
                        if isinstance(event, h2.events.ResponseReceived):
                            status = dict(event.headers)[b":status"]
                        elif isinstance(event, h2.events.DataReceived):
                            body += event.data
                        elif isinstance(event, h2.events.StreamEnded):
                            ended = True
                    tls.sendall(connection.data_to_send())
        self.assertEqual(status, b"200")
        self.assertEqual(json.loads(body)["data"][0]["id"], "sim-model")


class ShutdownTests(SynchronousTestCase, Processes):
    """
    Stopping the server.
    """

    timeout = 60

    def test_sigterm_drains_streams(self) -> None:
        """
        On SIGTERM the server stops accepting connections, lets a stream in
        flight run to its end, then exits as a process stopped by SIGTERM,
        without error.
        """
        _, sim_url = self.start_sim("--itl", "0.05")
        server, url, _ = self.start_server("--endpoint", f"s={sim_url}=sim-model")
        port = int(url.rsplit(":", 1)[1])
        stream = client(url).chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=40, stream=True
        )
        chunks = [next(iter(stream))]
        server.popen.send_signal(signal.SIGTERM)
        server.wait_for("draining: waiting up to")
        with self.assertRaises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        chunks.extend(stream)
        self.assertEqual(
            len([c for c in chunks if c.choices and c.choices[0].delta.content]), 40
        )
        # twistd ends by re-raising the signal it stopped on, as a process
        # killed by it would (systemd counts that as a clean stop).
        self.assertEqual(server.popen.wait(10), -signal.SIGTERM)
        self.assertNotIn("Traceback", server.output())

    def test_second_sigterm_while_draining(self) -> None:
        """
        A second SIGTERM while the server drains (a process group stopped
        as a whole: twistd gets one and C{scripts/run-local} forwards
        another) is logged and ignored: the stream in flight still ends,
        the exit is the first signal's, and nothing is logged as critical.
        """
        _, sim_url = self.start_sim("--itl", "0.05")
        server, url, _ = self.start_server("--endpoint", f"s={sim_url}=sim-model")
        stream = client(url).chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=40, stream=True
        )
        chunks = [next(iter(stream))]
        server.popen.send_signal(signal.SIGTERM)
        server.wait_for("draining: waiting up to")
        server.popen.send_signal(signal.SIGTERM)
        server.wait_for("SIGTERM while stopping: already stopping")
        chunks.extend(stream)
        self.assertEqual(
            len([c for c in chunks if c.choices and c.choices[0].delta.content]), 40
        )
        self.assertEqual(server.popen.wait(10), -signal.SIGTERM)
        self.assertNotIn("Traceback", server.output())
        self.assertNotIn("critical", server.output())
