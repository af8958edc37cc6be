"""
Engines found whatever their records say, through real processes:
C{twistd llmgw-server}, C{twistd llmgw-agent} with one simulated GPU
(the agent's own stand-in for a GPU: a name and a memory size), and the
C{llmgw sim} engine.  The agent is restarted with its engine's shard
record cut short (a crash or a full disk while writing), deleted, and
unreadable: each time the one engine on GPU 0 is adopted again, by the
marker in its environment, and never joined by a second.
"""

from __future__ import annotations

import json
import os
import signal
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.test_e2e_control import MODELS, _Fleet

ONE_GPU = """
address = "{address}"
[[simulated_gpus]]
name = "H200"
memory_gb = 141
"""


def _session_leaders_writing_under(folder: str) -> list[int]:
    """
    @return: the processes leading their own session whose standard output
        is a file under C{folder}: the engines an agent with its state there
        started (their output goes to C{shards/ID.log}), found without the
        agent's records or markers.
    """
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            target = os.readlink(f"/proc/{name}/fd/1")
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[3]) == int(name):
            if target.startswith(folder + os.sep):
                pids.append(int(name))
    return sorted(pids)


class RecordLossTests(_Fleet, SynchronousTestCase):
    timeout = 240

    def engines(self) -> list[int]:
        return _session_leaders_writing_under(os.path.join(self.dir, "state-gpu-01"))

    def kill_engines(self) -> None:
        for pid in self.engines():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    def test_cut_deleted_unreadable_record(self) -> None:
        """
        A ready replica on the only GPU; the agent stops, its record is
        cut in half, then deleted, then made unreadable bytes, and the agent
        starts again each time: the same engine (pid) serves the same
        replica, one engine runs on the node for 3 s after each restart,
        nothing new is placed, a cut or unreadable record is kept aside
        with one warning, and the record is written again.
        """
        self.addCleanup(self.kill_engines)
        config = self.config(MODELS.format(min_replicas=1, idle="0s"))
        self.start_fleet_server(config)
        agent = self.start_agent("gpu-01", ONE_GPU)
        (replica,) = self.ready(1)
        pid = replica["shards"][0]["pid"]
        shard = replica["shards"][0]["id"]
        self.assertEqual(self.engines(), [pid])
        shards = os.path.join(self.dir, "state-gpu-01", "shards")
        record = os.path.join(shards, shard + ".json")
        placed = self.server.output().count("placed replica")
        for case in ("cut", "deleted", "unreadable"):
            agent.stop()
            self.assertEqual(self.engines(), [pid], "the engine outlives its agent")
            with open(record, "rb") as f:
                whole = f.read()
            if case == "cut":
                with open(record, "wb") as f:
                    f.write(whole[: len(whole) // 2])
            elif case == "deleted":
                os.remove(record)
            else:
                with open(record, "wb") as f:
                    f.write(b"\xff\xfe\x00\x01" * 64)
            agent = self.start_agent("gpu-01", ONE_GPU)
            agent.wait_for(r"registered with llmgw-server")
            registered = time.monotonic()
            while time.monotonic() - registered < 3:
                self.assertEqual(self.engines(), [pid], case)
                time.sleep(0.1)
            (after,) = self.ready(1)
            self.assertEqual(
                (after["id"], after["shards"][0]["pid"]), (replica["id"], pid), case
            )
            self.assertEqual(self.engines(), [pid], case)
            self.assertRegex(
                agent.output(),
                r"adopted shard \S+ of replica \S+ by its engine's marker",
            )
            warnings = agent.output().count("unreadable shard record")
            if case == "deleted":
                self.assertEqual(warnings, 0)
            else:
                self.assertEqual(warnings, 1, agent.output())
                with open(record + ".unreadable", "rb") as f:
                    self.assertNotEqual(f.read(), whole)
            with open(record) as f:
                self.assertEqual(json.load(f)["pid"], pid, case)
        self.assertEqual(self.server.output().count("placed replica"), placed)
        self.assertNotIn("is not free", self.server.output())
        self.assertTrue(self.chat())

    def test_lost_record_of_a_model_no_longer_wanted(self) -> None:
        """
        The agent stops, its record is deleted, and the server restarts
        with a catalog without the model: the agent finds the engine by
        its marker and lists it, and the server stops it (the stray rule);
        no engine runs on the node within 15 s.
        """
        self.addCleanup(self.kill_engines)
        self.start_fleet_server(self.config(MODELS.format(min_replicas=1, idle="0s")))
        agent = self.start_agent("gpu-01", ONE_GPU)
        (replica,) = self.ready(1)
        pid = replica["shards"][0]["pid"]
        shards = os.path.join(self.dir, "state-gpu-01", "shards")
        agent.stop()
        self.server.stop()
        os.remove(os.path.join(shards, replica["shards"][0]["id"] + ".json"))
        other = MODELS.replace('name = "chat"', 'name = "other"')
        self.start_fleet_server(self.config(other.format(min_replicas=0, idle="0s")))
        agent = self.start_agent("gpu-01", ONE_GPU)
        agent.wait_for(rf"by its engine's marker \(pid {pid}\)")
        self.until(lambda: not self.engines(), 15, "the stray engine stopped")
        self.assertIn("'chat' is not in the catalog", self.server.output())
