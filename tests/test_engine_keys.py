"""
Engine secrets, unit by unit: each engine's flag and the probe's header
(L{llmgw.agent.engines.build}), the server's derivation
(L{llmgw.server.engine_keys.EngineKeys}), the headers the router sends
(L{llmgw.router.upstream.base.upstream_headers}), and the sim's C{--api-key}.
The whole path through real processes is L{tests.test_e2e_engine_keys}.
"""

from __future__ import annotations

import os
import shutil
import stat

from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent.engines import build
from llmgw.router.interfaces import Endpoint
from llmgw.router.upstream.base import upstream_headers
from llmgw.server.engine_keys import SECRET_FILE, EngineKeys
from llmgw.wire import agent_pb2 as pb


class BuildTests(SynchronousTestCase):
    def test_each_engine_gets_its_flag(self) -> None:
        """
        With C{api_key}, each engine's command line ends with its flag and
        the key (after the profile's args: the key is not theirs to
        change), and the probe sends C{Authorization: Bearer}; the key is
        not in the launch's repr.  Without, neither.
        """
        self.patch(
            shutil,
            "which",
            lambda name: None,
        )
        for engine, flag in (
            ("vllm", "--api-key"),
            ("sglang", "--api-key"),
            ("llamacpp", "--api_key"),
            ("sim", "--api-key"),
        ):
            command = pb.StartShard(
                engine=engine, source="s", model="m", port=8000, args=["--x", "1"]
            )
            plain = build(command)
            self.assertEqual(plain.headers, {})
            self.assertNotIn(flag, plain.argv)
            command.api_key = "llmgw-secret"
            launch = build(command)
            self.assertEqual(launch.argv[-4:], ["--x", "1", flag, "llmgw-secret"])
            self.assertEqual(launch.argv[:-2], plain.argv)
            self.assertEqual(launch.headers, {"Authorization": "Bearer llmgw-secret"})
            self.assertEqual(launch.probes, plain.probes)
            self.assertNotIn("llmgw-secret", repr(launch))

    def test_llama_server_flag(self) -> None:
        """
        llama-server, when installed, takes C{--api-key}.
        """
        self.patch(
            shutil,
            "which",
            lambda name: "/usr/bin/llama-server",
        )
        launch = build(
            pb.StartShard(engine="llamacpp", source="s", model="m", port=1, api_key="k")
        )
        self.assertEqual(launch.argv[0], "llama-server")
        self.assertEqual(launch.argv[-2:], ["--api-key", "k"])


class EngineKeysTests(SynchronousTestCase):
    def test_derived_stable_and_private(self) -> None:
        """
        The secret file is made 0600 on first use; keys differ per shard,
        are the same after a restart (a new L{EngineKeys} on the same
        directory) and change with another secret; a damaged file is a
        clear error.
        """
        state = self.mktemp()
        keys = EngineKeys(state)
        path = os.path.join(state, SECRET_FILE)
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
        first = keys.for_shard("chat-1a2b3c4d-0")
        self.assertRegex(first, r"^llmgw-[0-9a-f]{64}$")
        self.assertNotEqual(first, keys.for_shard("chat-1a2b3c4d-1"))
        self.assertEqual(EngineKeys(state).for_shard("chat-1a2b3c4d-0"), first)
        self.assertNotIn(first, repr(keys))
        other = EngineKeys(self.mktemp())
        self.assertNotEqual(other.for_shard("chat-1a2b3c4d-0"), first)
        with open(path, "w") as f:
            f.write("not hex\n")
        with self.assertRaises(ValueError) as raised:
            EngineKeys(state)
        self.assertIn(
            "expected the engine secret, 64 hex digits", str(raised.exception)
        )


class RouterHeadersTests(SynchronousTestCase):
    def test_only_the_engine_key(self) -> None:
        """
        The router's headers to a replica carry its key, and nothing else
        of the client's; without a key, no C{Authorization}; the endpoint's
        repr does not show the key.
        """
        headers = dict(upstream_headers(b"text/event-stream", b"req-1", "llmgw-k"))
        self.assertEqual(headers[b"Authorization"], b"Bearer llmgw-k")
        self.assertEqual(headers[b"Accept"], b"text/event-stream")
        self.assertNotIn(b"Authorization", dict(upstream_headers(None, b"r", "")))
        self.assertNotIn(
            "llmgw-k", repr(Endpoint("r", "http://h:1", ("m",), 1.0, "llmgw-k"))
        )
