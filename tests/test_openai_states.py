"""The OpenAI adapter in the states a running daemon cannot be steered into.

An in-process uvicorn server with a real Scheduler whose engine loader the
test controls, reached over a loopback socket: model still loading, queue
full (429), load failed (503), and an engine that fails mid-stream.
"""

from __future__ import annotations

import socket
import threading
import time

import anyio
import httpx
import openai
import pytest
import uvicorn

import engine  # noqa: F401  (BLAS before mlx)
from adapters.http.app import create_app
from engine.engine import Engine
from mtplxd.config import Settings
from mtplxd.runtime import Runtime
from mtplxd.scheduler import Scheduler, SchedulerLimits
from tests.checkpoints import write
from tests.test_openai import CHAT, EMBEDDINGS, HI, LONG_CHAT, OK, health, wait_idle


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1)


class LiveServer:
    """uvicorn + a real Scheduler in a background thread, on a free loopback port."""

    def __init__(self, scheduler: Scheduler, settings=Settings(depth=2)):
        self.scheduler = scheduler
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.base_url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        app = create_app(Runtime(scheduler, settings), settings)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=anyio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.scheduler.run)
            await self.server.serve(sockets=[self.sock])
            self.scheduler.stop()

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.scheduler.stop()
        self.server.should_exit = True
        self.thread.join(10)


def _assert_error(r: httpx.Response, status: int, code: str | None) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_loading_then_queue_full(checkpoint):
    gate = threading.Event()
    limits = SchedulerLimits(max_active=1, interactive_reserve=0, max_queued=1)
    scheduler = Scheduler(lambda: gate.wait(30) and Engine.load(checkpoint), limits)
    with LiveServer(scheduler) as srv, httpx.Client(base_url=srv.base_url, timeout=30) as http:
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = http.post(CHAT, json=OK)
        _assert_error(r, 503, "model_loading")
        assert r.headers["Retry-After"]
        gate.set()
        while health(http)["status"] != "ok":
            time.sleep(0.01)
        with http.stream("POST", CHAT, json={**LONG_CHAT, "stream": True}) as first:
            # Keep the line iterator referenced: a collected one closes the connection (and the job).
            lines = first.iter_lines()
            next(line for line in lines if '"content": "' in line and '"role"' not in line)
            with http.stream("POST", CHAT, json={**LONG_CHAT, "stream": True}):  # waits for the slot
                assert srv.scheduler.stats().queued_by_class["normal"] == 1
                r = http.post(CHAT, json=OK)
                _assert_error(r, 429, "queue_full")
                assert int(r.headers["Retry-After"]) >= 1
        queue = wait_idle(http, 5)
        assert queue["active"] == 0 and sum(queue["queued_by_class"].values()) == 0


def test_engine_failure_mid_stream_is_a_final_error_event(checkpoint, monkeypatch):
    loaded = Engine.load(checkpoint)
    real_open = loaded.open

    def failing_open(request):
        generation = real_open(request)
        real_step, steps = generation.step, [0]

        def step():
            steps[0] += 1
            if steps[0] > 3:
                raise RuntimeError("simulated device failure")
            return real_step()

        generation.step = step
        return generation

    monkeypatch.setattr(loaded, "open", failing_open)
    with LiveServer(Scheduler(lambda: loaded)) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
        while srv.scheduler.state == "loading":
            time.sleep(0.01)
        stream = client.chat.completions.create(model="mimo", messages=HI, max_tokens=50, stream=True)
        with pytest.raises(openai.APIError, match="simulated device failure"):
            for _ in stream:
                pass
        with pytest.raises(openai.InternalServerError, match="simulated device failure"):
            client.chat.completions.create(model="mimo", messages=HI, max_tokens=50)
        monkeypatch.setattr(loaded, "open", real_open)
        assert client.chat.completions.create(model="mimo", messages=HI, max_tokens=3).usage.completion_tokens == 3


def test_failed_model_answers_503(checkpoint):
    def broken():
        raise RuntimeError("weights are corrupt")

    with LiveServer(Scheduler(broken)) as srv, httpx.Client(base_url=srv.base_url, timeout=10) as http:
        while health(http)["status"] == "loading":
            time.sleep(0.01)
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert "weights are corrupt" in r.json()["error"]
        _assert_error(http.post(CHAT, json=OK), 503, "model_failed")
        _assert_error(http.post(EMBEDDINGS, json={"input": "a"}), 503, "model_failed")
