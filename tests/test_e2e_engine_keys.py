"""
Engine secrets end to end (issue 13, case 12): every engine llmgw starts
has a key of its own that only the router sends; a request straight to the
engine's port without it gets 401; the client's key never reaches an
engine; a static endpoint's C{api_key} is sent to it.  C{twistd -n
llmgw-server}, C{twistd -n llmgw-agent} over mutual TLS and the sim engine
it starts, as an operator runs them.
"""

from __future__ import annotations

import json
import os
import stat

from twisted.trial.unittest import SynchronousTestCase

from llmgw.server.engine_keys import SECRET_FILE, EngineKeys
from tests.fake_upstream import FakeUpstream
from tests.support import Processes, http
from tests.test_e2e_control import MODELS, _Fleet

CLIENT_KEY = "sk-client-key-that-must-stay-here"


def _chat(model: str, mode: str | None = None) -> bytes:
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
    }
    if mode is not None:
        body["mode"] = mode
    return json.dumps(body).encode()


class StaticEndpointKeyTests(SynchronousTestCase, Processes):
    timeout = 60

    def test_static_endpoint_api_key(self) -> None:
        """
        A static C{[[endpoints]]} table's C{api_key} is sent to that
        replica as C{Authorization: Bearer}; the client's C{Authorization}
        and C{api-key} are not; the key is not in C{/api/v1/replicas}
        nor in the log.
        """
        upstream = FakeUpstream()
        self.addCleanup(upstream.stop)
        engine_key = "static-engine-key-0123456789"
        server, url, admin_url = self.start_server(
            config=(
                "[[endpoints]]\n"
                'id = "fake"\n'
                f'url = "{upstream.url}"\n'
                'models = ["m"]\n'
                f'api_key = "{engine_key}"\n'
            )
        )
        status, _, body = http(
            "POST",
            url + "/v1/chat/completions",
            _chat("m", "ok"),
            {
                "content-type": "application/json",
                "authorization": f"Bearer {CLIENT_KEY}",
                "api-key": CLIENT_KEY,
            },
        )
        self.assertEqual(status, 200, body)
        (seen,) = upstream.headers_seen
        self.assertEqual(seen["authorization"], f"Bearer {engine_key}")
        self.assertNotIn("api-key", seen)
        self.assertNotIn(CLIENT_KEY, json.dumps(seen))
        for path in ("/api/v1/replicas", "/api/v1/status"):
            _, _, answer = http("GET", admin_url + path)
            self.assertNotIn(engine_key.encode(), answer)
        self.assertNotIn(engine_key, server.output())

    def test_static_endpoint_bad_api_key(self) -> None:
        """
        An C{api_key} that could not go in a header is a config error naming
        the field, not the value.
        """
        from tests.support import TWISTD, spawn

        path = os.path.join(self._directory(), "bad.toml")
        with open(path, "w") as f:
            f.write(
                '[[endpoints]]\nid = "e"\nurl = "http://127.0.0.1:1"\n'
                'models = ["m"]\napi_key = "two words"\n'
            )
        process = spawn(
            [TWISTD, "-n", "--pidfile=", "llmgw-server", "--config", path],
            self._directory(),
            "bad-server",
        )
        self.assertEqual(process.popen.wait(30), 2)
        output = process.output()
        self.assertIn(
            "endpoints[0].api_key: expected a string of visible ASCII", output
        )
        self.assertNotIn("two words", output)
        self.assertNotIn("Traceback", output)


class EngineKeyTests(_Fleet, SynchronousTestCase):
    def test_engines_get_their_own_key(self) -> None:
        """
        The agent starts the sim engine with its key; the router's requests
        carry it and succeed; straight to the engine's port, no key, the
        client's key or another shard's get 401 (C{/health} stays open, as
        the engines leave it); the key is in no log and not in the admin
        API; the server secret file and the agent's shard record are 0600;
        a restarted server derives the same key for the engine it adopts.
        """
        config = self.config(MODELS.format(min_replicas=1, idle="0s"))
        self.start_fleet_server(config)
        agent = self.start_agent("gpu-01")
        (replica,) = self.ready(1)
        (shard,) = replica["shards"]
        state = os.path.join(self._directory(), "server-state")

        status, _, body = http(
            "POST",
            self.api_url + "/v1/chat/completions",
            _chat("chat"),
            {
                "content-type": "application/json",
                "authorization": f"Bearer {CLIENT_KEY}",
            },
        )
        self.assertEqual(status, 200, body)

        engine = f"http://127.0.0.1:{shard['port']}"
        for headers in (
            {},
            {"authorization": f"Bearer {CLIENT_KEY}"},
            {"authorization": "Bearer llmgw-" + "0" * 64},
        ):
            status, _, body = http(
                "POST",
                engine + "/v1/chat/completions",
                _chat("chat"),
                {"content-type": "application/json", **headers},
            )
            self.assertEqual(status, 401, (headers, body))
            self.assertEqual(json.loads(body)["error"]["code"], "invalid_api_key")
        self.assertEqual(http("GET", engine + "/health")[0], 200)
        secret_file = os.path.join(state, SECRET_FILE)
        self.assertEqual(stat.S_IMODE(os.stat(secret_file).st_mode), 0o600)
        key = EngineKeys(state).for_shard(shard["id"])
        self.assertNotEqual(key, EngineKeys(state).for_shard(shard["id"] + "x"))
        status, _, _ = http(
            "POST",
            engine + "/v1/chat/completions",
            _chat("chat"),
            {"content-type": "application/json", "authorization": f"Bearer {key}"},
        )
        self.assertEqual(status, 200)

        record = os.path.join(self.dir, "state-gpu-01", "shards", shard["id"] + ".json")
        self.assertEqual(stat.S_IMODE(os.stat(record).st_mode), 0o600)
        for path in ("/api/v1/replicas", "/api/v1/nodes", "/api/v1/models"):
            _, _, answer = http("GET", self.admin_url + path)
            self.assertNotIn(key.encode(), answer)

        # Restarted, the server derives the same key for the adopted engine.
        logs = [self.server.output()]
        self.server.stop()
        self.start_fleet_server(config)
        self.ready(1)
        status, _, body = http(
            "POST",
            self.api_url + "/v1/chat/completions",
            _chat("chat"),
            {"content-type": "application/json"},
        )
        self.assertEqual(status, 200, body)
        (again,) = self.replicas()
        self.assertEqual(again["shards"][0]["id"], shard["id"])

        for log in (*logs, self.server.output(), agent.output()):
            self.assertNotIn(key, log)
            self.assertNotIn("Traceback", log)
