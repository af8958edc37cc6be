"""
Requests and tokens per minute and token budgets counted for all routers
together, in Redis (C{[limits] url = "redis://..."}): one sliding window per
key and limit, checked and counted by one Lua script, so one round trip per
admission and no two routers admitting on the same count.  Redis runs a
script atomically ("no other script or Redis command will be executed while
a script is being executed": U{https://redis.io/docs/latest/develop/interact/programmability/eval-intro/});
the client sends it by C{EVALSHA}, falling back to C{EVAL} once when Redis
does not have it cached yet (redis-py's C{Script}:
U{https://redis.readthedocs.io/en/stable/commands.html#redis.commands.core.CoreCommands.register_script}).
Time is Redis's own (C{TIME}), so routers' clocks need not agree.

Per key (C{{ID}} a Redis Cluster hash tag, all its keys in one slot):

  - C{llmgw:{ID}:req}: a sorted set, one member per admitted request,
    scored by its time; those older than the window dropped at each
    admission, the count compared with C{rpm}.
  - C{llmgw:{ID}:tok} and C{llmgw:{ID}:win}: the tokens of finished
    requests (member C{ROUTER:N:TOKENS}, scored by time) and their sum
    over the window, kept by subtracting what leaves it.
  - C{llmgw:{ID}:res}: tokens held by requests in flight (member
    C{ROUTER:N:TOKENS}), their sum in C{held} below; a router killed with
    requests in flight leaves them, so they are dropped after
    L{RESERVATION_TTL} seconds.
  - C{llmgw:{ID}:state}: C{used}, the key's tokens in all (seeded from the
    store by the first router to ask), for the budget; C{held}.

Redis calls run on a thread pool of their own (redis-py is blocking),
results delivered on the reactor thread.
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections.abc import Callable
from typing import Any

import redis
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from llmgw.router.errors import APIError

RESERVATION_TTL = 900.0
"""
Seconds after which a request's held tokens are let go even if its router
never said it finished (it died): longer than any request runs.
"""

ADMITTED, OVER_BUDGET, OVER_RPM, OVER_TPM = 0, 1, 2, 3

_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = tonumber(ARGV[1])
local rpm = tonumber(ARGV[2])
local tpm = tonumber(ARGV[3])
local budget = tonumber(ARGV[4])
local reserve = tonumber(ARGV[5])
local member = ARGV[6]
local expire = math.ceil(tonumber(ARGV[8]))
redis.call('HSETNX', KEYS[5], 'used', ARGV[7])
local start = now - window
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', start)
if redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('HSET', KEYS[5], 'held', 0)
end
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[8]))
if #stale > 0 then
  local gone = 0
  for _, m in ipairs(stale) do gone = gone + tonumber(string.match(m, ':(%d+)$')) end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[8]))
  redis.call('HINCRBY', KEYS[5], 'held', -gone)
end
local reserved = tonumber(redis.call('HGET', KEYS[5], 'held') or '0')
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', start)
if #old > 0 then
  local gone = 0
  for _, m in ipairs(old) do gone = gone + tonumber(string.match(m, ':(%d+)$')) end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', start)
  redis.call('DECRBY', KEYS[4], gone)
end
local used = tonumber(redis.call('HGET', KEYS[5], 'used') or '0')
local in_window = tonumber(redis.call('GET', KEYS[4]) or '0')
if budget >= 0 and used + reserved >= budget then
  return {1, '0'}
end
if rpm >= 0 and redis.call('ZCARD', KEYS[1]) >= rpm then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {2, tostring(tonumber(first[2]) + window - now)}
end
if tpm >= 0 and in_window + reserved >= tpm then
  local over = in_window + reserved - tpm
  local wait = window
  local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    over = over - tonumber(string.match(entries[i], ':(%d+)$'))
    if over < 0 then
      wait = tonumber(entries[i + 1]) + window - now
      break
    end
  end
  return {3, tostring(wait)}
end
redis.call('ZADD', KEYS[1], now, member)
redis.call('EXPIRE', KEYS[1], expire)
if reserve > 0 then
  redis.call('ZADD', KEYS[3], now, member .. ':' .. reserve)
  redis.call('HINCRBY', KEYS[5], 'held', reserve)
  redis.call('EXPIRE', KEYS[3], expire)
end
return {0, '0'}
"""

_USED = """
if ARGV[1] ~= '' and redis.call('ZREM', KEYS[3], ARGV[1]) == 1 then
  redis.call('HINCRBY', KEYS[5], 'held', -tonumber(string.match(ARGV[1], ':(%d+)$')))
end
local tokens = tonumber(ARGV[2])
if tokens > 0 then
  redis.call('HINCRBY', KEYS[5], 'used', tokens)
  if ARGV[5] == '1' then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
    local expire = math.ceil(tonumber(ARGV[4]))
    redis.call('ZADD', KEYS[2], now, ARGV[3] .. ':' .. tokens)
    redis.call('INCRBY', KEYS[4], tokens)
    redis.call('EXPIRE', KEYS[2], expire)
    redis.call('EXPIRE', KEYS[4], expire)
  end
end
return 0
"""


def _keys(key_id: int) -> list[str]:
    # KEYS[1..5] of both scripts, in this order.
    base = f"llmgw:{{{key_id}}}"
    return [f"{base}:req", f"{base}:tok", f"{base}:res", f"{base}:win", f"{base}:state"]


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class RedisLimits:
    """
    The shared windows and budgets.

    @param url: C{redis://[:password@]host[:port][/db]} (or C{rediss://}).
    @param reactor: where results are delivered.
    @param window: seconds of the sliding windows.
    @param threads: concurrent Redis calls at most (and connections).
    @ivar router_id: this process's part of every member it adds.
    @ivar failing: whether Redis is away now (the last call failed with
        one of L{errors}); an outage is logged once when it starts and
        once when a call gets through again, however many requests meet
        it (admissions, and finished requests' tokens not counted there,
        summed in the second line).
    """

    errors = (redis.RedisError,)
    log = Logger()

    def __init__(
        self,
        url: str,
        reactor: IReactorFromThreads,
        window: float = 60.0,
        threads: int = 8,
    ) -> None:
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            max_connections=threads,
        )
        self._admit = self._client.register_script(_ADMIT)
        self._used = self._client.register_script(_USED)
        self._reactor = reactor
        self._window = window
        self._threads = ThreadPool(0, threads, "llmgw-limits")
        self._started = False
        self.router_id = uuid.uuid4().hex[:12]
        self._numbers = itertools.count()
        self.failing = False
        self._uncounted = 0

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._threads.start()

    def stop(self) -> None:
        if self._started:
            self._started = False
            self._threads.stop()
        self._client.close()

    def _call(self, work: Callable[[], Any], tokens: int = 0) -> Deferred[Any]:
        """
        Run C{work} on the pool, noting when Redis goes away or comes back.

        @param tokens: what C{work} would count, added to the outage's
            uncounted tokens when it fails.
        """
        self.start()
        d = deferToThreadPool(self._reactor, self._threads, work)

        def answered(result: Any) -> Any:
            if self.failing:
                self.failing = False
                uncounted, self._uncounted = self._uncounted, 0
                self.log.info(
                    "limits: Redis reached again; limits shared again"
                    " ({tokens} tokens of requests that ended meanwhile not"
                    " counted there)",
                    tokens=uncounted,
                )
            return result

        def failed(failure: Failure) -> Failure:
            if failure.check(*self.errors):
                self._uncounted += tokens
                if not self.failing:
                    self.failing = True
                    self.log.warn(
                        "limits: Redis cannot be reached ({error}); each router"
                        " counts its share of the limits until it can",
                        error=failure.getErrorMessage(),
                    )
            return failure

        d.addCallbacks(answered, failed)
        return d

    def member(self) -> str:
        """
        @return: a name for one request, unique among all routers.
        """
        return f"{self.router_id}:{next(self._numbers)}"

    def admit(
        self,
        key_id: int,
        rpm: int | None,
        tpm: int | None,
        budget: int | None,
        used: int,
        reserve: int,
        member: str,
    ) -> Deferred[tuple[int, float]]:
        """
        Check and count one request, atomically for all routers.

        @param used: the key's tokens in all as this router knows them,
            for Redis to start from when it has none.
        @param reserve: tokens to hold until L{used}.
        @param member: from L{member}; give the same to L{used}.
        @return: fires with C{(verdict, seconds)}: L{ADMITTED}, or which
            limit refused and seconds until a slot frees; fails with one
            of L{errors} when Redis cannot be reached or refuses (the
            outage logged here, once).
        """
        args: list[str | int | float] = [
            self._window,
            _limit(rpm),
            _limit(tpm),
            _limit(budget),
            reserve,
            member,
            used,
            self._window + RESERVATION_TTL,
        ]

        def call() -> tuple[int, float]:
            verdict, seconds = self._admit(keys=_keys(key_id), args=args)
            return int(verdict), float(seconds)

        return self._call(call)

    def used(
        self, key_id: int, member: str, reserved: int, tokens: int, tpm: bool
    ) -> Deferred[None]:
        """
        A request admitted as C{member} is over: let its held tokens go
        and count the C{tokens} it used (in the window when C{tpm}).
        """
        args: list[str | int | float] = [
            f"{member}:{reserved}" if reserved > 0 else "",
            tokens,
            member,
            self._window + 1,
            "1" if tpm else "0",
        ]

        def call() -> None:
            self._used(keys=_keys(key_id), args=args)

        return self._call(call, tokens)


def over_budget() -> APIError:
    """
    @return: the answer to a key over its token budget (429).
    """
    return APIError(
        429,
        "You exceeded your token budget; ask for a larger one.",
        "insufficient_quota",
        "insufficient_quota",
    )


def rate_limited(limit: str, wait: float) -> APIError:
    """
    @param limit: the limit passed, in words.
    @param wait: seconds until it lets the key in again.
    @return: the answer to a key over a rate (429 with C{Retry-After}).
    """
    return APIError(
        429,
        f"Rate limit reached: {limit}. Try again in {max(wait, 0):.1f}s.",
        "requests" if "requests" in limit else "tokens",
        "rate_limit_exceeded",
        retry_after=max(1, math.ceil(wait)),
    )
