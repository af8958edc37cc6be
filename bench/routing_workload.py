"""
The routing benchmark's workload and client (C{routing_bench.py}).

Multi-turn chat sessions over a few long shared system prompts, each turn
sending the whole conversation so far (the simulator's answers are
deterministic: L{llmgw.sim.engine.completion_tokens} gives each one before
it is asked for).  Sessions start as a Poisson process; within a session a
turn is sent after the previous answer ends and an exponential think time.

The client speaks HTTP/1.1 over raw asyncio sockets, one connection per
request (C{Connection: close}), and takes the time to first token as the
arrival of the first C{data:} event of the stream.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmgw.sim.engine import completion_tokens

REQUEST_TIMEOUT = 120.0
"""
Seconds one request may take before it counts as failed.
"""


@dataclass(frozen=True)
class Shape:
    """
    The workload's shape.

    @ivar sessions: chat sessions.
    @ivar turns: requests per session.
    @ivar prompts: shared system prompts; each session takes one at random.
    @ivar prompt_words: the system prompts' lengths in tokens (the
        simulator's tokens are words), drawn uniformly in this range.
    @ivar user_words: each user message's length, drawn uniformly.
    @ivar max_tokens: completion tokens per answer.
    @ivar think: mean seconds between an answer and the session's next turn.
    """

    sessions: int = 200
    turns: int = 3
    prompts: int = 10
    prompt_words: tuple[int, int] = (1000, 2000)
    user_words: tuple[int, int] = (40, 120)
    max_tokens: int = 24
    think: float = 1.0


@dataclass(frozen=True)
class Turn:
    """
    One request of a session.

    @ivar body: the request body, JSON.
    @ivar prompt_tokens: its prompt's length in the simulator's tokens.
    """

    body: bytes
    prompt_tokens: int


@dataclass(frozen=True)
class Session:
    """
    @ivar start: seconds after the run's start of its first turn.
    @ivar prompt: which system prompt it uses.
    @ivar turns: its requests in order.
    @ivar thinks: seconds to wait after each answer but the last.
    """

    start: float
    prompt: int
    turns: tuple[Turn, ...]
    thinks: tuple[float, ...]


def make_sessions(
    shape: Shape, model: str, session_rate: float, seed: int
) -> list[Session]:
    """
    The whole run's requests, fixed by C{seed}.

    @param session_rate: sessions started per second (Poisson).
    @return: sessions in start order.
    """
    rng = random.Random(seed)
    systems = [
        " ".join(f"p{i}w{j}" for j in range(rng.randint(*shape.prompt_words)))
        for i in range(shape.prompts)
    ]
    sessions = []
    start = 0.0
    for s in range(shape.sessions):
        start += rng.expovariate(session_rate)
        p = rng.randrange(shape.prompts)
        messages: list[dict[str, str]] = [{"role": "system", "content": systems[p]}]
        turns = []
        for t in range(shape.turns):
            n = rng.randint(*shape.user_words)
            user = " ".join(f"s{s}t{t}u{k}" for k in range(n))
            messages.append({"role": "user", "content": user})
            # The simulator's prompt: the contents joined by spaces.
            prompt = " ".join(m["content"] for m in messages)
            body = json.dumps(
                {
                    "model": model,
                    "messages": messages,
                    "max_tokens": shape.max_tokens,
                    "stream": True,
                }
            ).encode()
            turns.append(Turn(body, len(prompt.split())))
            answer = "".join(completion_tokens(prompt.encode(), shape.max_tokens))
            messages.append({"role": "assistant", "content": answer})
        thinks = tuple(rng.expovariate(1 / shape.think) for _ in range(shape.turns - 1))
        sessions.append(Session(start, p, tuple(turns), thinks))
    return sessions


@dataclass
class Outcome:
    """
    One request's fate; times in seconds.

    @ivar sent: when it was sent, from the run's start.
    @ivar ttft: time to the first event, or None when none came.
    @ivar latency: time to the end of the stream.
    @ivar ok: a 200 whose stream ended with C{[DONE]}.
    """

    sent: float
    ttft: float | None = None
    latency: float | None = None
    ok: bool = False
    error: str = ""


async def _request(
    host: str, port: int, path: str, body: bytes, sent: float
) -> Outcome:
    out = Outcome(sent)
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        tail = b""
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                break
            seen = tail + chunk
            if out.ttft is None and b"data:" in seen:
                out.ttft = time.monotonic() - t0
            if b"data: [DONE]" in seen:
                out.ok = status == b"200"
                break
            tail = seen[-16:]
        out.latency = time.monotonic() - t0
        if not out.ok:
            out.error = f"status {status.decode()}" if status != b"200" else "no [DONE]"
    finally:
        writer.close()
    return out


async def _session(
    host: str,
    port: int,
    path: str,
    session: Session,
    t0: float,
    outcomes: list[Outcome],
) -> None:
    await asyncio.sleep(max(0.0, t0 + session.start - time.monotonic()))
    for i, turn in enumerate(session.turns):
        sent = time.monotonic() - t0
        try:
            out = await asyncio.wait_for(
                _request(host, port, path, turn.body, sent), REQUEST_TIMEOUT
            )
        except (TimeoutError, OSError, asyncio.IncompleteReadError, IndexError) as e:
            out = Outcome(sent, error=f"{type(e).__name__}: {e}")
        outcomes.append(out)
        if not out.ok:
            return
        if i < len(session.thinks):
            await asyncio.sleep(session.thinks[i])


@dataclass
class Sampler:
    """
    Each replica's queue read from C{GET /sim/stats} once a second.

    @ivar waiting: per replica, the C{waiting} readings.
    """

    ports: Sequence[int]
    waiting: list[list[int]] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        self.waiting = [[] for _ in self.ports]
        while not stop.is_set():
            for i, port in enumerate(self.ports):
                try:
                    stats = await asyncio.wait_for(
                        get_json("127.0.0.1", port, "/sim/stats"), 5
                    )
                    self.waiting[i].append(int(stats["waiting"]))
                except (TimeoutError, OSError, ValueError):
                    pass
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass


async def get_json(host: str, port: int, path: str) -> dict[str, object]:
    """
    C{GET path} on a fresh connection; the body as a JSON object.
    """
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
        )
        raw = await reader.read(-1)
    finally:
        writer.close()
    _, _, body = raw.partition(b"\r\n\r\n")
    value = json.loads(body)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value


def run_sessions(
    port: int, sessions: Sequence[Session], sim_ports: Sequence[int]
) -> tuple[list[Outcome], Sampler]:
    """
    Play the sessions against C{127.0.0.1:port} in real time.

    @return: every request's outcome, and the replicas' sampled queues.
    """

    async def main() -> list[Outcome]:
        outcomes: list[Outcome] = []
        stop = asyncio.Event()
        sampling = asyncio.ensure_future(sampler.run(stop))
        t0 = time.monotonic() + 0.2
        await asyncio.gather(
            *(
                _session("127.0.0.1", port, "/v1/chat/completions", s, t0, outcomes)
                for s in sessions
            )
        )
        stop.set()
        await sampling
        return outcomes

    sampler = Sampler(sim_ports)
    return asyncio.run(main()), sampler
