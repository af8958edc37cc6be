"""
C{llmgw ctl} as an operator's first week uses it (issue 20, finding 7),
against C{twistd -n llmgw-server} processes: keys changed after creation
(models, limits, expiry) and unknown model names refused; the usage
report's means over the same requests; the status saying when placement
waits for the start-up grace, and the protocol's version; with agents over
mutual TLS and simulated GPUs, C{nodes} with memory and free GPUs and
C{nodes NODE}, C{models scale} saying when a change is temporary, and
C{weights --collect} asking first.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import time

import openai
from twisted.trial.unittest import SynchronousTestCase

from llmgw.wire import versions
from tests.support import BIN, Processes, hermetic_env
from tests.test_e2e_control import MODELS, _Fleet
from tests.test_e2e_store import CHAT, WEIGHTS_AGENT, _Ctl


class KeysUpdateTests(SynchronousTestCase, Processes, _Ctl):
    timeout = 120

    def setUp(self) -> None:
        _, self.sim_url = self.start_sim("--max-tokens", "3", "--ttft", "0.2")
        _, self.other_url = self.start_sim("--max-tokens", "3", model="other-model")
        self.start()

    def start(self) -> None:
        self.server, self.url, self.admin_url = self.start_server(
            "--endpoint",
            f"sim-0={self.sim_url}=sim-model",
            "--endpoint",
            f"sim-1={self.other_url}=other-model",
            config='[store]\nflush_interval = "100ms"\n',
            state="server-state",
        )

    def chat(self, key: str, model: str = "sim-model") -> str:
        client = openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)
        answer = client.chat.completions.create(model=model, messages=CHAT)
        return answer.choices[0].message.content or ""

    def one_line(self, done: subprocess.CompletedProcess[str], text: str) -> None:
        self.assertEqual(done.returncode, 1, done.stderr)
        self.assertIn(text, done.stderr)
        self.assertEqual(len(done.stderr.splitlines()), 1, done.stderr)

    def test_unknown_models_refused(self) -> None:
        """
        A key for a model nothing serves is refused on create and on
        update, with a 400 naming the unknown names only; nothing is made
        or changed.
        """
        bad = self.ctl(
            "keys", "create", "--name", "x", "--models", "sim-model,nosuch", ok=False
        )
        self.one_line(bad, "no model named 'nosuch'")
        self.assertNotIn("'sim-model'", bad.stderr.split("(models")[0])
        self.assertIn("HTTP 400", bad.stderr)
        self.assertEqual(self.ctl_json("keys")["keys"], [])
        # Open until the first key, which says so; the next one does not.
        self.assertTrue(self.chat("no-key-needed-yet"))
        first = self.ctl("keys", "create", "--name", "a", "--models", "sim-model")
        lines = first.stdout.splitlines()
        self.assertTrue(lines[0].startswith("sk-"), first.stdout)
        self.assertIn("without a key until now", lines[2])
        secret = {"key": lines[0]}
        with self.assertRaises(openai.AuthenticationError):
            self.chat("no-key-needed-yet")
        second = self.ctl_json("keys", "create", "--name", "b")
        self.assertFalse(second["was_open"])
        bad = self.ctl(
            "keys", "update", "a", "--models", "other-model,typo1,typo2", ok=False
        )
        self.one_line(bad, "no model named 'typo1', 'typo2'")
        key, _ = self.ctl_json("keys")["keys"]
        self.assertEqual((key["name"], key["models"]), ("a", ["sim-model"]))
        self.assertTrue(self.chat(secret["key"]))

    def test_update_limits_models_expiry(self) -> None:
        """
        keys update changes models and limits at once, kept across a
        restart; 'none' and 'all' remove them; an expiry in the future
        makes the key refused (401) once it passes; a revoked key, an
        unknown one and an update with nothing to change are one line each.
        """
        made = self.ctl_json(
            "keys", "create", "--name", "app", "--models", "sim-model", "--rpm", "1"
        )
        key = made["key"]
        self.assertTrue(self.chat(key))
        with self.assertRaises(openai.RateLimitError):
            self.chat(key)
        with self.assertRaises(openai.PermissionDeniedError):
            self.chat(key, "other-model")

        changed = self.ctl(
            "keys",
            "update",
            "app",
            "--models",
            "sim-model,other-model",
            "--rpm",
            "none",
            "--tpm",
            "100000",
        ).stdout
        self.assertIn("models sim-model,other-model, rpm -, tpm 100000", changed)
        self.assertIn("expires never", changed)
        for _ in range(3):
            self.assertTrue(self.chat(key))
        self.assertTrue(self.chat(key, "other-model"))

        self.server.stop()
        self.start()
        (listed,) = self.ctl_json("keys")["keys"]
        self.assertEqual(
            (listed["models"], listed["rpm"], listed["tpm"]),
            (["sim-model", "other-model"], None, 100000),
        )
        self.assertTrue(self.chat(key, "other-model"))
        self.ctl("keys", "update", "app", "--models", "all")
        self.assertIsNone(self.ctl_json("keys")["keys"][0]["models"])

        past = self.ctl("keys", "update", "app", "--expires", "2000-01-01", ok=False)
        self.one_line(past, "is not in the future")
        self.ctl("keys", "update", "app", "--expires", "2s")
        self.assertIn("EXPIRES", self.ctl("keys").stdout)
        self.assertIsNotNone(self.ctl_json("keys")["keys"][0]["expires"])
        deadline = time.monotonic() + 10
        while True:
            try:
                self.chat(key)
            except openai.AuthenticationError as e:
                self.assertIn("expired", str(e))
                break
            self.assertLess(time.monotonic(), deadline, "never expired")
            time.sleep(0.2)
        self.ctl("keys", "update", "app", "--expires", "never")
        self.assertTrue(self.chat(key))

        self.one_line(self.ctl("keys", "update", "app", ok=False), "give --models")
        self.one_line(
            self.ctl("keys", "update", "nobody", "--rpm", "3", ok=False),
            "no key 'nobody' (HTTP 404)",
        )
        self.one_line(
            self.ctl("keys", "update", "app", "--rpm", "0", ok=False),
            "rpm: expected an integer from 1 to",
        )
        self.ctl("keys", "revoke", "app")
        self.one_line(
            self.ctl("keys", "update", "app", "--rpm", "3", ok=False),
            "key 'app' is revoked (HTTP 409)",
        )

    def test_usage_means_over_the_same_requests(self) -> None:
        """
        Refusals of a key (over its rpm, 429, in milliseconds) beside its
        answered requests (the engine takes 0.2 s to its first token): the
        mean latency is over the same requests as the mean time to first
        token, never below it.
        """
        key = self.ctl_json("keys", "create", "--name", "app", "--rpm", "3")["key"]
        for _ in range(3):
            self.assertTrue(self.chat(key))
        for _ in range(12):
            with self.assertRaises(openai.RateLimitError):
                self.chat(key)
        deadline = time.monotonic() + 10
        while True:
            groups = self.ctl_json("usage", "--by", "key")["usage"]
            if sum(g["requests"] for g in groups) >= 15:
                break
            self.assertLess(time.monotonic(), deadline, groups)
            time.sleep(0.2)
        (group,) = [g for g in groups if g["key"] == "app"]
        self.assertGreaterEqual(group["mean_time_to_first_token"], 0.2)
        self.assertGreaterEqual(
            group["mean_latency"], group["mean_time_to_first_token"], groups
        )
        self.assertEqual(group["answered"], 3)
        self.assertEqual(group["errors"], 12)
        table = self.ctl("usage").stdout.splitlines()
        self.assertIn("ANSWERED", table[0])


class StatusGraceTests(SynchronousTestCase, Processes, _Ctl):
    timeout = 60

    def test_status_says_placement_waits(self) -> None:
        """
        During [control] startup_grace, ctl status says placement waits
        for it and how long; the admin API's status carries it; a server
        with no grace says placement is active.
        """
        _, sim = self.start_sim()
        self.server, _, self.admin_url = self.start_server(
            "--endpoint",
            f"s={sim}=sim-model",
            config='[control]\nstartup_grace = "60s"\n',
        )
        status = self.ctl("status").stdout
        self.assertRegex(
            status,
            r"placement: waiting for the start-up grace: \d+(\.\d)? s left of"
            r" \[control\] startup_grace = 60 s",
        )
        placement = self.ctl_json("status")["placement"]
        self.assertEqual(placement["waiting_for"], "startup_grace")
        self.assertTrue(50 < placement["seconds_left"] <= 60, placement)
        self.server.stop()
        self.server, _, self.admin_url = self.start_server(
            "--endpoint",
            f"s={sim}=sim-model",
            config='[control]\nstartup_grace = "0s"\n',
        )
        status = self.ctl("status").stdout
        self.assertIn("placement: active\n", status)
        # One line per field: the placement's words, not a second line too.
        self.assertEqual(status.count("placement:"), 1, status)
        self.assertEqual(self.ctl_json("status")["placement"], {"waiting_for": None})

    def test_status_says_protocol(self) -> None:
        """
        ctl status and the admin API's status say the wire protocol's
        version the server speaks and the oldest and newest it serves
        (issue 37, item 8: it was only in log lines), one line.
        """
        _, sim = self.start_sim()
        self.server, _, self.admin_url = self.start_server(
            "--endpoint", f"s={sim}=sim-model"
        )
        speaks = versions.text()
        oldest, newest = versions.served()
        self.assertEqual(
            self.ctl_json("status")["protocol"],
            {"speaks": speaks, "serves": [oldest, newest]},
        )
        status = self.ctl("status").stdout
        self.assertIn(
            f"protocol: {speaks} (serves agents and routers of {oldest} to {newest})\n",
            status,
        )
        self.assertEqual(status.count("protocol:"), 1, status)


def _ctl_on_terminal(admin_url: str, answer: bytes, *args: str) -> tuple[int, str]:
    """
    Run C{llmgw ctl ARGS} with a terminal as its stdin, typing C{answer}.

    @return: its exit status and what it wrote to stdout and stderr.
    """
    leader, follower = pty.openpty()
    try:
        process = subprocess.Popen(
            [os.path.join(BIN, "llmgw"), "ctl", "--admin-url", admin_url, *args],
            stdin=follower,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=hermetic_env(),
        )
        os.write(leader, answer)
        out, _ = process.communicate(timeout=60)
    finally:
        os.close(follower)
        os.close(leader)
    return process.returncode, out.decode()


class FleetCtlTests(_Fleet, SynchronousTestCase, _Ctl):
    def test_nodes_memory_and_one_node(self) -> None:
        """
        With one 40 GB replica on two nodes of two 141 GB GPUs: ctl nodes
        shows the allocation and one free GPU on its node, two on the
        other; ctl nodes NODE shows that node's GPUs and shards; an
        unknown node is one line naming the known ones.
        """
        self.start_fleet_server(self.config(MODELS.format(min_replicas=1, idle="0s")))
        for node in ("gpu-01", "gpu-02"):
            self.start_agent(node)
        (replica,) = self.ready(1)
        (shard,) = replica["shards"]
        placed, other = shard["node"], ({"gpu-01", "gpu-02"} - {shard["node"]}).pop()

        def held() -> bool:
            # The sim's 40 GB, from the next heartbeat after it started.
            (node,) = [
                n for n in self.admin("/api/v1/nodes")["nodes"] if n["id"] == placed
            ]
            used: int = sum(g["memory_used_mib"] for g in node["gpus"])
            return used == 40 * 1024

        self.until(held, 20, "the sim engine's 40 GB reported in use")
        lines = self.ctl("nodes").stdout.splitlines()
        header = lines[0].split("  ")
        header = [h.strip() for h in header if h.strip()]
        self.assertEqual(
            header,
            [
                "NODE",
                "STATE",
                "CONNECTED",
                "ADDRESS",
                "GPUS",
                "FREE",
                "GPU TYPES",
                "ALLOC GiB",
                "USED GiB",
                "OTHERS GiB",
                "TOTAL GiB",
                "LAST SEEN",
            ],
        )
        rows = {line.split()[0]: line.split() for line in lines[1:]}
        # NODE STATE CONNECTED ADDRESS GPUS FREE TYPES ALLOC USED OTHERS TOTAL
        self.assertEqual(
            rows[placed][4:11], ["2", "1", "H200", "40.0", "40.0", "0.0", "282.0"]
        )
        self.assertEqual(
            rows[other][4:11], ["2", "2", "H200", "0.0", "0.0", "0.0", "282.0"]
        )
        listed = {n["id"]: n for n in self.ctl_json("nodes")["nodes"]}
        gpus = {g["index"]: g for g in listed[placed]["gpus"]}
        self.assertEqual(gpus[shard["gpus"][0]]["memory_allocated_mib"], 40 * 1024)
        self.assertEqual(listed[placed]["free_gpus"], 1)

        detail = self.ctl("nodes", placed).stdout
        self.assertIn(f"node: {placed}\n", detail)
        self.assertIn("gpus: 2, 1 free (simulated)", detail)
        gpu_rows = {
            line.split()[0]: line.split()
            for line in detail.splitlines()
            if line[:1].isdigit()
        }
        index = str(shard["gpus"][0])
        # GPU NAME ALLOC USED OTHERS TOTAL REPLICAS
        self.assertEqual(
            gpu_rows[index][1:7],
            ["H200", "40.0", "40.0", "0.0", "141.0", replica["id"]],
        )
        shard_lines = detail.split("\n\n")[-1].splitlines()
        self.assertEqual(shard_lines[0].split()[:3], ["REPLICA", "MODEL", "STATE"])
        self.assertEqual(shard_lines[1].split()[:2], [replica["id"], "chat"])
        one = self.ctl_json("nodes", other)
        self.assertEqual((one["id"], one["free_gpus"]), (other, 2))
        unknown = self.ctl("nodes", "gpu-99", ok=False)
        self.assertEqual(unknown.returncode, 1)
        self.assertEqual(
            unknown.stderr, "llmgw ctl: no node 'gpu-99' (nodes: gpu-01, gpu-02)\n"
        )

    def test_scale_config_model_says_temporary(self) -> None:
        """
        models scale on a model of the config file says the change lasts
        until the next start, and it does: after a restart the file's
        bounds are back.
        """
        config = self.config(MODELS.format(min_replicas=0, idle="0s"))
        self.start_fleet_server(config)
        done = self.ctl("models", "scale", "chat", "--max", "1").stdout
        self.assertIn("model chat: min 0, max 1", done)
        self.assertIn(
            "model chat is declared in the config file: this lasts until the"
            " server's next start",
            done,
        )
        self.server.stop()
        self.start_fleet_server(config)
        (model,) = self.ctl_json("models")["models"]
        self.assertEqual(model["max_replicas"], 2)

    def test_weights_collect_asks(self) -> None:
        """
        weights --collect without --yes: refused without a terminal, with
        nothing deleted; on a terminal it lists the files and asks; 'n'
        deletes nothing, 'y' deletes exactly what it listed.
        """
        weights = os.path.join(self.dir, "weights")
        os.makedirs(weights)
        for name in ("stale-1.gguf", "stale-2.gguf"):
            with open(os.path.join(weights, name), "wb") as f:
                f.write(b"w" * 2048)
        self.start_fleet_server(self.config(MODELS.format(min_replicas=0, idle="0s")))
        self.start_agent("gpu-01", WEIGHTS_AGENT.replace("{weights}", weights))
        self.until(
            lambda: [n for n in self.ctl_json("weights")["nodes"] if n["files"]],
            20,
            "weights report",
        )
        refused = self.ctl("weights", "--collect", ok=False)
        self.assertEqual(refused.returncode, 1)
        self.assertEqual(len(refused.stderr.splitlines()), 1)
        self.assertIn("stdin is not a terminal: give --yes", refused.stderr)
        self.assertEqual(len(os.listdir(weights)), 2)

        status, out = _ctl_on_terminal(self.admin_url, b"n\n", "weights", "--collect")
        self.assertEqual(status, 1, out)
        self.assertIn("delete these 2 entries (4.0 KiB)? [y/N]", out)
        self.assertIn(os.path.join(weights, "stale-1.gguf"), out)
        self.assertIn("not confirmed; nothing deleted", out)
        self.assertEqual(len(os.listdir(weights)), 2)

        status, out = _ctl_on_terminal(self.admin_url, b"y\n", "weights", "--collect")
        self.assertEqual(status, 0, out)
        self.assertIn("gpu-01: removed " + os.path.join(weights, "stale-2.gguf"), out)
        self.assertEqual(os.listdir(weights), [])
        # --yes and --dry-run ask nothing.
        self.assertIn(
            "nothing unused", self.ctl("weights", "--collect", "--yes").stdout
        )
        self.assertIsNotNone(
            json.loads(self.ctl("--json", "weights", "--collect", "--dry-run").stdout)
        )
