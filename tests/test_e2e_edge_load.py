"""
End to end, the hostile-client suite under numbers: 10,000 idle
connections and 500 slow clients held open against a real C{twistd -n
llmgw-server}, while a well-behaved client keeps being served.  This test
process raises its own open-file limit (and skips when the hard limit is
too low); the server raises its own at start.
"""

from __future__ import annotations

import socket
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.edge_support import (
    P99_BOUND,
    EdgeServer,
    connect,
    parse_response,
    raise_fd_limit,
    read_until_closed,
)

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def still_open(sock: socket.socket) -> bool:
    """
    @return: whether the server has neither closed nor answered C{sock}.
    """
    sock.setblocking(False)
    try:
        return not sock.recv(1)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


class HeldConnectionTests(SynchronousTestCase, EdgeServer):
    """
    Many connections held open do not starve a normal client.
    """

    timeout = 120

    def test_ten_thousand_idle(self) -> None:
        """
        10,000 connections that send nothing, from ten addresses (1,000
        each, under the per-client cap), stay open while a normal client's
        requests succeed; the server logged its open-file limit.
        """
        limit = raise_fd_limit(10_500)
        if limit is not None:
            raise self.skipTest(f"open-file limit {limit}, under 10,500")
        self.start_edge()
        self.server.wait_for("open-file limit")
        idle: list[socket.socket] = []

        def close_all() -> None:
            for sock in idle:
                sock.close()

        self.addCleanup(close_all)
        start = time.monotonic()
        for i in range(10_000):
            idle.append(connect(self.port, f"127.0.0.{2 + i // 1000}"))
            if i % 1000 == 999:
                self.normal.request()
        opened = time.monotonic() - start
        self.normal.latencies.clear()
        self.normal.run(200, 20.0)
        self.assertEqual(len(self.normal.latencies), 200)
        self.assertLess(self.normal.p99(), P99_BOUND)
        sample = idle[::97]
        self.assertEqual([s for s in sample if not still_open(s)], [])
        self.note(f"10,000 idle connections (opened in {opened:.1f}s)")

    def test_five_hundred_slow_clients(self) -> None:
        """
        500 clients dripping header lines are held until the header
        deadline, then each gets a 408; a normal client's requests succeed
        meanwhile.
        """
        limit = raise_fd_limit(1_000)
        if limit is not None:
            raise self.skipTest(f"open-file limit {limit}, under 1,000")
        self.start_edge('header_timeout = "8s"')
        slow: list[socket.socket] = []

        def close_all() -> None:
            for sock in slow:
                sock.close()

        self.addCleanup(close_all)
        start = time.monotonic()
        for _ in range(500):
            sock = connect(self.port)
            sock.sendall(HEAD)
            slow.append(sock)
        for line in range(3):
            self.normal.run(100, 1.0)
            for sock in slow:
                sock.sendall(b"X-Drip-%d: 1\r\n" % line)
        self.assertLess(time.monotonic() - start, 7.0, "too slow to test")
        self.assertEqual([s for s in slow[::25] if not still_open(s)], [])
        self.assertLess(self.normal.p99(), P99_BOUND)
        self.note("500 slow clients")
        statuses = []
        for sock in slow:
            data, _, closed = read_until_closed(
                sock, max(0.1, start + 12 - time.monotonic())
            )
            self.assertTrue(closed)
            statuses.append(parse_response(data)[0])
        self.assertEqual(set(statuses), {408})
        self.normal.run(10, 2.0)
