"""
The agent's shard records and engine markers (L{llmgw.agent.records}):
records written whole or not at all; engines found by the marker in their
environment, read back from /proc, without any record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.records import (
    MARKER,
    marked,
    marker,
    process_start_time,
    write_record,
)


class WriteRecordTests(SynchronousTestCase):
    def test_failed_write_keeps_old_record(self) -> None:
        """
        A write that fails part way (here: a value JSON cannot hold)
        leaves the old record as it was, not a record cut short.
        """
        path = os.path.join(tempfile.mkdtemp(), "s-0.json")
        write_record(path, {"pid": 1})
        self.assertEqual(oct(os.stat(path).st_mode & 0o777), "0o600")
        with self.assertRaises(TypeError):
            write_record(path, {"pid": 2, "bad": object()})
        with open(path) as f:
            self.assertEqual(json.load(f), {"pid": 1})


class MarkedTests(SynchronousTestCase):
    def test_found_by_marker(self) -> None:
        """
        A session leader carrying the marker of this state directory is
        found, with its pid, start time and record; a child it forked
        (same environment, not a session leader) and one marked for
        another state directory are not.
        """
        state = tempfile.mkdtemp()
        record = {"command": {"shardId": "s-0", "replicaId": "r"}, "host": "h"}
        code = (
            "import os, subprocess, sys, time\n"
            "os.setsid()\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "time.sleep(30)\n"
        )
        processes = []
        for folder in (state, tempfile.mkdtemp()):
            env = {**os.environ, MARKER: marker("n1", folder, record)}
            process = subprocess.Popen([sys.executable, "-c", code], env=env)
            processes.append(process)
            self.addCleanup(process.wait)
            self.addCleanup(os.killpg, process.pid, 9)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if os.getsid(processes[0].pid) == processes[0].pid:
                break
            time.sleep(0.02)
        time.sleep(0.5)
        (found,) = marked(state)
        self.assertEqual(found.pid, processes[0].pid)
        self.assertEqual(found.start_time, process_start_time(processes[0].pid))
        self.assertEqual(found.record, record)
