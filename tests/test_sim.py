"""
Tests for L{llmgw.sim}, the engine simulator: the generation model, its
metrics, fault specs and the scheduler, on their own.

The site over an in-memory transport is in L{tests.test_sim_site}; the
simulator on a real port and as a child process in
L{tests.test_sim_listening}.
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import reactor as _reactor
from twisted.internet.defer import (
    CancelledError,
    Deferred,
)
from twisted.internet.interfaces import IReactorProcess
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.sim.api import (
    ApiError,
    completion_text,
    full_response,
    parse_embeddings,
    parse_generation,
    reasoning_tokens,
    stream_events,
)
from llmgw.sim.core import (
    CORE_EXITED_LOG,
    ENGINE_DEAD_LOG,
    OUTPUT_HANDLER_LOG,
    Core,
    CoreProcess,
    exit_output,
)
from llmgw.sim.engine import (
    VOCAB,
    QueueFull,
    Scheduler,
    SimConfig,
    Simulator,
    completion_tokens,
    count_prompt_tokens,
    embedding_vector,
)
from llmgw.sim.faults import (
    FAULT_KEYS,
    FaultError,
    parse_fault_option,
    validate_faults,
)
from tests.sim_support import event_json

reactor: Any = _reactor


# ---------------------------------------------------------------------------
# The generation model


class GenerationModelTests(SynchronousTestCase):
    """
    Deterministic tokens, token counting and embeddings.
    """

    def test_vocab_mixes_ascii_and_multibyte(self) -> None:
        """
        Every token text has a leading space; some are ASCII and some take
        2, 3 and 4 bytes per character in UTF-8.
        """
        self.assertGreaterEqual(len(VOCAB), 30)
        self.assertTrue(all(w.startswith(" ") for w in VOCAB))
        widths = {max(len(c.encode("utf-8")) for c in w) for w in VOCAB}
        self.assertEqual(widths, {1, 2, 3, 4})

    def test_token_i_follows_crc32(self) -> None:
        """
        Token i of the completion is VOCAB[(crc32(prompt) + i) % len(VOCAB)].
        """
        import zlib

        prompt = b"say something"
        tokens = completion_tokens(prompt, 40)
        base = zlib.crc32(prompt)
        self.assertEqual(tokens, [VOCAB[(base + i) % len(VOCAB)] for i in range(40)])
        self.assertEqual(completion_tokens(prompt, 40), tokens)
        self.assertNotEqual(completion_tokens(b"other", 5), tokens[:5])

    def test_prompt_tokens_are_words_at_least_one(self) -> None:
        """
        Prompt tokens count whitespace-separated words, and never fewer than
        one.
        """
        self.assertEqual(count_prompt_tokens("a  b\nc\t d"), 4)
        self.assertEqual(count_prompt_tokens(""), 1)
        self.assertEqual(count_prompt_tokens("   "), 1)

    def test_chat_prompt_joins_message_contents(self) -> None:
        """
        A chat prompt is every message's content, string or text parts,
        joined by spaces; max_completion_tokens counts as max_tokens.
        """
        body = {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hello"},
                        {"type": "image_url", "image_url": {"url": "x"}},
                        {"type": "text", "text": "wörld"},
                    ],
                },
            ],
            "max_completion_tokens": 3,
        }
        req = parse_generation("chat", json.dumps(body).encode())
        self.assertEqual(req.prompt, "be brief hello wörld".encode())
        self.assertEqual(req.prompt_tokens, 4)
        self.assertEqual(req.max_tokens, 3)
        self.assertFalse(req.stream)

    def test_bad_requests_are_400(self) -> None:
        """
        Bad JSON, a missing model and missing messages or prompt are 400s.
        """
        for kind, body in [
            ("chat", b"{"),
            ("chat", b"[]"),
            ("chat", b'{"messages": [{"content": "x"}]}'),
            ("chat", b'{"model": "m"}'),
            ("completion", b'{"model": "m"}'),
            ("completion", b'{"model": "m", "prompt": "x", "max_tokens": -1}'),
            ("completion", b'{"model": "m", "prompt": "x", "stream": "yes"}'),
        ]:
            with self.assertRaises(ApiError) as raised:
                parse_generation(kind, body)  # type: ignore[arg-type]
            self.assertEqual(raised.exception.status, 400)

    def test_embeddings_are_deterministic_unit_vectors(self) -> None:
        """
        An embedding has the configured length, Euclidean norm 1, and
        depends only on its input.
        """
        a = embedding_vector(b"hello", 16)
        self.assertEqual(len(a), 16)
        self.assertAlmostEqual(sum(x * x for x in a), 1.0)
        self.assertEqual(a, embedding_vector(b"hello", 16))
        self.assertNotEqual(a, embedding_vector(b"hellp", 16))

    def test_embedding_inputs(self) -> None:
        """
        Embeddings take a string, strings, a token list or token lists.
        """
        self.assertEqual(len(parse_embeddings(b'{"model":"m","input":"a"}').inputs), 1)
        req = parse_embeddings(b'{"model":"m","input":["a b","c"]}')
        self.assertEqual((len(req.inputs), req.prompt_tokens), (2, 3))
        req = parse_embeddings(b'{"model":"m","input":[1,2,3]}')
        self.assertEqual((len(req.inputs), req.prompt_tokens), (1, 3))
        req = parse_embeddings(b'{"model":"m","input":[[1,2],[3]]}')
        self.assertEqual((len(req.inputs), req.prompt_tokens), (2, 3))
        with self.assertRaises(ApiError):
            parse_embeddings(b'{"model":"m","input":[]}')

    @given(
        prompt=st.text(max_size=40),
        count=st.integers(min_value=0, max_value=40),
        chat=st.booleans(),
        usage=st.booleans(),
    )
    def test_stream_events_carry_the_completion(
        self, prompt: str, count: int, chat: bool, usage: bool
    ) -> None:
        """
        The SSE events are compact JSON whose token texts join into the
        completion, with C{"usage": null} on every chunk but the usage chunk
        when usage is asked for, and none at all otherwise.
        """
        body = {
            "model": "m",
            "stream": True,
            "max_tokens": count,
            "stream_options": {"include_usage": usage},
        }
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        req = parse_generation(
            "chat" if chat else "completion", json.dumps(body).encode()
        )
        events, first = stream_events(req, "id-1", 7, count)
        self.assertEqual(events[-1], b"data: [DONE]\n\n")
        chunks = [event_json(e) for e in events[:-1]]
        text = "".join(
            (
                c["choices"][0]["delta"].get("content", "")
                if chat
                else c["choices"][0]["text"]
            )
            for c in chunks
            if c["choices"]
        )
        self.assertEqual(text, completion_text(prompt.encode(), count))
        self.assertEqual(first, 1 if chat else 0)
        if usage:
            self.assertEqual(chunks[-1]["choices"], [])
            self.assertEqual(chunks[-1]["usage"]["completion_tokens"], count)
            self.assertTrue(all(c["usage"] is None for c in chunks[:-1]))
        else:
            self.assertTrue(all("usage" not in c for c in chunks))
        final = chunks[-2] if usage else chunks[-1]
        self.assertEqual(final["choices"][0]["finish_reason"], "length")


class ReasoningTests(SynchronousTestCase):
    """
    With C{--reasoning-parser} a chat answer opens with reasoning, in the
    fields vLLM 0.32 gives with a reasoning parser.
    """

    def test_reasoning_fields(self) -> None:
        """
        The first half of the tokens are the message's C{reasoning} and
        the stream's C{reasoning} deltas; a request that turns thinking
        off, or a completion, has none.
        """
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        req = parse_generation("chat", json.dumps(body).encode())
        self.assertEqual(reasoning_tokens("qwen3", req, 5), 2)
        self.assertEqual(reasoning_tokens("", req, 5), 0)
        whole = json.loads(full_response(req, "id", 1, 5, 2))
        message = whole["choices"][0]["message"]
        self.assertEqual(
            message["reasoning"] + message["content"], completion_text(b"hi", 5)
        )
        self.assertEqual(message["reasoning"], completion_text(b"hi", 2))
        events, _ = stream_events(req, "id", 1, 5, 2)
        deltas = [event_json(e)["choices"][0]["delta"] for e in events[1:-2]]
        self.assertEqual(
            [next(iter(d)) for d in deltas], ["reasoning"] * 2 + ["content"] * 3
        )
        for off in (
            {"reasoning_effort": "none"},
            {"chat_template_kwargs": {"enable_thinking": False}},
        ):
            quiet = parse_generation("chat", json.dumps({**body, **off}).encode())
            self.assertEqual(reasoning_tokens("qwen3", quiet, 5), 0)


class MetricsTests(SynchronousTestCase):
    """
    The simulator's own histogram follows Prometheus bucket rules.
    """

    def test_bucket_bounds_are_inclusive(self) -> None:
        sim = Simulator(SimConfig(models=("m",)), Clock())
        itl = sim.metrics.inter_token_latency
        itl.observe(0.005)
        itl.observe(0.0051)
        itl.observe(1e6)
        text = sim.metrics.render().decode()
        prefix = "vllm:inter_token_latency_seconds"
        self.assertIn(
            prefix + '_bucket{engine="0",le="0.001",model_name="m"} 0.0', text
        )
        self.assertIn(
            prefix + '_bucket{engine="0",le="0.005",model_name="m"} 1.0', text
        )
        self.assertIn(prefix + '_bucket{engine="0",le="0.01",model_name="m"} 2.0', text)
        self.assertIn(prefix + '_bucket{engine="0",le="10.0",model_name="m"} 2.0', text)
        self.assertIn(prefix + '_bucket{engine="0",le="+Inf",model_name="m"} 3.0', text)
        self.assertIn(prefix + '_count{engine="0",model_name="m"} 3.0', text)
        self.assertEqual(itl.count, 3)


class FaultSpecTests(SynchronousTestCase):
    """
    Fault specifications are validated, with errors naming the key.
    """

    def test_unknown_key_is_named(self) -> None:
        with self.assertRaises(FaultError) as raised:
            validate_faults({"status": 503, "explode": True})
        self.assertIn("explode", str(raised.exception))

    def test_bad_values(self) -> None:
        for spec in [
            {"status": "503"},
            {"status": 99},
            {"status": True},
            {"stall_seconds": -1},
            {"drop_after_chunks": 1.5},
            {"byte_writes": 1},
        ]:
            self.assertRaises(FaultError, validate_faults, spec)
        self.assertRaises(FaultError, validate_faults, [])

    def test_option_values_are_json(self) -> None:
        self.assertEqual(parse_fault_option("status=503"), ("status", 503))
        self.assertEqual(parse_fault_option("byte_writes=true"), ("byte_writes", True))
        self.assertEqual(
            parse_fault_option("stall_seconds=0.5"), ("stall_seconds", 0.5)
        )
        self.assertRaises(FaultError, parse_fault_option, "status")
        self.assertEqual(
            FAULT_KEYS,
            {
                "status",
                "stall_before_first_byte",
                "stall_after_chunks",
                "stall_seconds",
                "drop_after_chunks",
                "byte_writes",
            },
        )


class SchedulerTests(SynchronousTestCase):
    """
    Concurrency slots and the FIFO queue.
    """

    def test_fifo(self) -> None:
        """
        Requests beyond the slots wait and are admitted oldest first.
        """
        s = Scheduler(2, 10)
        self.assertIsNone(s.acquire())
        self.assertIsNone(s.acquire())
        order: list[int] = []
        waiters = [s.acquire() for _ in range(3)]
        for i, w in enumerate(waiters):
            assert w is not None

            def in_order(_: object, i: int = i) -> None:
                order.append(i)

            w.addCallback(in_order)
        self.assertEqual((s.running, s.waiting), (2, 3))
        s.release()
        self.assertEqual(order, [0])
        s.release()
        s.release()
        self.assertEqual(order, [0, 1, 2])
        self.assertEqual((s.running, s.waiting), (2, 0))

    def test_cancel_leaves_queue(self) -> None:
        """
        Cancelling a waiter takes it out of the queue; it fails with
        CancelledError and the next waiter gets the slot.
        """
        s = Scheduler(1, 10)
        s.acquire()
        first, second = s.acquire(), s.acquire()
        assert first is not None and second is not None
        first.cancel()
        self.failureResultOf(first, CancelledError)
        self.assertEqual(s.waiting, 1)
        s.release()
        self.successResultOf(second)
        self.assertEqual((s.running, s.waiting), (1, 0))

    def test_queue_full(self) -> None:
        s = Scheduler(1, 1)
        s.acquire()
        s.acquire()
        self.assertRaises(QueueFull, s.acquire)

    def test_synchronous_release_does_not_recurse(self) -> None:
        """
        Waiters that finish as soon as they are admitted hand their slot on
        without growing the stack.
        """
        s = Scheduler(1, 10_000)
        s.acquire()
        admitted = []
        for i in range(5000):
            w = s.acquire()
            assert w is not None

            def admit(_: object, i: int = i) -> None:
                admitted.append(i)
                s.release()

            w.addCallback(admit)
        s.release()
        self.assertEqual(len(admitted), 5000)
        self.assertEqual((s.running, s.waiting), (0, 0))


class _Spawned:
    """
    A process transport as L{CoreProcess} uses one.
    """

    pid = 4242

    def signalProcess(self, name: str) -> None:
        pass


class _Spawner:
    """
    Spawns nothing; keeps the protocol so a test can end the child.
    """

    def spawnProcess(self, protocol: Any, *args: object, **kwargs: object) -> Any:
        self.protocol = protocol
        return _Spawned()


class CoreDeathTests(SynchronousTestCase):
    """
    L{Core} and L{CoreProcess} on a clock: when the simulator ends after
    its engine core died, as vLLM's server does (L{llmgw.sim.core}).
    """

    def setUp(self) -> None:
        self.clock = Clock()
        self.ended: list[float] = []
        self.core = Core(self.clock, lambda: self.ended.append(self.clock.seconds()))
        self.spawner = _Spawner()
        self.child = CoreProcess(
            cast(IReactorProcess, self.spawner), self.clock, self.core
        )
        self.child.start()
        self.patch(sys, "stderr", io.StringIO())

    def test_watchdog_looks_every_five_seconds(self) -> None:
        """
        Its core dead at 7 s, the watchdog's look at 10 s ends it 0.1 s
        later, once, after logging vLLM's death lines and exit output.
        """
        self.clock.advance(7)
        self.spawner.protocol.processExited(None)
        self.assertTrue(self.core.dead)
        self.clock.advance(2.9)
        self.assertEqual(self.ended, [])
        self.clock.pump([0.1, 0.1, 5, 5])
        self.assertEqual(self.ended, [10.1])
        logged = cast(io.StringIO, sys.stderr).getvalue().splitlines()
        self.assertIn(CORE_EXITED_LOG, logged[0])
        self.assertTrue(logged[len(OUTPUT_HANDLER_LOG)].endswith(ENGINE_DEAD_LOG))
        self.assertEqual(logged[-len(exit_output(1)) :][0], "INFO:     Shutting down")

    def test_request_ends_it(self) -> None:
        """
        A request answered by the dead engine ends it 0.1 s later, the
        watchdog's next look far off; while the core lives, nothing does.
        """
        self.core.terminate_if_errored()
        self.clock.advance(1)
        self.spawner.protocol.processExited(None)
        self.core.terminate_if_errored()
        self.core.terminate_if_errored()
        self.clock.advance(0.1)
        self.assertEqual(self.ended, [1.1])
        self.clock.advance(10)
        self.assertEqual(self.ended, [1.1])

    def test_hung_call_holds_the_end(self) -> None:
        """
        A call to the engine core in flight at its death never answers,
        and the end it meets then stops listening without ending; a call
        answered before the death is answered.
        """
        closed: list[int] = []
        core = Core(self.clock, lambda: self.ended.append(0), lambda: closed.append(1))
        before: Deferred[str] = Deferred()
        during: Deferred[str] = Deferred()
        answers: list[str] = []
        core.utility(before).addCallback(answers.append)
        core.utility(during).addCallback(answers.append)
        before.callback("asleep")
        core.died()
        # Its end comes before the call would have been done.
        core.terminate_if_errored()
        self.clock.advance(1)
        during.callback("asleep")
        self.assertEqual((answers, closed, self.ended), (["asleep"], [1], []))

    def test_stopped_with_the_simulator(self) -> None:
        """
        The child ended by the simulator's own stop is no death.
        """
        self.child.stop()
        self.spawner.protocol.processExited(None)
        self.clock.advance(10)
        self.assertEqual((self.core.dead, self.ended), (False, []))
