"""
The agent link's frame maximum end to end (issue 13, case 8): an agent
whose weights directory lists more than one frame holds, with C{twistd -n
llmgw-server} and C{twistd -n llmgw-agent} over mutual TLS, driven by
C{llmgw ctl} as an operator would.
"""

from __future__ import annotations

import os
import time

from twisted.trial.unittest import SynchronousTestCase

from tests.test_e2e_control import MODELS, _Fleet
from tests.test_e2e_store import WEIGHTS_AGENT, _Ctl

FILES = 40_000


class WeightsFrameTests(_Fleet, SynchronousTestCase, _Ctl):
    def test_oversize_weights_report(self) -> None:
        """
        40,000 files with 100-character names (a 6.5 MB list, over the
        4 MiB frame): the agent sends the first files that fit in one
        frame, flagged truncated with the total; the server lists them (as
        many as it keeps) with the flag, C{ctl weights} says so, and C{ctl
        weights --collect} refuses to act, deleting nothing; no traceback
        in either log, one warning on the agent's side.
        """
        weights = os.path.join(self.dir, "weights")
        os.makedirs(weights)
        for i in range(FILES):
            name = f"{i:06d}-" + "m" * 93
            assert len(name) == 100
            with open(os.path.join(weights, name), "wb"):
                pass
        self.start_fleet_server(self.config(MODELS.format(min_replicas=0, idle="0s")))
        agent = self.start_agent("gpu-01", WEIGHTS_AGENT.replace("{weights}", weights))
        started = time.monotonic()
        (node,) = self.until(
            lambda: [n for n in self.ctl_json("weights")["nodes"] if n["files"]],
            60,
            "a weights report",
        )
        took = time.monotonic() - started
        self.assertEqual((node["truncated"], node["total"]), (True, FILES))
        self.assertGreater(len(node["files"]), 1000)
        self.assertLess(len(node["files"]), FILES)
        self.assertEqual(
            os.path.basename(node["files"][0]["path"]), "000000-" + "m" * 93
        )

        listing = self.ctl("weights").stdout
        self.assertIn(f"TRUNCATED: {len(node['files'])} of {FILES} entries", listing)
        refused = self.ctl("weights", "--collect", ok=False)
        self.assertEqual(refused.returncode, 1)
        self.assertIn(
            "refusing, the weights list of gpu-01 is truncated", refused.stderr
        )
        self.assertEqual(len(os.listdir(weights)), FILES)
        # The server refuses too, for a client that does not ask first.
        collected = self.admin("/api/v1/weights/collect", "POST")
        self.assertEqual(collected["nodes"][0]["removed"], False)
        self.assertIn("truncated", collected["nodes"][0]["error"])
        self.assertEqual(len(os.listdir(weights)), FILES)

        agent.wait_for("frames up to 4194304 bytes")
        agent_log, server_log = agent.output(), self.server.output()
        self.assertNotIn("Traceback", agent_log)
        self.assertNotIn("Traceback", server_log)
        self.assertNotIn("FrameError", agent_log)
        self.assertEqual(
            agent_log.count("the report to the server carries the first"), 1
        )
        self.assertIn(f"weights directories hold {FILES} entries", agent_log)
        print(f"\nfirst report listed after {took:.1f}s; {len(node['files'])} files")
