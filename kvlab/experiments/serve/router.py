"""`kvlab serve --role router`: an OpenAI-compatible proxy in front of prefill and decode engines, as vLLM's
disaggregated proxy. Each completion or chat request goes to a prefill engine with max_tokens=1 and
kv_transfer_params {"do_remote_decode": true}; the object it answers with goes, with the original request, to a
decode engine, which pulls the KV and generates the whole completion; its answer (or stream) is the client's.
With `--colocated` engines instead, each request goes whole to one of them: the same proxy in front of
colocated engines, the baseline disaggregation is measured against.

A request is checked by the engines' own validation layer (protocol.py) first, so a bad field is a 400 before
any engine computes anything (and no prefill KV waits for a decode call that would be refused). An engine's
own error answer (a 404 for a model, a prompt too long for it) is relayed as it came; an engine that
cannot be reached or fails mid-request is a 502 with one line (mid-stream: one error event, then the stream
ends); no live engine of a role is a 503. Every upstream call has a timeout; a client that leaves closes the
upstream connection, so the engine aborts the request (docs/disaggregation.md).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvlab.common.validate import shown
from kvlab.experiments.limits import MAX_BODY_BYTES
from kvlab.experiments.serve import protocol
from kvlab.experiments.serve.app import DISCONNECT_POLL_S, read_json
from kvlab.experiments.serve.body_limit import BodyLimit
from kvlab.experiments.serve.prom import LATENCY_BUCKETS
from kvlab.experiments.serve.protocol import ApiError
from kvlab.experiments.serve.router_upstreams import NoLiveEngine, Upstream, Upstreams, watching

CONNECT_TIMEOUT_S = 5.0
CHAT = "/v1/chat/completions"
DROPPED_FROM_PREFILL = ("stream", "stream_options", "max_completion_tokens")


class UpstreamFailed(Exception):
    """An engine could not be reached, or broke off its answer: the router answers 502."""


class ClientGone(Exception):
    """The client disconnected while the router waited for an engine."""


@dataclass(frozen=True, slots=True)
class RouterSettings:
    engines: dict[str, list[str]]     # role -> base URLs: prefill and decode, or colocated
    timeout_s: float                  # each upstream call (streams: the wait for each piece)


class RouterMetrics:
    """The router's own /metrics: requests by outcome, engine failures, live engines, prefill latency."""

    def __init__(self, upstreams: Upstreams) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvlab_router_requests", "requests routed, by outcome", ["outcome"], registry=r)
        self.failures = Counter("kvlab_router_upstream_failures", "engines unreachable or broken off mid-request",
                                ["role"], registry=r)
        self.prefill = Histogram("kvlab_router_prefill_seconds", "the prefill engine's answer, as the router waits",
                                 buckets=LATENCY_BUCKETS, registry=r)
        alive = Gauge("kvlab_router_engines_alive", "engines whose /health answered 200", ["role"], registry=r)
        for role in upstreams.roles():
            alive.labels(role).set_function(lambda role=role: upstreams.live_count(role))


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.upstreams = Upstreams.of(settings.engines)
        self.timeout_s = settings.timeout_s
        self.metrics = RouterMetrics(self.upstreams)
        self.session: aiohttp.ClientSession | None = None

    def timeout(self, stream: bool) -> aiohttp.ClientTimeout:
        if stream:
            return aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S, sock_read=self.timeout_s)
        return aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=CONNECT_TIMEOUT_S)

    def failed(self, engine: Upstream, e: BaseException) -> UpstreamFailed:
        """An engine call that raised: a connection error marks the engine dead until its /health answers."""
        if not isinstance(e, asyncio.TimeoutError):
            engine.mark(False, type(e).__name__)
        self.metrics.failures.labels(engine.role).inc()
        why = f"no answer within {self.timeout_s:g} s" if isinstance(e, asyncio.TimeoutError) else describe(e)
        return UpstreamFailed(f"the {engine.role} engine {engine.url} failed: {why}")

    async def post(self, engine: Upstream, path: str, body: dict) -> tuple[int, bytes]:
        try:
            async with self.session.post(engine.url + path, json=body, timeout=self.timeout(False)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise self.failed(engine, e) from None

    async def open_stream(self, engine: Upstream, path: str, body: dict) -> aiohttp.ClientResponse:
        try:
            return await self.session.post(engine.url + path, json=body, timeout=self.timeout(True))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise self.failed(engine, e) from None


def describe(e: BaseException) -> str:
    if isinstance(e, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):
        return "the connection closed before the answer ended (the engine stopped or died)"
    if isinstance(e, aiohttp.ClientConnectorError):
        return "cannot connect (the engine is not running)"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(ApiError(status, message, kind=kind).body(), status_code=status)


def create_router_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            router.session = session
            async with watching(router.upstreams, session):
                yield

    app = FastAPI(title="kvlab router", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    add_error_handlers(app, router)

    @app.get("/health")
    async def health() -> Response:
        for role in router.upstreams.roles():
            if not router.upstreams.live_count(role):
                raise NoLiveEngine(f"no {role} engine is alive")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        engine = router.upstreams.pick(router.upstreams.roles()[-1])         # decode, or colocated
        try:
            async with router.session.get(engine.url + "/v1/models", timeout=router.timeout(False)) as resp:
                return Response(await resp.read(), status_code=resp.status, media_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise router.failed(engine, e) from None

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route(router, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(router, request, CHAT)

    return app


def add_error_handlers(app: FastAPI, router: Router) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error")

    @app.exception_handler(NoLiveEngine)
    async def no_engine(request: Request, e: NoLiveEngine) -> JSONResponse:
        router.metrics.requests.labels("no_engine").inc()
        return error_response(503, str(e), "service_unavailable")

    @app.exception_handler(UpstreamFailed)
    async def upstream_failed(request: Request, e: UpstreamFailed) -> JSONResponse:
        router.metrics.requests.labels("upstream_failed").inc()
        return error_response(502, str(e), "bad_gateway")

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone) -> Response:
        router.metrics.requests.labels("client_gone").inc()
        return Response(status_code=499)                  # nobody reads it


async def route(router: Router, request: Request, path: str) -> Response:
    body = await read_json(request)
    protocol.parse(body, path == CHAT, lambda messages: "")     # a bad request is a 400 before any engine works
    if "colocated" in router.upstreams.by_role:
        return await forward(router, request, router.upstreams.pick("colocated"), path, body)
    started = time.perf_counter()
    prefill = router.upstreams.pick("prefill")
    status, answer = await while_connected(request, router.post(prefill, path, prefill_body(body)))
    if status != 200:                                 # the request's own error, as one engine would answer it
        check_json_object(router, prefill, status, answer)
        router.metrics.requests.labels("rejected").inc()
        return Response(answer, status_code=status, media_type="application/json")
    router.metrics.prefill.observe(time.perf_counter() - started)
    decode = dict(body, kv_transfer_params=transfer_params(answer) | {"do_remote_prefill": True})
    return await forward(router, request, router.upstreams.pick("decode"), path, decode)


async def forward(router: Router, request: Request, engine: Upstream, path: str, body: dict) -> Response:
    """The engine's answer to `body`, relayed: JSON, or its stream piece by piece."""
    if body.get("stream") is True:
        return await relay_stream(router, engine, path, body)
    status, answer = await while_connected(request, router.post(engine, path, body))
    check_json_object(router, engine, status, answer)
    router.metrics.requests.labels("ok" if status == 200 else "rejected").inc()
    return Response(answer, status_code=status, media_type="application/json")


def check_json_object(router: Router, engine: Upstream, status: int, answer: bytes) -> None:
    """An engine answers a JSON object, whatever its status: anything else is relayed as nobody's JSON would be,
    so it is a 502 naming the engine."""
    try:
        parsed = json.loads(answer)
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        router.metrics.failures.labels(engine.role).inc()
        raise UpstreamFailed(f"the {engine.role} engine {engine.url} answered {status} with a body that is not a "
                             f"JSON object: {answer[:60]!r}")


def prefill_body(body: dict) -> dict:
    """The prefill engine's request: the prompt, one token, and the ask to keep the KV for a decode engine."""
    kept = {k: v for k, v in body.items() if k not in DROPPED_FROM_PREFILL}
    return kept | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}


def transfer_params(answer: bytes) -> dict[str, Any]:
    try:
        params = json.loads(answer).get("kv_transfer_params")
    except (ValueError, AttributeError):
        params = None
    if not isinstance(params, dict):
        raise UpstreamFailed("the prefill engine's answer has no kv_transfer_params object (is it --role prefill?)")
    return params


async def while_connected(request: Request, call: Any) -> Any:
    """Await an upstream call; if the client leaves first, cancel it (closing the upstream connection makes the
    engine abort the request) and raise ClientGone."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        task.cancel()


async def relay_stream(router: Router, engine: Upstream, path: str, body: dict) -> Response:
    """The decode engine's stream, piece by piece as it comes. Headers are sent with the first piece, so an
    engine that breaks off later is reported as one error event before the stream ends."""
    resp = await router.open_stream(engine, path, body)
    if resp.status == 200 and resp.content_type != "text/event-stream":
        resp.close()
        router.metrics.failures.labels(engine.role).inc()
        raise UpstreamFailed(f"the {engine.role} engine {engine.url} answered a stream request with "
                             f"{shown(resp.content_type)}, not an event stream")
    if resp.status != 200:
        answer = await resp.read()
        resp.release()
        check_json_object(router, engine, resp.status, answer)
        router.metrics.requests.labels("rejected").inc()
        return Response(answer, status_code=resp.status, media_type="application/json")
    router.metrics.requests.labels("ok").inc()
    return StreamingResponse(relay(router, engine, resp), media_type="text/event-stream")


async def relay(router: Router, engine: Upstream, resp: aiohttp.ClientResponse):
    try:
        async for piece in resp.content.iter_any():
            yield piece
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        err = ApiError(502, str(router.failed(engine, e)), kind="bad_gateway")
        yield f"data: {json.dumps(err.body())}\n\n".encode()
    finally:
        resp.close()                                   # the client left, or the stream ended: free the connection
