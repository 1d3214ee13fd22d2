"""The FastAPI app: OpenAI completions and chat completions (JSON or SSE), models, vLLM's tokenize, detokenize
and version, health, metrics.

Every error a request can cause is answered in the OpenAI shape; nothing a client sends reaches the engine
thread unvalidated, and the engine thread is the only one that touches the engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from kvlab.common.outputs import RequestOutput
from kvlab.experiments.limits import MAX_BODY_BYTES
from kvlab.experiments.serve import protocol
from kvlab.experiments.serve.body_limit import BodyLimit
from kvlab.experiments.serve.chat import renderer
from kvlab.experiments.serve.decoding import Decoding
from kvlab.experiments.serve.events import Event, FinishedEvent, RejectedEvent, TokensEvent
from kvlab.experiments.serve.extension import kvlab_extension
from kvlab.experiments.serve.failures import failure_error
from kvlab.experiments.serve.handles import EngineGone, EngineHandle
from kvlab.experiments.serve.logprobs import LogprobWriter, merge
from kvlab.experiments.serve.protocol import ApiError, Submission
from kvlab.experiments.serve.schema import describe_request_bodies
from kvlab.experiments.serve.token_chunk import TokenChunks

KVLAB_VERSION = importlib.metadata.version("kvlab")

DISCONNECT_POLL_S = 0.25
log = logging.getLogger("kvlab.serve")


class Server:
    """What the handlers share: the engine handle (a thread or a process) and its tokenizer (read-only here)."""

    def __init__(self, engine: EngineHandle, model_name: str) -> None:
        self.engine, self.model_name, self.tokenizer = engine, model_name, engine.tokenizer
        self.render_chat = renderer(engine.tokenizer)


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.attach(asyncio.get_running_loop())
        yield
        await server.engine.aclose()                      # aborts in-flight work and frees all KV

    app = FastAPI(title="kvlab", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        err = ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="internal_server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.exception_handler(UnicodeEncodeError)
    async def not_unicode(request: Request, e: UnicodeEncodeError) -> JSONResponse:
        err = ApiError(400, "the request holds a string that is not valid Unicode (a lone surrogate such as \\ud800)")
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, e: ClientDisconnect) -> Response:
        log.info("a client disconnected while sending its request body")
        return Response(status_code=400)                       # nobody reads it; the handler only keeps the log quiet

    @app.exception_handler(EngineGone)
    async def engine_gone(request: Request, e: EngineGone) -> JSONResponse:
        return JSONResponse(ApiError(503, str(e), kind="service_unavailable").body(), status_code=503)

    @app.get("/health")
    async def health() -> Response:
        if not server.engine.is_alive():
            raise EngineGone(server.engine.gone_reason)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvlab"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        text, _ = await server.engine.snapshot()
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.get("/kvlab/stats")
    async def kvlab_stats() -> dict:
        _, stats = await server.engine.snapshot()
        return stats

    @app.get("/version")
    async def version() -> dict:
        return {"version": KVLAB_VERSION}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await read_json(request)
        check_model(server, protocol.model_name(body))
        tokens = protocol.tokenize_request(body, server.render_chat, text_tokenizer(server))
        return {"count": len(tokens), "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await read_json(request)
        check_model(server, protocol.model_name(body))
        tokens = protocol.detokenize_request(body, server.engine.vocab_size)
        return {"prompt": text_tokenizer(server).decode(tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(server, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(server, request, chat=True)

    describe_request_bodies(app)
    return app


async def read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply") from None


def text_tokenizer(server: Server) -> Any:
    if server.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: send token ids")
    return server.tokenizer


def check_model(server: Server, model: str) -> None:
    """An empty model names the served one (as vLLM); any other name is a 404, as vLLM answers."""
    if model and model != server.model_name:
        named = repr(model)[1:-1]                       # one line (escaped), and a short prefix only
        named = named if len(named) <= 80 else named[:80] + "…"
        raise ApiError(404, f"The model `{named}` does not exist.", "model", kind="NotFoundError", code="404")


async def generate(server: Server, request: Request, chat: bool) -> Response:
    sub = protocol.parse(await read_json(request), chat, server.render_chat)
    check_model(server, sub.model)
    prompt = sub.prompt
    if isinstance(prompt, str) and server.tokenizer is not None:
        prompt = list(server.tokenizer.encode(prompt))      # tokenized here, off the engine thread
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    events: asyncio.Queue = asyncio.Queue()
    engine = server.engine
    if not engine.is_alive():
        raise EngineGone(engine.gone_reason)
    if not engine.submit(rid, prompt, sub.params, events.put_nowait, sub.kv_transfer_params):
        raise ApiError(429, f"the waiting queue is full ({engine.max_waiting} requests); retry later",
                       kind="rate_limit_error")
    try:
        first = await events.get()
    except asyncio.CancelledError:                             # the client left before the engine took it
        engine.abort(rid)
        raise
    if isinstance(first, RejectedEvent):
        if first.status == 503:
            raise EngineGone(first.message)
        raise ApiError(first.status, first.message, "prompt" if "prompt" in first.message else None)
    n_prompt = len(prompt) if isinstance(prompt, list) else 0
    resp = CompletionReply(server, sub, rid, n_prompt, events)
    if sub.stream:
        return StreamingResponse(resp.stream(), media_type="text/event-stream")
    return JSONResponse(await resp.collect(request))


class CompletionReply:
    """One request's events -> OpenAI JSON or SSE chunks."""

    def __init__(self, server: Server, sub: Submission, rid: str, n_prompt: int, events: asyncio.Queue) -> None:
        self.server, self.sub, self.rid, self.n_prompt, self.events = server, sub, rid, n_prompt, events
        self.dec = Decoding(server.tokenizer, sub.params.n, sub.stop)
        self.created = int(time.time())
        self.done = False
        self.error: str | None = None
        self.error_type: type | None = None
        self.extra: dict[str, Any] = {}
        self.transfer: dict[str, Any] | None = None     # the output's kv_transfer_params (a prefill engine's)
        self.echo = self._prompt_text() if sub.echo else ""
        n = sub.params.n
        self.writer = (None if sub.params.logprobs is None else
                       LogprobWriter(server.tokenizer, n, sub.chat, len(self.echo)))
        self.logprobs = [self.writer.empty() for _ in range(n)] if self.writer else [None] * n   # non-streaming

    def _prompt_text(self) -> str:
        prompt, tokenizer = self.sub.prompt, self.server.tokenizer
        if isinstance(prompt, str):
            return prompt
        return tokenizer.decode(prompt) if tokenizer is not None else ""

    # -- events ---------------------------------------------------------------------------------------------
    def apply(self, event: Event) -> list[tuple[int, list[int], str]]:
        """Update state; return (sample, ids, text) pieces to send. After acceptance a request's events are
        tokens, then finished or aborted."""
        if isinstance(event, TokensEvent):
            if self.writer is not None and event.logprobs is not None:
                self.writer.receive(event.logprobs)
            return self._tokens(event.token_ids)
        return self._done(event.output if isinstance(event, FinishedEvent) else None)

    def _tokens(self, token_ids: list[list[int]]) -> list[tuple[int, list[int], str]]:
        pieces = [(i, *self.dec.add(i, ids)) for i, ids in enumerate(token_ids) if ids]
        if self.dec.all_stopped():
            self.server.engine.abort(self.rid)              # every sample hit a stop string
        return pieces

    def _done(self, out: RequestOutput | None) -> list[tuple[int, list[int], str]]:
        """The request ended: its output, or None when it was aborted (or the engine stopped)."""
        self.done = True
        pieces = []
        for i in range(len(self.dec.samples)):
            ids, text = self.dec.add(i, [], final=True)
            if text:
                pieces.append((i, ids, text))
            reason = out.outputs[i].finish_reason if out is not None and i < len(out.outputs) else "abort"
            self.dec.finish(i, reason)
        if out is not None:
            self.n_prompt = len(out.prompt_token_ids)
            self.error, self.error_type = out.error, out.error_type
            self.transfer = out.kv_transfer_params
            if out.metrics is not None:
                self.extra = kvlab_extension(out.metrics, out.handoff)
        return pieces

    def usage(self) -> dict[str, int]:
        n_out = sum(len(s.token_ids) for s in self.dec.samples)
        return {"prompt_tokens": self.n_prompt, "completion_tokens": n_out, "total_tokens": self.n_prompt + n_out}

    # -- non-streaming ----------------------------------------------------------------------------------------
    async def collect(self, request: Request) -> dict[str, Any]:
        try:
            await self.drain(request)
        finally:
            if not self.done:
                self.server.engine.abort(self.rid)
        if self.error is not None:
            raise failure_error(self.error, self.error_type)
        choices = [self.choice(i, self.echo + s.text, s.finish_reason, logprobs=self.logprobs[i])
                   | {"token_ids": s.token_ids}
                   for i, s in enumerate(self.dec.samples)]
        return {"id": self.rid, "object": "chat.completion" if self.sub.chat else "text_completion",
                "created": self.created, "model": self.model(), "choices": choices, "usage": self.usage(),
                "kv_transfer_params": self.transfer, "kvlab": self.extra}

    async def drain(self, request: Request) -> None:
        """Apply events until the request ends or its client leaves. The client is checked every DISCONNECT_POLL_S
        whether events arrive or not: a request busy with tokens never times out its wait."""
        check_at = time.monotonic() + DISCONNECT_POLL_S
        while not self.done:
            with contextlib.suppress(asyncio.TimeoutError):
                self.gather(await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S))
            if time.monotonic() >= check_at:
                if await request.is_disconnected():
                    return
                check_at = time.monotonic() + DISCONNECT_POLL_S

    def gather(self, event: Event) -> None:
        """Apply one event, keeping each sample's logprobs (non-streamed answers send them at the end)."""
        for i, ids, _ in self.apply(event):
            if self.writer is not None:
                self.logprobs[i] = merge(self.logprobs[i], self.writer.take(i, ids))

    def model(self) -> str:
        return self.sub.model or self.server.model_name

    def choice(self, i: int, text: str, reason: str | None, delta: bool = False, logprobs: dict | None = None
               ) -> dict[str, Any]:
        if not self.sub.chat:
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        key = "delta" if delta else "message"
        body = {"content": text} if delta and text == "" and reason else {"role": "assistant", "content": text}
        return {"index": i, key: body, "logprobs": logprobs, "finish_reason": reason}

    def piece_logprobs(self, i: int, ids: list[int]) -> dict | None:
        return None if self.writer is None else self.writer.take(i, ids)

    # -- streaming --------------------------------------------------------------------------------------------
    def chunk(self, choices: list[dict[str, Any]], usage: dict | None = None, kvlab: dict | None = None,
              transfer: dict | None = None) -> str:
        body = {"id": self.rid, "object": "chat.completion.chunk" if self.sub.chat else "text_completion",
                "created": self.created, "model": self.model(), "choices": choices}
        if usage is not None:
            body["usage"] = usage
        if transfer is not None:
            body["kv_transfer_params"] = transfer
        if kvlab:
            body["kvlab"] = kvlab
        return f"data: {json.dumps(body)}\n\n"

    def running_usage(self) -> dict[str, int] | None:
        """Usage for every chunk when the client asked for continuous usage stats."""
        return self.usage() if self.sub.continuous_usage else None

    async def stream(self) -> AsyncIterator[str]:
        try:
            if self.echo:
                yield "".join(self.chunk([self.choice(i, self.echo, None, delta=True) | {"token_ids": []}],
                                         self.running_usage()) for i in range(self.sub.params.n))
            plain = None if self.writer is not None or self.sub.continuous_usage else \
                TokenChunks(self.rid, self.created, self.model(), self.sub.chat)
            while not self.done:
                for i, ids, text in self.apply(await self.events.get()):
                    if plain is not None:                      # the same bytes, formatted once per request
                        yield plain.chunk(i, text, ids)
                        continue
                    choice = self.choice(i, text, None, True, self.piece_logprobs(i, ids)) | {"token_ids": ids}
                    yield self.chunk([choice], self.running_usage())
            tail = []                                          # one write for the last events
            if self.error is not None:
                err = failure_error(self.error, self.error_type)
                tail.append(f"data: {json.dumps(err.body())}\n\n")
            tail.append(self.chunk([self.choice(i, "", s.finish_reason, delta=True) | {"token_ids": []}
                                    for i, s in enumerate(self.dec.samples)], self.running_usage(),
                                   kvlab=self.extra, transfer=self.transfer))
            if self.sub.include_usage:
                tail.append(self.chunk([], self.usage()))
            tail.append("data: [DONE]\n\n")
            yield "".join(tail)
        finally:
            if not self.done:                                  # the client went away: free its KV now
                self.server.engine.abort(self.rid)
