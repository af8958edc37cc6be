"""
Keys, usage, runtime models and weights end to end: C{twistd -n
llmgw-server} with its SQLite store, driven by C{llmgw ctl} as an operator
would and by the official C{openai} client; the sim engine as the replica;
for models and weights, agent processes over mutual TLS with simulated GPUs
(no GPU here).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
from twisted.trial.unittest import SynchronousTestCase

from tests.support import BIN, CtlMixin, Processes, hermetic_env, http
from tests.test_e2e_control import MODELS, _Fleet

CHAT: list[Any] = [{"role": "user", "content": "count the tokens"}]
_Ctl = CtlMixin  # The name the other tests import.


class KeysAndUsageTests(SynchronousTestCase, Processes, _Ctl):
    timeout = 120

    def setUp(self) -> None:
        _, self.sim_url = self.start_sim("--max-tokens", "7")
        self.config = '[store]\nflush_interval = "1h"\n'
        self.server_state = tempfile.mkdtemp(prefix="llmgw-db-")
        self.start()

    def start(self) -> None:
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint",
            f"sim-0={self.sim_url}=sim-model,other-model",
            config=self.config,
            state="server-state",
        )

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def test_keys(self) -> None:
        """
        Keys made with llmgw ctl: a valid key works; no key is an
        AuthenticationError; another key's model a PermissionDeniedError
        (and /v1/models shows a key only its models); past --rpm a
        RateLimitError with Retry-After; a revoked key stops working.
        """
        self.assertIn("auth_required: no", self.ctl("status").stdout)
        made = self.ctl(
            "keys", "create", "--name", "alice", "--models", "sim-model", "--rpm", "3"
        )
        alice = made.stdout.splitlines()[0]
        self.assertTrue(alice.startswith("sk-"))
        self.assertIn("shown only this once", made.stdout)
        bob = self.ctl_json(
            "keys", "create", "--name", "bob", "--models", "other-model"
        )["key"]

        answer = self.client(alice).chat.completions.create(
            model="sim-model", messages=CHAT
        )
        self.assertTrue(answer.choices[0].message.content)
        # No key at all (the openai client always sends one): plain HTTP.
        status, _, body = http(
            "POST",
            self.url + "/v1/chat/completions",
            json.dumps({"model": "sim-model", "messages": CHAT}).encode(),
            {"content-type": "application/json"},
        )
        self.assertEqual(
            (status, json.loads(body)["error"]["code"]), (401, "invalid_api_key")
        )
        with self.assertRaises(openai.AuthenticationError):
            self.client("sk-not-a-key").chat.completions.create(
                model="sim-model", messages=CHAT
            )
        with self.assertRaises(openai.PermissionDeniedError) as denied:
            self.client(bob).chat.completions.create(model="sim-model", messages=CHAT)
        self.assertEqual(denied.exception.code, "model_not_allowed")
        self.assertEqual(
            [m.id for m in self.client(bob).models.list()], ["other-model"]
        )
        # The scheme is case-insensitive.
        status, _, _ = http(
            "GET", self.url + "/v1/models", headers={"authorization": f"bEaReR {bob}"}
        )
        self.assertEqual(status, 200)

        self.client(alice).chat.completions.create(model="sim-model", messages=CHAT)
        self.client(alice).chat.completions.create(model="sim-model", messages=CHAT)
        with self.assertRaises(openai.RateLimitError) as limited:
            self.client(alice).chat.completions.create(model="sim-model", messages=CHAT)
        self.assertEqual(limited.exception.code, "rate_limit_exceeded")
        retry_after = int(limited.exception.response.headers["retry-after"])
        self.assertTrue(50 <= retry_after <= 60, retry_after)

        listed = self.ctl("keys", "list").stdout.splitlines()
        self.assertEqual(listed[0].split()[:3], ["NAME", "PREFIX", "MODELS"])
        self.assertEqual([line.split()[0] for line in listed[1:]], ["alice", "bob"])
        self.assertNotIn(alice, self.ctl("keys", "list").stdout)
        self.ctl("keys", "revoke", "bob")
        with self.assertRaises(openai.AuthenticationError):
            self.client(bob).models.list()
        failed = self.ctl("keys", "revoke", "nobody", ok=False)
        self.assertEqual(failed.returncode, 1)
        self.assertEqual(failed.stderr, "llmgw ctl: no key 'nobody' (HTTP 404)\n")

        # Bad input: one line each, nothing made.
        for args, message in (
            (["--rpm", str(10**30)], "rpm: expected an integer from 1 to"),
            (["--models", ""], "--models is empty"),
            (["--models", " , "], "--models is empty"),
        ):
            bad = self.ctl("keys", "create", "--name", "bad", *args, ok=False)
            self.assertEqual(bad.returncode, 1, args)
            self.assertIn(message, bad.stderr)
            self.assertEqual(len(bad.stderr.splitlines()), 1)
        for name in ("sk-lookalike", "a/b", " "):
            bad = self.ctl("keys", "create", "--name", name, ok=False)
            self.assertIn("expected 1 to 100 letters", bad.stderr, name)
        self.assertEqual(
            [k["name"] for k in self.ctl_json("keys", "list")["keys"]], ["alice", "bob"]
        )
        for since in ("nan", "inf", "1e400"):
            bad = self.ctl("usage", "--since", since, ok=False)
            self.assertIn("bad time", bad.stderr, since)
        bad = self.ctl("usage", "--since", "1h", "--until", "2h", ok=False)
        self.assertIn("until: must be after since", bad.stderr)

    def test_usage_exact_and_kept_over_sigterm(self) -> None:
        """
        10 streamed and 10 non-streamed requests: llmgw ctl usage shows the
        token counts the engine reported, exactly.  The records are still
        buffered (flush_interval 1h) when SIGTERM comes; after a restart
        they are all in the store.
        """
        key = self.ctl_json("keys", "create", "--name", "meter")["key"]
        client = self.client(key)
        prompt = completion = 0
        for _ in range(10):
            answer = client.chat.completions.create(model="sim-model", messages=CHAT)
            assert answer.usage is not None
            prompt += answer.usage.prompt_tokens
            completion += answer.usage.completion_tokens
        for i in range(10):
            # Half ask for the usage chunk; llmgw asks for it for the others
            # and counts it all the same.
            chunks = list(
                client.chat.completions.create(
                    model="sim-model",
                    messages=CHAT,
                    stream=True,
                    stream_options={"include_usage": True} if i % 2 else openai.omit,
                )
            )
            usage = [c.usage for c in chunks if c.usage is not None]
            if i % 2:
                prompt += usage[0].prompt_tokens
                completion += usage[0].completion_tokens
            else:
                self.assertEqual(usage, [])
                # Same prompt and max tokens as the odd ones: the same counts.
                assert answer.usage is not None
                prompt += answer.usage.prompt_tokens
                completion += answer.usage.completion_tokens
        self.assertEqual(completion, 20 * 7)

        # Refused for want of a key: not stored (anyone could fill the
        # store with these).
        status, _, _ = http(
            "POST",
            self.url + "/v1/chat/completions",
            json.dumps({"model": "sim-model", "messages": CHAT}).encode(),
            {"content-type": "application/json"},
        )
        self.assertEqual(status, 401)
        # Nothing written yet (the batch waits an hour); SIGTERM writes it.
        self.server.stop()
        self.assertIn("usage: 20 records written", self.server.output())
        self.start()
        (row,) = self.ctl_json("usage", "--by", "key")["usage"]
        self.assertEqual(
            (
                row["key"],
                row["requests"],
                row["errors"],
                row["prompt_tokens"],
                row["completion_tokens"],
            ),
            ("meter", 20, 0, prompt, completion),
        )
        (by_model,) = self.ctl_json("usage", "--by", "model")["usage"]
        self.assertEqual(by_model["model"], "sim-model")
        (listed,) = self.ctl_json("keys", "list")["keys"]
        self.assertEqual(listed["tokens_used"], prompt + completion)
        table = self.ctl("usage", "--by", "model").stdout.splitlines()
        self.assertEqual(
            table[1].split()[:5], ["sim-model", "20", "0", str(prompt), str(completion)]
        )
        self.assertEqual(
            self.ctl_json(
                "usage",
                "--since",
                "2000-01-01T00:00:00",
                "--until",
                "2000-01-02T00:00:00",
            )["usage"],
            [],
        )
        bad = self.ctl("usage", "--since", "yesterday", ok=False)
        self.assertEqual(bad.returncode, 1)
        self.assertIn("bad time 'yesterday'", bad.stderr)

    def test_counts_kept_without_records(self) -> None:
        """
        With record_usage off, no record per request is kept, but a key's
        token count is: its budget still holds after a restart.
        """
        self.config = "[store]\nrecord_usage = false\n"
        self.server.stop()
        self.start()
        key = self.ctl_json(
            "keys", "create", "--name", "capped", "--budget-tokens", "20"
        )
        client = self.client(key["key"])
        used = 0
        while used < 20:
            answer = client.chat.completions.create(model="sim-model", messages=CHAT)
            assert answer.usage is not None
            used += answer.usage.total_tokens
        self.server.stop()
        self.start()
        with self.assertRaises(openai.RateLimitError) as raised:
            # The restarted server listens on another port.
            self.client(key["key"]).chat.completions.create(
                model="sim-model", messages=CHAT
            )
        self.assertEqual(raised.exception.code, "insufficient_quota")
        (listed,) = self.ctl_json("keys", "list")["keys"]
        self.assertEqual(listed["tokens_used"], used)
        self.assertEqual(self.ctl_json("usage", "--by", "model")["usage"], [])

    def test_one_server_per_database(self) -> None:
        """
        A second server on the same database, from another state
        directory, is refused with one line.
        """
        database = os.path.join(self.server_state, "shared.db")
        config = f'[store]\nurl = "sqlite://{database}"\n'
        self.start_server("--endpoint", f"a={self.sim_url}=x", config=config)
        with self.assertRaises(AssertionError) as raised:
            self.start_server("--endpoint", f"b={self.sim_url}=x", config=config)
        self.assertIn(
            "shared.db.lock' is held by llmgw-server pid", str(raised.exception)
        )

    def test_not_a_database(self) -> None:
        """
        A store file that is not SQLite: the server exits 2 with one
        config-error line naming it, no traceback.
        """
        database = os.path.join(self.server_state, "junk.db")
        with open(database, "wb") as f:
            f.write(b"not a database at all" * 100)
        config = f'[store]\nurl = "sqlite://{database}"\n'
        with self.assertRaises(AssertionError) as raised:
            self.start_server("--endpoint", f"a={self.sim_url}=x", config=config)
        output = str(raised.exception)
        self.assertIn("process exited with 2", output)
        self.assertIn(
            f"llmgw-server: config error: store: cannot open {database!r}: ", output
        )
        self.assertNotIn("Traceback", output)

    def test_ctl_unreachable(self) -> None:
        """
        An admin URL where nothing listens: one line, exit 1.
        """
        done = subprocess.run(
            [
                os.path.join(BIN, "llmgw"),
                "ctl",
                "--admin-url",
                "http://127.0.0.1:9",
                "nodes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=hermetic_env(),
        )
        self.assertEqual(done.returncode, 1)
        self.assertEqual(len(done.stderr.splitlines()), 1)
        self.assertIn("cannot reach the admin API at http://127.0.0.1:9", done.stderr)

    def test_ctl_bad_url_and_admin_key(self) -> None:
        """
        An admin URL without a scheme: one line naming it, exit 1 (it was
        a traceback).  C{keys create --admin} makes an admin key (argparse
        took --admin for an ambiguous abbreviation of --admin-url and
        --admin-key, so no admin key could be made with ctl).
        """
        done = self.ctl("--admin-url", "foo", "status", ok=False)
        self.assertEqual(done.returncode, 1, done.stderr)
        self.assertEqual(len(done.stderr.splitlines()), 1, done.stderr)
        self.assertIn("bad --admin-url 'foo'", done.stderr)
        self.assertNotIn("Traceback", done.stderr)
        made = self.ctl_json("keys", "create", "--name", "ops", "--admin")
        self.assertTrue(made["key"].startswith("sk-"))
        (ops,) = [
            k for k in self.ctl_json("keys", "list")["keys"] if k["name"] == "ops"
        ]
        self.assertTrue(ops["admin"])


class BudgetTests(SynchronousTestCase, Processes, _Ctl):
    """
    Budgets against clients that leave early and clients that send many
    requests at once.
    """

    timeout = 120

    def setUp(self) -> None:
        _, sim_url = self.start_sim("--itl", "0.05", "--max-tokens", "40")
        _, self.url, self.admin_url = self.start_server(
            "--endpoint", f"sim-0={sim_url}=sim-model"
        )

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def test_leaving_mid_stream_is_charged(self) -> None:
        """
        A client that closes a stream after 10 chunks gets no usage chunk,
        and the engine's count never comes: the request is charged the
        router's estimate (chunks relayed, prompt from the body), marked
        estimated, and counts against the key's budget.
        """
        key = self.ctl_json(
            "keys", "create", "--name", "leaver", "--budget-tokens", "30"
        )
        client = self.client(key["key"])
        for _ in range(3):
            stream = client.chat.completions.create(
                model="sim-model", messages=CHAT, stream=True
            )
            for seen, _chunk in enumerate(stream, 1):
                if seen == 10:
                    break
            stream.close()
            time.sleep(0.3)
            try:
                client.chat.completions.create(
                    model="sim-model", messages=CHAT, max_tokens=1
                )
            except openai.RateLimitError as e:
                self.assertEqual(e.code, "insufficient_quota")
                break
        else:
            self.fail("three streams of 10+ chunks never used up a 30-token budget")
        (row,) = self.ctl_json("usage")["usage"]
        self.assertGreaterEqual(row["estimated_requests"], 1)
        self.assertGreaterEqual(row["completion_tokens"], 10)

    def test_concurrent_requests_bounded_by_budget(self) -> None:
        """
        20 requests at once against a 100-token budget: tokens held for
        each request in flight (prompt estimate and max_tokens) keep most
        out; the budget is overshot by at most what the admitted ones use.
        """
        key = self.ctl_json(
            "keys", "create", "--name", "burst", "--budget-tokens", "100"
        )
        client = self.client(key["key"])

        def one(_: int) -> str:
            try:
                client.chat.completions.create(
                    model="sim-model", messages=CHAT, max_tokens=40
                )
                return "ok"
            except openai.RateLimitError as e:
                return str(e.code)

        with ThreadPoolExecutor(20) as pool:
            outcomes = list(pool.map(one, range(20)))
        admitted = outcomes.count("ok")
        self.assertEqual(outcomes.count("insufficient_quota"), 20 - admitted)
        self.assertLessEqual(admitted, 3, outcomes)
        (listed,) = self.ctl_json("keys", "list")["keys"]
        self.assertLessEqual(listed["tokens_used"], 100 + 3 * 50)


WEIGHTS_AGENT = """
address = "{address}"
weights_dirs = ["{weights}"]
[[simulated_gpus]]
name = "H200"
memory_gb = 141
[[simulated_gpus]]
name = "H200"
memory_gb = 141
"""


class FleetStoreTests(_Fleet, SynchronousTestCase, _Ctl):
    def test_runtime_model_add_restart_remove(self) -> None:
        """
        A model added with llmgw ctl models add is placed and serves; it is
        still there after a server restart (its replica adopted); models
        remove stops its replica.  A config file model cannot be removed.
        A model with a key out of its range is refused, naming the key.
        """
        config = self.config(
            MODELS.format(min_replicas=0, idle="0s"), startup_grace="2s"
        )
        self.start_fleet_server(config)
        self.start_agent("gpu-01")
        self.until(lambda: self.admin("/api/v1/nodes")["nodes"], 20, "the node")
        self.ctl(
            "models",
            "add",
            "added",
            "--engine",
            "sim",
            "--source",
            "sim",
            "--gpus",
            "1",
            "--gpu-memory-gb",
            "10",
            "--min-replicas",
            "1",
            "--alias",
            "added-alias",
        )
        (replica,) = self.until(
            lambda: [r for r in self.replicas("added") if r["state"] == "ready"],
            30,
            "added ready",
        )
        self.assertTrue(self.chat("added-alias"))
        listed = self.ctl("models").stdout
        self.assertIn("runtime", listed)
        self.assertIn("config", listed)
        # A value out of its key's declared range is refused, naming the
        # model and the key, and nothing is added.
        bad = "models add bad --engine sim --source sim --max-loras -1"
        refused = self.ctl(*bad.split(), ok=False)
        self.assertEqual(refused.returncode, 1, refused.stderr)
        self.assertIn(
            "models[0] (bad).max_loras: expected a whole number from 0 to 1024,"
            " got -1 (HTTP 400)",
            refused.stderr,
        )
        self.assertNotIn(
            "bad", [m["name"] for m in self.admin("/api/v1/models")["models"]]
        )

        self.server.stop()
        self.start_fleet_server(config)
        again = self.until(
            lambda: [r for r in self.replicas("added") if r["state"] == "ready"],
            30,
            "adopted",
        )
        self.assertEqual([r["id"] for r in again], [replica["id"]])
        self.assertTrue(self.chat("added"))

        refused = self.ctl("models", "remove", "chat", ok=False)
        self.assertEqual(refused.returncode, 1)
        self.assertIn("declared in the config file", refused.stderr)
        self.ctl("models", "remove", "added")
        pid = replica["shards"][0]["pid"]
        self.until(lambda: not self.replicas("added"), 30, "replica stopped")
        self.until(lambda: not os.path.exists(f"/proc/{pid}"), 15, "engine gone")
        with self.assertRaises(openai.NotFoundError):
            self.chat("added")
        self.server.stop()
        self.start_fleet_server(config)
        self.assertNotIn(
            "added", [m["name"] for m in self.admin("/api/v1/models")["models"]]
        )

    def test_weights_collect(self) -> None:
        """
        llmgw ctl weights lists the agent's files; --collect --dry-run
        deletes nothing; --collect deletes only the entries no catalog model
        uses (a symlink itself, not what it points to); a path outside the
        weights directories, also through a symlink inside them, is refused
        by the agent, and one the catalog uses by the server.
        """
        weights = os.path.join(self.dir, "weights")
        outside = os.path.join(self.dir, "precious")
        os.makedirs(os.path.join(weights, "models--org--used-model", "blobs"))
        os.makedirs(outside)
        with open(os.path.join(outside, "keep.bin"), "wb") as f:
            f.write(b"x" * 10)
        files = {
            "used.gguf": 1000,
            "stale.gguf": 2000,
            "models--org--used-model/blobs/a": 300,
        }
        for name, size in files.items():
            with open(os.path.join(weights, name), "wb") as f:
                f.write(b"w" * size)
        os.makedirs(os.path.join(weights, "old-checkout"))
        with open(
            os.path.join(weights, "old-checkout", "model.safetensors"), "wb"
        ) as f:
            f.write(b"s" * 500)
        os.symlink(outside, os.path.join(weights, "escape"))
        models = (
            MODELS.format(min_replicas=0, idle="0s")
            + f'\n[[models]]\nname = "local-file"\n[[models.profiles]]\nname = "cpu"\n'
            f'engine = "llamacpp"\nsource = "{weights}/used.gguf"\n'
            '\n[[models]]\nname = "hub"\n[[models.profiles]]\nname = "gpu"\n'
            'engine = "vllm"\nsource = "org/used-model"\ngpus = 1\n'
        )
        self.start_fleet_server(self.config(models))
        self.start_agent("gpu-01", WEIGHTS_AGENT.replace("{weights}", weights))
        listed = self.until(
            lambda: [n for n in self.ctl_json("weights")["nodes"] if n["files"]],
            20,
            "weights report",
        )
        reported = {os.path.basename(f["path"]): f for f in listed[0]["files"]}
        self.assertEqual(
            sorted(reported),
            [
                "escape",
                "models--org--used-model",
                "old-checkout",
                "stale.gguf",
                "used.gguf",
            ],
        )
        self.assertEqual(reported["old-checkout"]["size_bytes"] >= 500, True)
        self.assertEqual(
            sorted(k for k, f in reported.items() if f["unused"]),
            ["escape", "old-checkout", "stale.gguf"],
        )

        dry = self.ctl("weights", "--collect", "--dry-run").stdout
        self.assertIn("would remove", dry)
        self.assertTrue(os.path.exists(os.path.join(weights, "stale.gguf")))

        # Paths outside the weights directory, also through the symlink,
        # are refused by the agent; nothing is deleted.
        for path in (
            os.path.join(outside, "keep.bin"),
            os.path.join(weights, "escape", "keep.bin"),
            os.path.join(weights, "..", "precious", "keep.bin"),
        ):
            refused = self.ctl("weights", "--remove", "gpu-01", path, ok=False)
            self.assertEqual(refused.returncode, 1, path)
            self.assertIn("outside the weights directories", refused.stderr)
        self.assertTrue(os.path.exists(os.path.join(outside, "keep.bin")))
        # A file the catalog uses is refused by the server.
        used = self.ctl(
            "weights",
            "--remove",
            "gpu-01",
            os.path.join(weights, "used.gguf"),
            ok=False,
        )
        self.assertIn("is used by 'local-file'", used.stderr)
        # --dry-run goes with --collect only: with --remove it is refused,
        # and nothing is deleted.
        refused = self.ctl(
            "weights",
            "--remove",
            "gpu-01",
            os.path.join(weights, "old-checkout"),
            "--dry-run",
            ok=False,
        )
        self.assertEqual(refused.returncode, 1)
        self.assertIn("--dry-run goes with --collect", refused.stderr)
        self.assertTrue(os.path.exists(os.path.join(weights, "old-checkout")))

        # Collect: the unused entries go; the symlink itself goes, what it
        # points to outside stays.
        done = self.ctl("weights", "--collect", "--yes").stdout
        self.assertIn("removed " + os.path.join(weights, "old-checkout"), done)
        self.assertEqual(
            sorted(os.listdir(weights)), ["models--org--used-model", "used.gguf"]
        )
        self.assertTrue(os.path.exists(os.path.join(outside, "keep.bin")))
