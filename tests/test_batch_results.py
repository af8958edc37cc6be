"""
A batch's output and error files and request counts from its lines
(L{llmgw.batches.results}), and the fixed room
(L{llmgw.batches.fixed_room}).
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from llmgw.batches import results
from llmgw.batches.fixed_room import FixedRoom
from llmgw.store.batches import BatchLine


def _line(
    number: int, state: str, status: int | None = None, result: object = None
) -> BatchLine:
    return BatchLine(
        "batch_x",
        number,
        f"c{number}",
        "m",
        "/v1/chat/completions",
        "{}",
        state=state,
        status_code=status,
        result=None if result is None else json.dumps(result),
    )


class FilesTests(SynchronousTestCase):
    def test_shapes_by_state(self) -> None:
        """
        A 2xx answer goes to the output file, any other answer to the error
        file with its answer as response; an expired or cancelled line goes
        to the error file with response null and OpenAI's error code; each
        in line order, with the line's own request id.
        """
        made = results.files(
            [
                _line(1, "done", 200, {"ok": 1}),
                _line(2, "failed", 400, {"error": {"message": "no"}}),
                _line(3, "expired"),
                _line(4, "done", 200, {"ok": 4}),
                _line(5, "cancelled"),
            ]
        )
        output = [json.loads(x) for x in made.output.splitlines()]
        errors = [json.loads(x) for x in made.error.splitlines()]
        self.assertEqual([e["custom_id"] for e in output], ["c1", "c4"])
        self.assertEqual(
            output[0],
            {
                "id": results.line_object_id("batch_x", 1),
                "custom_id": "c1",
                "response": {
                    "status_code": 200,
                    "request_id": "batch_x-1",
                    "body": {"ok": 1},
                },
                "error": None,
            },
        )
        self.assertTrue(output[0]["id"].startswith("batch_req_"))
        self.assertEqual([e["custom_id"] for e in errors], ["c2", "c3", "c5"])
        self.assertEqual(errors[0]["response"]["status_code"], 400)
        self.assertIsNone(errors[0]["error"])
        self.assertIsNone(errors[1]["response"])
        self.assertEqual(errors[1]["error"]["code"], "batch_expired")
        self.assertEqual(errors[2]["error"]["code"], "batch_cancelled")

    def test_ids_stable(self) -> None:
        """
        The ids are made from the batch's, the same each time, and differ
        between lines and between the two files.
        """
        self.assertEqual(
            results.line_object_id("batch_x", 1), results.line_object_id("batch_x", 1)
        )
        self.assertNotEqual(
            results.line_object_id("batch_x", 1), results.line_object_id("batch_x", 2)
        )
        self.assertNotEqual(
            results.file_id("batch_x", "output"), results.file_id("batch_x", "error")
        )

    def test_request_counts(self) -> None:
        """
        Completed counts the lines done; failed those failed or expired;
        cancelled ones in neither.
        """
        self.assertEqual(
            results.request_counts(
                {"done": 3, "failed": 1, "expired": 2, "cancelled": 4}
            ),
            {"completed": 3, "failed": 3},
        )


class FixedRoomTests(SynchronousTestCase):
    def test_per_replica(self) -> None:
        """
        A model's room is its ready replicas times the count, less its
        lines in flight; one line while it has no replica.
        """
        replicas = {"a": 2}
        room = FixedRoom(lambda model: replicas.get(model, 0), 3)
        self.assertEqual(room.room("a"), 6)
        for _ in range(5):
            room.sent("a")
        self.assertEqual(room.room("a"), 1)
        room.sent("a")
        self.assertEqual(room.room("a"), 0)
        room.ended("a")
        self.assertEqual(room.room("a"), 1)
        self.assertEqual(room.room("b"), 1)
        room.sent("b")
        self.assertEqual(room.room("b"), 0)
