"""/metrics counts the status each client got, over a real uvicorn server.

The MCP SDK answers a notification 202, then hands it to the session; when the session
was closed in between (the client's DELETE raced it), the SDK tries to send a 500 as
well, which uvicorn refuses. The soak counted that 500 as a server error though every
client saw its 202.
"""

from __future__ import annotations

import socket
import threading
import time

import anyio
import httpx
import uvicorn

from adapters.http.metrics import Metrics, RequestCounter


async def _app(scope, receive, send) -> None:
    """/raced: what the SDK does in that race, a complete 202 then a 500's start;
    anything else: an error before any answer (uvicorn answers 500)."""
    if scope["path"] != "/raced":
        raise RuntimeError("failed before answering")
    await send({"type": "http.response.start", "status": 202, "headers": []})
    await send({"type": "http.response.body", "body": b""})
    await send({"type": "http.response.start", "status": 500, "headers": []})


def _serve(app) -> tuple[uvicorn.Server, str, threading.Thread]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=anyio.run, args=(server.serve, [sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return server, "http://127.0.0.1:%d" % sock.getsockname()[1], thread


def test_the_status_counted_is_the_one_the_client_got():
    metrics = Metrics()

    server, base, thread = _serve(RequestCounter(_app, metrics))
    try:
        # A connection each: uvicorn drops the first one after the refused second start,
        # and a kept-alive connection could be reused just as it closes.
        for path, status in (("/raced", 202), ("/broken", 500)):
            with httpx.Client(base_url=base, timeout=10) as http:
                assert http.post(path).status_code == status
    finally:
        server.should_exit = True
        thread.join(10)

    def counted(status: str) -> float:
        return metrics.registry.get_sample_value("mtplxd_requests_total", {"endpoint": "other", "status": status}) or 0

    # Counting every response start would give 500: 2 and 202: 0.
    assert (counted("202"), counted("500")) == (1, 1)
