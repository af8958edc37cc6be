"""
End to end: a client slower than the engine (issue 13, case 10).  The
deadlines measure the replica, not llmgw: while a slow reader holds the
stream back, the idle deadline does not run; a client that reads nothing
for C{client_stall_timeout} is cut, and named in the log.
"""

from __future__ import annotations

import json
import re
import socket
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.fake_upstream import FakeUpstream
from tests.support import Processes
from tests.test_e2e_router import MESSAGES

STREAM_MIB = 8
"""
What the engine would send: 140 writes of 600 events of 101 bytes.
"""


class SlowClientTests(SynchronousTestCase, Processes):
    timeout = 60

    def setUp(self) -> None:
        self.fake = FakeUpstream()
        self.addCleanup(self.fake.stop)
        self.server, self.url, _ = self.start_server(
            "--endpoint",
            f"fake={self.fake.url}=m",
            config='[router]\nidle_timeout = "1s"\nclient_stall_timeout = "3s"\n',
        )

    def test_slow_reader_not_blamed_on_replica(self) -> None:
        """
        A reader at 4 KiB/s of a fast 8 MiB stream: for 6 s (six idle
        deadlines, two stall timeouts) llmgw holds the engine back and the
        stream goes on; then the client reads nothing, and after
        client_stall_timeout it is cut with a warning naming its address
        and the request, not the replica; its usage is recorded (status
        499, estimated).
        """
        port = int(self.url.rsplit(":", 1)[1])
        body = json.dumps(
            {
                "model": "m",
                "messages": MESSAGES,
                "stream": True,
                "mode": "flood",
                "chunks": 140,
                "finish": True,
            }
        ).encode()
        rid = "slow-reader-1"
        with socket.socket() as slow:
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            slow.settimeout(5)
            slow.connect(("127.0.0.1", port))
            client = f"127.0.0.1:{slow.getsockname()[1]}"
            slow.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nX-Request-ID: %s\r\n"
                b"Content-Length: %d\r\n\r\n" % (rid.encode(), len(body)) + body
            )
            received = bytearray()
            started = time.monotonic()
            while time.monotonic() - started < 6:  # 4 KiB/s: 1 KiB per 0.25 s
                try:
                    received += slow.recv(1024)
                except OSError:
                    raise AssertionError(self.server.output()[-3000:]) from None
                time.sleep(0.25)
            read_for = time.monotonic() - started
            self.assertGreater(len(received), 12 * 1024)
            self.assertLess(len(received), 40 * 1024)
            logged = self.server.output()
            # The stream goes on: no deadline blamed on the replica, and the
            # request not ended (its record is written when it ends).
            self.assertNotIn("status=504", logged)
            self.assertNotIn("idle_timeout", logged)
            self.assertNotIn(f" client_id={rid} ", logged)
            self.assertNotIn(b'"error"', bytes(received))
            self.assertLess(self.fake.flood_sent, STREAM_MIB * 1024 * 1024)
            # Now the client reads nothing.
            deadline = time.monotonic() + 10
            while "read nothing" not in self.server.output():
                self.assertLess(time.monotonic(), deadline, "no stall logged")
                time.sleep(0.2)
            stalled_after = time.monotonic() - started - read_for
        # The connection is cut within the stall timeout and a quarter
        # more (checks every quarter) and a margin for the process.
        self.assertLess(stalled_after, 3 * 1.25 + 1.5)
        # Its warning names it by llmgw's own id, as its request line does.
        own = self.server.wait_for(
            rf"request (\S+) client_id={rid} .* status=499"
        ).group(1)
        logged = self.server.output()
        (warning,) = [line for line in logged.splitlines() if "read nothing" in line]
        self.assertIn(f"request {own}: client {client} read nothing for 3s", warning)
        self.assertIn("the replica was not late", warning)
        record = re.search(
            rf"request {own} client_id={rid} .* status=499"
            r" prompt_tokens=(\d+) completion_tokens=(\d+)",
            logged,
        )
        assert record is not None
        self.assertGreater(int(record.group(1)), 0)
        self.assertGreater(int(record.group(2)), 0)
        self.assertFalse(self.fake.flood_finished)
        self.assertNotIn("Traceback", logged)
