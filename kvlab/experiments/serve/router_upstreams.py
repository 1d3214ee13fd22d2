"""The router's engines: one list per role (prefill and decode, or colocated), each engine alive or not by its
last /health answer, chosen round-robin among the live ones. A health loop polls every engine; a request that
cannot reach an engine marks it dead at once, so the next request skips it until its /health answers 200."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger("kvlab.router")
HEALTH_EVERY_S = 1.0
HEALTH_TIMEOUT_S = 2.0
ROLES = ("prefill", "decode", "colocated")


class NoLiveEngine(Exception):
    """No engine of a role answers its health check: the router answers 503."""


@dataclass(slots=True)
class Upstream:
    url: str                          # http://host:port, no trailing slash
    role: str
    alive: bool = False

    def mark(self, alive: bool, why: str = "") -> None:
        if alive != self.alive:
            log.log(logging.INFO if alive else logging.WARNING, "%s engine %s is %s%s", self.role, self.url,
                    "up" if alive else "down", f" ({why})" if why else "")
        self.alive = alive


@dataclass(slots=True)
class RoundRobin:
    engines: list[Upstream]
    turn: int = 0

    def next_live(self) -> Upstream:
        """The next live engine after the last one chosen."""
        for _ in range(len(self.engines)):
            engine = self.engines[self.turn % len(self.engines)]
            self.turn += 1
            if engine.alive:
                return engine
        role = self.engines[0].role
        raise NoLiveEngine(f"no {role} engine is alive ({', '.join(e.url for e in self.engines)})")


@dataclass(slots=True)
class Upstreams:
    by_role: dict[str, RoundRobin] = field(default_factory=dict)

    @classmethod
    def of(cls, urls: dict[str, list[str]]) -> Upstreams:
        """`urls`: role -> its engines' base URLs (roles without engines are left out)."""
        return cls({role: RoundRobin([Upstream(u.rstrip("/"), role) for u in found])
                    for role, found in urls.items() if found})

    def roles(self) -> list[str]:
        return list(self.by_role)

    def pick(self, role: str) -> Upstream:
        return self.by_role[role].next_live()

    def all(self) -> list[Upstream]:
        return [e for rr in self.by_role.values() for e in rr.engines]

    def live_count(self, role: str) -> int:
        return sum(e.alive for e in self.by_role[role].engines)

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(check_health(session, e) for e in self.all()))

    async def watch(self, session: aiohttp.ClientSession) -> None:
        """Poll every engine's /health forever (cancelled when the router stops)."""
        while True:
            await self.check_all(session)
            await asyncio.sleep(HEALTH_EVERY_S)


async def check_health(session: aiohttp.ClientSession, engine: Upstream) -> None:
    timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
    try:
        async with session.get(engine.url + "/health", timeout=timeout) as resp:
            engine.mark(resp.status == 200, f"/health answered {resp.status}")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        engine.mark(False, type(e).__name__)


@contextlib.asynccontextmanager
async def watching(upstreams: Upstreams, session: aiohttp.ClientSession):
    """The health loop runs while the router serves: one check of every engine first, then one per second."""
    await upstreams.check_all(session)
    task = asyncio.create_task(upstreams.watch(session))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
