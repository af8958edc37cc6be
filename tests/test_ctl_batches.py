"""
C{llmgw ctl batches}' printing (L{llmgw.cli.ctl.batches}) of what an admin
API answers, without a server: a batch from a server older than this
C{ctl} (no C{usage}) prints without its tokens and cost rather than
failing.  The commands against a running server are
L{tests.test_e2e_ctl_batches}'.
"""

from __future__ import annotations

import argparse
import io
from typing import Any, cast

from twisted.trial.unittest import SynchronousTestCase

from llmgw.cli.ctl.batches import batches_list, batches_show
from llmgw.cli.ctl.client import Client


def _batch(**more: Any) -> dict[str, Any]:
    return {
        "id": "batch_1",
        "key": "team",
        "endpoint": "/v1/chat/completions",
        "api": "openai",
        "status": "completed",
        "input_file_id": "file-1",
        "output_file_id": "file-2",
        "error_file_id": None,
        "created_at": 1.0e9,
        "completed_at": 1.0e9 + 60,
        "expires_at": 1.0e9 + 86400,
        "request_counts": {"total": 2, "completed": 2, "failed": 0},
        "progress": {"ended": 2, "total": 2},
        "lines": {"pending": 0, "running": 0, "done": 2},
        **more,
    }


class _Answers:
    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer

    def call(self, method: str, path: str) -> dict[str, Any]:
        return self.answer


def _args(**given: Any) -> argparse.Namespace:
    return argparse.Namespace(
        **{"status": None, "key": None, "limit": None, "after": None, **given}
    )


class PrintTests(SynchronousTestCase):
    def test_usage_printed(self) -> None:
        """
        A batch's usage is its TOKENS (prompt and completion) and COST in
        the list, and a line of C{show}.
        """
        usage = {
            "requests": 2,
            "prompt_tokens": 10,
            "completion_tokens": 8,
            "gpu_seconds": 1.5,
            "cost": 0.003,
        }
        listing = _Answers({"batches": [_batch(usage=usage)], "has_more": False})
        _, text = batches_list(cast(Client, listing), _args(), io.StringIO())
        header, row = text.splitlines()
        self.assertEqual(header.split()[6:8], ["TOKENS", "COST"])
        # DONE is two words ("2/2 100%").
        self.assertEqual(row.split()[7:9], ["18", "0.003000"])
        one = _Answers(_batch(usage=usage))
        _, text = batches_show(cast(Client, one), _args(id="batch_1"), io.StringIO())
        self.assertIn(
            "usage: 2 lines run, 10 prompt and 8 completion tokens, 1.500 GPU s,"
            " cost 0.003000\n",
            text,
        )

    def test_older_server(self) -> None:
        """
        A batch without C{usage} (a server older than this C{ctl}) lists
        with no TOKENS or COST and shows without a usage line.
        """
        listing = _Answers({"batches": [_batch()], "has_more": False})
        _, text = batches_list(cast(Client, listing), _args(), io.StringIO())
        _, row = text.splitlines()
        self.assertEqual(row.split()[7:9], ["-", "-"])
        one = _Answers(_batch())
        _, text = batches_show(cast(Client, one), _args(id="batch_1"), io.StringIO())
        self.assertIn("status: completed\n", text)
        self.assertNotIn("usage:", text)
