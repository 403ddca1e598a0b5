"""ASGI middleware: a request body over the limit gets a 413 before the app sees it.

A declared Content-Length over the limit is answered at once, before any of the body
is uploaded; a body without one (chunked) is counted as it arrives. The body is read
here, so no route ever holds more than the limit, and is handed on as one message;
the messages after it (a client's disconnect) pass through, so streamed responses
still notice a client that leaves.
"""

from __future__ import annotations

from typing import Any, Callable

from starlette.datastructures import Headers
from starlette.responses import Response

# path, status, message, code -> the route's own error response (OpenAI, Anthropic or JSON-RPC form)
Refusal = Callable[[str, int, str, str], Response]


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int, refuse: Refusal):
        self.app = app
        self.max_bytes = max_bytes
        self.refuse = refuse

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send, f"declares {int(declared):,} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while uploading
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send, f"is over {size:,} bytes")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: dict, receive: Any, send: Any, what: str) -> None:
        message = (f"the request body {what}, over the limit of {self.max_bytes:,} bytes "
                   "(the max_body_bytes setting)")
        await self.refuse(scope["path"], 413, message, "request_too_large")(scope, receive, send)


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
