"""The request body limit, as ASGI middleware: a body larger than limits.MAX_BODY_BYTES is answered 413, before a
byte of it is read when Content-Length says so, else as soon as the bytes received pass the limit (a chunked
body), so a huge body costs neither memory nor time."""
from __future__ import annotations

import json
from typing import Any

from kvlab.experiments.serve.protocol import ApiError


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit:,} bytes")


class BodyLimit:
    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self.refuse(send)
        await self.app(scope, self.counting(receive), send)

    def counting(self, receive: Any) -> Any:
        """`receive`, raising BodyTooLarge (answered 413 by the app's ApiError handler) past the limit."""
        seen = 0

        async def receive_counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge(self.limit)
            return message
        return receive_counted

    async def refuse(self, send: Any) -> None:
        error = BodyTooLarge(self.limit)
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
