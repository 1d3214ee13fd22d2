"""The load generator: sends a list of requests to an OpenAI-compatible /v1/completions on a fixed arrival
schedule (asyncio + aiohttp, streaming) and times each at the client (see latency.py for the definitions).
aiohttp, as vLLM's `bench serve` uses: its C stream parser costs under half of httpx's CPU per streamed token,
which matters when the client shares the machine with the server it measures."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import aiohttp

from kvlab.common.errors import ConfigError
from kvlab.experiments.loadgen.datasets import LoadRequest
from kvlab.experiments.loadgen.latency import RequestRecord


def request_body(model: str, req: LoadRequest) -> dict:
    return {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def has_token(chunk: dict) -> bool:
    for c in chunk.get("choices") or []:
        if c.get("text") or c.get("token_ids") or (c.get("delta") or {}).get("content"):
            return True
    return False


async def send(session: aiohttp.ClientSession, url: str, body: dict, run_t0: float) -> RequestRecord:
    t0 = time.perf_counter()
    r = RequestRecord(prompt_len=len(body["prompt"]), start=t0 - run_t0)
    last, chunks, usage = t0, 0, None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return r
            async for line in resp.content:                       # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("kvlab"):
                    r.kvlab = chunk["kvlab"]
                if chunk.get("usage"):
                    usage = chunk["usage"].get("completion_tokens")
                if has_token(chunk):
                    now = time.perf_counter()
                    if chunks == 0:
                        r.ttft = now - t0
                    else:
                        r.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:      # ValueError: bad JSON, too-long line
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.latency = time.perf_counter() - t0
    r.output_tokens = usage if usage is not None else chunks
    r.success = chunks > 0
    r.error = "" if r.success else "no tokens streamed"
    return r


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists (any OpenAI-compatible server has GET /v1/models)."""
    async with session.get(base_url + "/v1/models") as resp:
        try:
            resp.raise_for_status()
            return (await resp.json(content_type=None))["data"][0]["id"]
        except (aiohttp.ClientError, ValueError, LookupError, TypeError) as e:
            raise ConfigError(f"could not read the model from {base_url}/v1/models ({e}); pass --model") from None


async def run_load(base_url: str, requests: Sequence[LoadRequest], arrivals: Sequence[float],
                   max_concurrency: int | None = None, model: str | None = None) -> tuple[list[RequestRecord],
                                                                                          float, int]:
    """Returns (records in request order, duration in seconds, most requests in flight at once)."""
    base_url = base_url.rstrip("/")
    limit = max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    in_flight = peak = 0
    timeout = aiohttp.ClientTimeout(total=None, connect=30)
    connector = aiohttp.TCPConnector(limit=limit)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, read_bufsize=1 << 20) as session:
        model = model or await served_model(session, base_url)
        t0 = time.perf_counter()

        async def one(req: LoadRequest) -> RequestRecord:
            nonlocal in_flight, peak
            async with gate:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await send(session, base_url + "/v1/completions", request_body(model, req), t0)
                finally:
                    in_flight -= 1

        tasks = []
        for req, at in zip(requests, arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - t0, peak
