"""
A small HTTP/1.1 load generator, for C{router_bench.py} where C{wrk} is not
installed.

C{connections} keep-alive connections over raw asyncio sockets, each
sending one POST, reading the whole response (Content-Length or chunked),
and sending the next, until C{duration} seconds have passed.  Prints one
JSON object to stdout::

    {"requests": N, "seconds": S, "requests_per_s": R, "p50_ms": .., "p99_ms":
     .., "non_2xx": N, "errors": N}

Far slower than wrk on one core: figures from it are comparable with each
other within one run, not with wrk's.

Run::

    python bench/pyload.py --url http://127.0.0.1:PORT/v1/chat/completions \\
        --connections 32 --duration 10 --body '{"model": ...}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

REQUEST_TIMEOUT = 10.0
"""
Seconds one request may take, headers and body, before it counts as an
error and its connection is closed.
"""

MAX_CHUNKS = 100_000
"""
Chunks in one chunked response beyond which the response counts as an error.
"""

MAX_RECONNECTS = 1000
"""
New connections one worker may open after errors in one run.
"""


class BadResponse(Exception):
    """
    The response could not be framed.
    """


@dataclass
class Tally:
    """
    What all connections saw; latencies in seconds.
    """

    latencies: list[float] = field(default_factory=list)
    non_2xx: int = 0
    errors: int = 0


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """
    Read one response, body included.

    @return: the status and whether the server will close the connection.
    @raise BadResponse: unparseable framing.
    """
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise BadResponse(f"bad status line {status_line!r}")
    status = int(parts[1])
    length: int | None = None
    chunked = False
    close = parts[0] == b"HTTP/1.0"
    for _ in range(200):
        line = await reader.readline()
        if line in (b"\r\n", b"\n"):
            break
        if not line:
            raise BadResponse("connection closed in headers")
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value:
            chunked = True
        elif name == b"connection":
            close = value == b"close"
    else:
        raise BadResponse("too many headers")
    if chunked:
        for _ in range(MAX_CHUNKS):
            size = int((await reader.readline()).split(b";")[0].strip(), 16)
            if size == 0:
                break
            await reader.readexactly(size + 2)
        else:
            raise BadResponse("too many chunks")
        for _ in range(200):
            if (await reader.readline()) in (b"\r\n", b"\n", b""):
                break
    elif length is not None:
        await reader.readexactly(length)
    else:
        await reader.read()
        close = True
    return status, close


async def _worker(
    host: str, port: int, request: bytes, deadline: float, tally: Tally
) -> None:
    """
    Send requests on one connection, reconnecting after an error, until
    C{deadline} (a C{time.monotonic} value).
    """
    for _ in range(MAX_RECONNECTS):
        if time.monotonic() >= deadline:
            return
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), REQUEST_TIMEOUT
            )
        except (OSError, TimeoutError):
            tally.errors += 1
            continue
        try:
            while time.monotonic() < deadline:
                start = time.perf_counter()
                writer.write(request)
                status, close = await asyncio.wait_for(
                    _read_response(reader), REQUEST_TIMEOUT
                )
                tally.latencies.append(time.perf_counter() - start)
                if not 200 <= status < 400:
                    tally.non_2xx += 1
                if close:
                    break
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            tally.errors += 1
        except BadResponse:
            tally.errors += 1
        finally:
            writer.close()


def _percentile(ordered: list[float], fraction: float) -> float:
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))
    return ordered[index]


async def run(
    url: str, connections: int, duration: float, body: bytes
) -> dict[str, float]:
    """
    Load C{url} with POSTs of C{body} for C{duration} seconds.

    @return: the JSON object described in the module docstring.
    """
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 80
    path = parts.path or "/"
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        + (
            f"Authorization: {os.environ['BENCH_AUTH']}\r\n"
            if os.environ.get("BENCH_AUTH")
            else ""
        )
        + "\r\n"
    ).encode("ascii") + body
    tally = Tally()
    start = time.monotonic()
    deadline = start + duration
    await asyncio.wait_for(
        asyncio.gather(
            *(_worker(host, port, request, deadline, tally) for _ in range(connections))
        ),
        duration + REQUEST_TIMEOUT + 5,
    )
    seconds = time.monotonic() - start
    ordered = sorted(tally.latencies)
    return {
        "requests": len(ordered),
        "seconds": seconds,
        "requests_per_s": len(ordered) / seconds,
        "p50_ms": _percentile(ordered, 0.50) * 1000,
        "p99_ms": _percentile(ordered, 0.99) * 1000,
        "non_2xx": tally.non_2xx,
        "errors": tally.errors,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="A small HTTP/1.1 POST load generator.")
    p.add_argument("--url", required=True)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--duration", type=float, default=10.0, help="seconds")
    p.add_argument("--body", required=True, help="the JSON request body")
    args = p.parse_args(argv)
    result = asyncio.run(
        run(args.url, args.connections, args.duration, args.body.encode("utf-8"))
    )
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
