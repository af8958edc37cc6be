"""
End to end: the forwarding fast path (L{llmgw.router.api.fastpath}) and the
per-request log line (L{llmgw.router.accounting.usage_log.LogUsageSink}) as
C{twistd -n llmgw-server} wires them: what the fast path passes on is
still served by Klein, and a line holding braces prints them literally,
as text and as C{--log-format json}.
"""

from __future__ import annotations

import json
import re
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from tests.support import Process, Processes, http, sim_stats
from tests.test_e2e_router import MESSAGES

CHAT = json.dumps({"model": "sim-model", "messages": MESSAGES, "max_tokens": 6})

BRACED_MODEL = "a{b}c{0}"
"""
A model name no replica serves, holding what a format string would read as
fields: printed through C{str.format} it raises, not prints.
"""

UNKNOWN = json.dumps({"model": BRACED_MODEL, "messages": MESSAGES}).encode()


def _line(fields: dict[str, Any]) -> str:
    """
    @return: the text of the request line LogUsageSink writes, made from
        the JSON line's fields.
    """
    return (
        f"request {fields['request_id']}"
        f" client_id={fields['client_request_id']}"
        f" upstream_id={fields['upstream_request_id']} model={fields['model']}"
        f" replica={fields['replica']} key={fields['key']}"
        f" status={fields['status']} prompt_tokens={fields['prompt_tokens']}"
        f" completion_tokens={fields['completion_tokens']}"
        f" latency={fields['latency']:.3f}s"
    )


def _comparable(text: str) -> str:
    # Each request has an id of its own, given to the engine too (the
    # client's is not a UUID), and a latency of its own.
    text = re.sub(r"request [0-9a-f]{32}", "request *", text)
    text = re.sub(r"upstream_id=[0-9a-f]{32}", "upstream_id=*", text)
    return re.sub(r"latency=[\d.]+s", "latency=*", text)


class FastPathEndToEndTests(SynchronousTestCase, Processes):
    """
    One simulated engine behind the server.
    """

    timeout = 120

    def setUp(self) -> None:
        self.sim, self.sim_url = self.start_sim("--itl", "0.001")

    def server(self, *args: str) -> tuple[Process, str]:
        process, url, _ = self.start_server(
            "--endpoint", f"sim-0={self.sim_url}=sim-model", *args
        )
        return process, url

    def test_spellings_the_fast_path_passes_on(self) -> None:
        """
        A percent-encoded spelling of a forwarded path is served all the
        same (by Klein), with the engine's answer; a GET on a forwarded
        path, in either spelling, is a 405 OpenAI error allowing POST.
        """
        _, url = self.server()
        status, _, body = http(
            "POST", url + "/v1/chat/completions", CHAT.encode(), {"X-Request-ID": "a"}
        )
        self.assertEqual(status, 200, body[:300])
        plain = json.loads(body)
        before = sim_stats(self.sim_url)["requests_total"]
        status, headers, body = http(
            "POST",
            url + "/v1/chat/%63ompletions",
            CHAT.encode(),
            {"X-Request-ID": "b"},
        )
        self.assertEqual(status, 200, body[:300])
        self.assertEqual(headers["x-request-id"], "b")
        encoded = json.loads(body)
        self.assertEqual(encoded["object"], "chat.completion")
        self.assertEqual(
            encoded["choices"][0]["message"]["content"],
            plain["choices"][0]["message"]["content"],
        )
        self.assertEqual(sim_stats(self.sim_url)["requests_total"], before + 1)
        for path in ("/v1/chat/completions", "/v1/chat/%63ompletions"):
            status, headers, body = http("GET", url + path)
            self.assertEqual(status, 405, path)
            self.assertEqual(headers["allow"], "POST")
            self.assertEqual(headers["content-type"], "application/json")
            self.assertEqual(json.loads(body)["error"]["code"], "method_not_allowed")

    def test_braces_in_the_log_line(self) -> None:
        """
        The request line of an unknown model whose name holds braces (a
        404 model_not_found) prints the name as sent, and so does the line
        of a request id holding braces; the server logs no formatting
        error.
        """
        process, url = self.server()
        status, _, body = http(
            "POST", url + "/v1/chat/completions", UNKNOWN, {"X-Request-ID": "r{x}{0}"}
        )
        self.assertEqual(status, 404)
        self.assertEqual(json.loads(body)["error"]["code"], "model_not_found")
        line = process.wait_for(r"request \S+ client_id=r\{x\}\{0\} .*\n").group(0)
        self.assertIn(" model=a{b}c{0} replica=None key=None status=404 ", line)
        status, _, _ = http(
            "POST",
            url + "/v1/chat/completions",
            CHAT.encode(),
            {"X-Request-ID": "{ok}"},
        )
        self.assertEqual(status, 200)
        line = process.wait_for(r"request \S+ client_id=\{ok\} .*\n").group(0)
        self.assertIn(" model=sim-model replica=sim-0 key=None status=200 ", line)
        self.assertIn(" completion_tokens=6 ", line)
        output = process.output()
        self.assertNotIn("Unable to format event", output)
        self.assertNotIn("Traceback", output)

    def test_json_log_line(self) -> None:
        """
        With C{--log-format json} the request line's object carries the
        request's fields (the model name as sent) and C{text}, the line as
        the text log prints it: the same as a text server's line for the
        same request, but for the upstream id and the latency.
        """
        text_process, text_url = self.server()
        json_process, json_url = self.server("--log-format", "json")
        for url in (text_url, json_url):
            status, _, _ = http(
                "POST",
                url + "/v1/chat/completions",
                UNKNOWN,
                {"X-Request-ID": "r{x}{0}"},
            )
            self.assertEqual(status, 404)
        text_line = text_process.wait_for(
            r"request \S+ client_id=r\{x\}\{0\} .*"
        ).group(0)
        json_process.wait_for(r'"client_request_id": "r\{x\}\{0\}"')
        objects = [json.loads(line) for line in json_process.output().splitlines()]
        (fields,) = [o for o in objects if o.get("client_request_id") == "r{x}{0}"]
        self.assertEqual(fields["model"], BRACED_MODEL)
        self.assertEqual(fields["status"], 404)
        self.assertIsInstance(fields["latency"], float)
        self.assertRegex(fields["upstream_request_id"], r"^[0-9a-f]{32}$")
        self.assertEqual(fields["text"], _line(fields))
        self.assertEqual(_comparable(fields["text"]), _comparable(text_line))
        for o in objects:
            self.assertNotIn("Unable to format event", o["text"])
