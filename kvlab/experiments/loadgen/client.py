"""The load generator: sends a list of requests to an OpenAI-compatible server (`openai`: /v1/completions,
`openai-chat`: /v1/chat/completions, as `vllm bench serve --backend`) on a fixed arrival schedule (asyncio +
aiohttp, streaming) and times each at the client (see latency.py for the definitions). Every request is bounded
by the connect, read (silence between bytes) and total timeouts in `Timeouts`.
aiohttp, as vLLM's `bench serve` uses: its C stream parser costs under half of httpx's CPU per streamed token,
which matters when the client shares the machine with the server it measures."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import aiohttp

from kvlab.common.errors import ConfigError
from kvlab.experiments.loadgen.datasets import LoadRequest
from kvlab.experiments.loadgen.latency import RequestRecord

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
READ_BUFFER = 1 << 20
MAX_LINE = 2 * READ_BUFFER       # aiohttp's own limit for one line (twice the read buffer)


@dataclass(frozen=True)
class Timeouts:
    """Seconds; the defaults are documented in docs/serving.md."""
    connect: float = 30.0        # TCP connect
    read: float = 300.0          # silence between two reads of the response (a server that never answers)
    request: float = 3600.0      # one request in all (an SSE stream that never ends)


@dataclass(frozen=True)
class Target:
    """Where and how the requests go."""
    base_url: str
    backend: str = "openai"
    endpoint: str | None = None      # None: the backend's
    model: str | None = None         # None: the server's first /v1/models entry
    ignore_eos: bool = False
    timeouts: Timeouts = Timeouts()

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + (self.endpoint or BACKENDS[self.backend])


def client_timeout(t: Timeouts) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=t.request, connect=t.connect, sock_read=t.read)


def request_body(target: Target, model: str, req: LoadRequest) -> dict:
    body = {"model": model, "max_tokens": req.output_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.backend == "openai-chat":
        return body | {"messages": [{"role": "user", "content": req.prompt}]}
    return body | {"prompt": req.prompt}


def chunk_text(chunk: dict) -> str | None:
    """The text a streamed chunk carries (None when it carries no token)."""
    for c in chunk.get("choices") or []:
        text = c.get("text") or (c.get("delta") or {}).get("content")
        if text or c.get("token_ids"):
            return text or ""
    return None


async def send(session: aiohttp.ClientSession, target: Target, body: dict, req: LoadRequest,
               run_t0: float) -> RequestRecord:
    t0 = time.perf_counter()
    r = RequestRecord(prompt_len=req.prompt_len, start=t0 - run_t0)
    try:
        async with session.post(target.url, json=body, timeout=client_timeout(target.timeouts)) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return r
            await read_stream(resp, r, t0)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:      # ValueError: bad JSON, too-long line
        r.error = f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} (timeouts: {target.timeouts})"
        return r
    r.latency = time.perf_counter() - t0
    r.success = bool(r.output_tokens)
    r.error = "" if r.success else "no tokens streamed"
    return r


async def read_stream(resp: aiohttp.ClientResponse, r: RequestRecord, t0: float) -> None:
    """Times each streamed token into `r`; output_tokens from the server's usage, else the chunks counted."""
    last, chunks, usage, texts = t0, 0, None, []
    async for data in sse_data(resp.content):
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError(f"an SSE event that is not a JSON object: {data[:80]!r}")
        r.kvlab = chunk.get("kvlab") or r.kvlab
        usage = (chunk.get("usage") or {}).get("completion_tokens") or usage
        text = chunk_text(chunk)
        if text is not None:
            now = time.perf_counter()
            if chunks == 0:
                r.ttft = now - t0
            else:
                r.itl.append(now - last)
            last, chunks = now, chunks + 1
            texts.append(text)
    r.generated_text = "".join(texts)
    r.output_tokens = usage if isinstance(usage, int) and chunks else chunks


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """Each `data:` line's value (stripped), read as the bytes arrive: one await per read rather than per line,
    since each streamed token is two lines (its data and a blank one). A line longer than MAX_LINE is a
    ValueError, as aiohttp's own line reader raises."""
    pending = b""
    async for piece in content.iter_any():
        lines = (pending + piece).split(b"\n")
        pending = lines.pop()
        if len(pending) > MAX_LINE:
            raise ValueError(f"an SSE line longer than {MAX_LINE} bytes")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):                     # the stream ended without a final newline
        yield pending[5:].strip()


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists (any OpenAI-compatible server has GET /v1/models)."""
    try:
        async with session.get(base_url + "/v1/models") as resp:
            resp.raise_for_status()
            model = (await resp.json(content_type=None))["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, LookupError, TypeError) as e:
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise ConfigError(f"could not read the model from {base_url}/v1/models ({why}); pass --model") from None
    if not isinstance(model, str):
        raise ConfigError(f"{base_url}/v1/models names no model id; pass --model")
    return model


def fetch_model(target: Target) -> str:
    """The first model the server lists, fetched once before the run (for the start line and the result)."""
    async def fetch() -> str:
        timeout = client_timeout(target.timeouts)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await served_model(session, target.base_url.rstrip("/"))
    return asyncio.run(fetch())


async def run_load(target: Target | str, requests: Sequence[LoadRequest], arrivals: Sequence[float],
                   max_concurrency: int | None = None, model: str | None = None,
                   on_done: Callable[[RequestRecord], None] | None = None, start_at: float | None = None
                   ) -> tuple[list[RequestRecord], float, int]:
    """Returns (records in request order, duration in seconds, most requests in flight at once); `on_done` is
    called as each request ends (the progress bar). A plain URL is the `openai` backend with default timeouts.
    `start_at`: the time.perf_counter() that arrival 0.0 means (several runs sharing one clock); default now."""
    target = Target(target) if isinstance(target, str) else target
    limit = max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    in_flight = peak = 0
    timeout = client_timeout(target.timeouts)
    connector = aiohttp.TCPConnector(limit=limit)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, read_bufsize=READ_BUFFER) as session:
        model = model or target.model or await served_model(session, target.base_url.rstrip("/"))
        t0 = time.perf_counter() if start_at is None else start_at

        async def one(req: LoadRequest) -> RequestRecord:
            nonlocal in_flight, peak
            async with gate:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    record = await send(session, target, request_body(target, model, req), req, t0)
                finally:
                    in_flight -= 1
            if on_done is not None:
                on_done(record)
            return record

        tasks = []
        for req, at in zip(requests, arrivals):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - t0, peak
