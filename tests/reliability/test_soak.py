"""The soak: 32 clients at once against one real daemon, mixing every protocol.

Clients (four of each kind), each in a loop until the time is up: OpenAI chat streamed
and whole, OpenAI completions streamed and dropped after two chunks (a disconnect),
Anthropic messages, embeddings, MCP `generate` over Streamable HTTP (every third call
cancelled mid-way), LSP inline completions through `mtplxd lsp` (every third one
cancelled by the next keystroke's edit and a `$/cancelRequest`), and raw HTTP
completions abandoned before the reply (a client that goes away).

Asserted: no 5xx and no unexpected error on any protocol, no client waiting beyond
OP_TIMEOUT_S on any call (a hung client), the queue empty afterwards, the same greedy
answer before and after, and MLX memory flat apart from the session bank's own
growth, which /metrics reports. `make test` runs it for 10 seconds;
`make test-reliability` for 90, or SOAK seconds (`--soak-seconds`).

The memory curve. Every SAMPLE_S seconds a sampler reads the daemon's resident memory
(/proc) and the bank's RAM tier (/metrics); the soak prints the curve and, from
SETTLE_MIN_S seconds on, asserts that it settles: RSS less the bank's RAM grows by under
SETTLE_GROWTH over the soak's last half (a leak grows steadily; the bank is bounded and
reported on its own). Shorter soaks are mostly warm-up: their curve is printed only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import anthropic
import anyio
import httpx
import httpx2
import openai
import pytest
from lsprotocol import types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from prometheus_client.parser import text_string_to_metric_families
from pygls.lsp.client import LanguageClient

from tests.checkpoints import write
from tests.daemon_fixture import mtplxd_command, running_daemon

KEY = "sk-soak"
OP_TIMEOUT_S = 60.0  # any one call; beyond it the client counts as hung
CLIENTS_PER_KIND = 4
GREEDY = {"model": "default", "prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0}
MEMORY_SLACK = 32 * 2**20  # MLX's allocator keeps a few buffers of the busiest moment
# Between an editor's requests (a user reading a suggestion, typing on). Back to back,
# four editors' interactive requests hold the engine and every normal-class call waits
# (the scheduler's classes are strict priorities): 0.2 s pauses left chat calls ~12 s.
TYPING_PAUSE_S = 1.0
RSS_SLACK = 64 * 2**20  # the heap's high-water mark of 32 clients at once (10 MiB seen in 30 s)
SAMPLE_S = 2.0
SETTLE_MIN_S = 60.0
SETTLE_GROWTH = 0.05
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    checkpoint = write("mimo", tmp_path_factory.mktemp("ck") / "mimo", mtp_heads=1)
    workspace = tmp_path_factory.mktemp("ws")
    (workspace / "mod.py").write_text("def add(a, b):\n    return a + b\n")
    env = {"MTPLXD_WORKSPACES": str(workspace)}
    with running_daemon(tmp_path_factory.mktemp("state"), checkpoint, "--api-key", KEY, env=env) as info:
        yield info, workspace


class Tally:
    def __init__(self) -> None:
        self.ops: Counter = Counter()
        self.errors: list[str] = []
        self.seconds: dict[str, list[float]] = {}

    @contextlib.asynccontextmanager
    async def op(self, kind: str):
        started = time.monotonic()
        try:
            async with asyncio.timeout(OP_TIMEOUT_S):
                yield
            self.ops[kind] += 1
        except TimeoutError:
            self.errors.append(f"{kind}: hung for {OP_TIMEOUT_S:.0f} s")
        except Exception as e:  # every failure is counted, none ends the soak
            self.errors.append(f"{kind}: {type(e).__name__}: {e}"[:300])
        finally:
            self.seconds.setdefault(kind, []).append(time.monotonic() - started)

    def latency(self) -> dict:
        """Median and slowest call of each kind, in seconds."""
        return {kind: [round(statistics.median(t), 2), round(max(t), 2)] for kind, t in sorted(self.seconds.items())}


async def repeat(deadline: float, tally: Tally, kind: str, call) -> None:
    """One client's loop: `call` again and again until the time is up, each call tallied."""
    while time.monotonic() < deadline:
        async with tally.op(kind):
            await call()


def openai_client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=OP_TIMEOUT_S)


async def chat_client(base: str, deadline: float, tally: Tally, stream: bool) -> None:
    messages = [{"role": "user", "content": "write a function"}]
    async with openai_client(base) as client:
        async def call() -> None:
            if stream:
                chunks = await client.chat.completions.create(model="default", messages=messages, max_tokens=12,
                                                              stream=True)
                assert [c async for c in chunks]
            else:
                r = await client.chat.completions.create(model="default", messages=messages, max_tokens=12)
                assert r.usage.completion_tokens > 0

        await repeat(deadline, tally, "chat stream" if stream else "chat", call)


async def dropped_stream_client(base: str, deadline: float, tally: Tally) -> None:
    async with openai_client(base) as client:
        async def call() -> None:
            stream = await client.completions.create(model="default", prompt="import os\n", max_tokens=200,
                                                     stream=True)
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.close()  # the client leaves: the daemon must free the engine

        await repeat(deadline, tally, "completion dropped mid-stream", call)


async def anthropic_client(base: str, deadline: float, tally: Tally) -> None:
    async with anthropic.AsyncAnthropic(base_url=base, api_key=KEY, max_retries=0, timeout=OP_TIMEOUT_S) as client:
        async def call() -> None:
            r = await client.messages.create(model="default", max_tokens=12,
                                             messages=[{"role": "user", "content": "hello"}])
            assert r.usage.output_tokens > 0

        await repeat(deadline, tally, "anthropic", call)


async def embeddings_client(base: str, deadline: float, tally: Tally) -> None:
    async with openai_client(base) as client:
        async def call() -> None:
            r = await client.embeddings.create(model="default", input=["def f(): pass", "x = 1"])
            assert len(r.data) == 2

        await repeat(deadline, tally, "embeddings", call)


async def abandoning_client(base: str, deadline: float, tally: Tally) -> None:
    """A raw HTTP client that hangs up before a non-streamed reply comes."""
    while time.monotonic() < deadline:
        async with tally.op("completion abandoned"):
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {KEY}"}) as h:
                with contextlib.suppress(httpx.ReadTimeout):  # gone before the reply: what is tested
                    r = await h.post("/v1/completions", json={**GREEDY, "max_tokens": 300},
                                     timeout=httpx.Timeout(OP_TIMEOUT_S, read=0.05))
                    assert r.status_code < 500, r.text


async def mcp_client(base: str, deadline: float, tally: Tally) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=OP_TIMEOUT_S),
                                  trust_env=False) as h:
        async with Client(streamable_http_client(base + "/mcp", http_client=h), mode="legacy") as session:
            n = 0
            while time.monotonic() < deadline:
                n += 1
                if n % 3 == 0:  # cancelled mid-way: the SDK sends notifications/cancelled
                    async with tally.op("mcp cancelled"):
                        with anyio.move_on_after(0.05):
                            await session.call_tool("generate", {"prompt": "hi", "max_tokens": 500})
                    continue
                async with tally.op("mcp generate"):
                    result = await session.call_tool("generate", {"prompt": "def f(x):", "max_tokens": 12})
                    assert not result.is_error, result.content


async def lsp_client(state_dir: Path, workspace: Path, deadline: float, tally: Tally) -> None:
    client = LanguageClient("soak", "1")
    await client.start_io(*mtplxd_command(), "lsp", "--state-dir", str(state_dir))
    try:
        await asyncio.wait_for(client.initialize_async(types.InitializeParams(
            capabilities=types.ClientCapabilities(text_document=types.TextDocumentClientCapabilities(
                synchronization=types.TextDocumentSyncClientCapabilities(),
                inline_completion=types.InlineCompletionClientCapabilities())),
            root_uri=workspace.as_uri(),
            workspace_folders=[types.WorkspaceFolder(workspace.as_uri(), workspace.name)])), OP_TIMEOUT_S)
        client.initialized(types.InitializedParams())
        uri = (workspace / "mod.py").as_uri()
        client.text_document_did_open(types.DidOpenTextDocumentParams(
            types.TextDocumentItem(uri, "python", 0, "")))
        n = 0
        while time.monotonic() < deadline:
            n += 1
            # A new line each time, so that the model generates (the type-ahead cache would
            # answer a repeated position at once).
            text = f"def add(a, b):\n    return a + b\n\ndef f{id(client) % 997}_{n}(x):\n    "
            client.text_document_did_change(types.DidChangeTextDocumentParams(
                types.VersionedTextDocumentIdentifier(version=n, uri=uri),
                [types.TextDocumentContentChangeWholeDocument(text=text)]))
            params = types.InlineCompletionParams(
                context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
                text_document=types.TextDocumentIdentifier(uri), position=types.Position(4, 4))
            msg_id = f"soak-{id(client)}-{n}"
            future = client.protocol.send_request_async(types.TEXT_DOCUMENT_INLINE_COMPLETION, params, msg_id=msg_id)
            if n % 3 == 0:  # the next keystroke comes at once: the request is cancelled
                client.protocol.notify("$/cancelRequest", types.CancelParams(id=msg_id))
                async with tally.op("lsp cancelled"):
                    with contextlib.suppress(Exception):  # cancelled (-32800) or answered first: both fine
                        await future
                continue
            async with tally.op("lsp inline"):
                await future
            await asyncio.sleep(TYPING_PAUSE_S)
        await asyncio.wait_for(client.shutdown_async(None), 10)
        client.exit(None)
    finally:
        if client._server is not None and client._server.returncode is None:
            client._server.kill()
        await client.stop()


def greedy_answer(base: str) -> str:
    r = httpx.post(base + "/v1/completions", json=GREEDY, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def rss_bytes(pid: int) -> int | None:
    """The daemon's resident memory where /proc tells it (Linux), else None."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def figures(base: str) -> dict:
    health = httpx.get(base + "/health", timeout=10).json()
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    metrics = {f.name: f.samples for f in text_string_to_metric_families(text)}
    bank = bank_ram(text)
    status = Counter()  # by class, and by endpoint; /health's 503s while loading are its answer
    for s in metrics.get("mtplxd_requests", []):
        if s.name.endswith("_total") and s.labels["endpoint"] != "/health":
            status[s.labels["status"][0] + "xx"] += s.value
            status[f"{s.labels['endpoint']} {s.labels['status']}"] += s.value
    return {"active": health["memory"]["active_bytes"], "bank_ram": bank, "queue": health["queue"],
            "http_status": dict(status)}


class MemoryCurve:
    """(seconds since the start, RSS, bank RAM bytes) every SAMPLE_S seconds while the soak runs."""

    def __init__(self) -> None:
        self.points: list[tuple[float, int, int]] = []

    async def sample(self, base: str, pid: int, deadline: float) -> None:
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as h:
            while time.monotonic() < deadline:
                rss = rss_bytes(pid)
                if rss is None:
                    return  # no /proc: no curve
                text = (await h.get("/metrics")).text
                self.points.append((time.monotonic() - started, rss, bank_ram(text)))
                await asyncio.sleep(SAMPLE_S)

    def less_bank(self, start: float, end: float) -> float:
        """Median RSS less the bank's RAM over the samples from `start` to `end` seconds."""
        window = [rss - bank for t, rss, bank in self.points if start <= t <= end]
        return statistics.median(window) if window else 0.0

    def settle(self, seconds: float) -> dict:
        """RSS less bank at the start, the middle and the end (medians of short windows,
        a tenth of the soak each: one sample is noisy), and the growth over the last half."""
        tenth = max(seconds / 10, 2 * SAMPLE_S)  # a short soak: still a sample or two a window
        start, middle = self.less_bank(0, tenth), self.less_bank(seconds / 2 - tenth / 2, seconds / 2 + tenth / 2)
        end = self.less_bank(seconds - tenth, seconds)
        step = -(-len(self.points) // 30) or 1  # at most 30 points of the curve in the figures
        mib = lambda b: round(b / 2**20, 1)  # noqa: E731
        return {"rss_less_bank_mib": [mib(start), mib(middle), mib(end)],
                "bank_ram_mib": [mib(self.points[0][2]), mib(self.points[-1][2])] if self.points else [],
                "growth_last_half": round((end - middle) / middle, 4) if middle > 0 else None,
                "curve_mib": [[round(t), mib(rss), mib(bank)] for t, rss, bank in self.points[::step]]}


def bank_ram(metrics_text: str) -> int:
    return int(sum(s.value for f in text_string_to_metric_families(metrics_text) if f.name == "mtplxd_session_bytes"
                   for s in f.samples if s.labels.get("tier") == "ram"))


async def test_soak(daemon, request):
    info, workspace = daemon
    seconds = request.config.getoption("--soak-seconds")
    base = info.base_url
    answer = greedy_answer(base)
    before, rss_before = figures(base), rss_bytes(info.process.pid)
    tally = Tally()
    deadline = time.monotonic() + seconds
    kinds = [
        lambda: chat_client(base, deadline, tally, stream=True),
        lambda: chat_client(base, deadline, tally, stream=False),
        lambda: dropped_stream_client(base, deadline, tally),
        lambda: anthropic_client(base, deadline, tally),
        lambda: embeddings_client(base, deadline, tally),
        lambda: mcp_client(base, deadline, tally),
        lambda: lsp_client(info.state_dir, workspace, deadline, tally),
        lambda: abandoning_client(base, deadline, tally),
    ]
    started, curve = time.monotonic(), MemoryCurve()
    await asyncio.gather(curve.sample(base, info.process.pid, deadline),
                         *(kind() for kind in kinds for _ in range(CLIENTS_PER_KIND)))
    elapsed = time.monotonic() - started
    after, rss_after = await _settled(base), rss_bytes(info.process.pid)
    report = {"clients": len(kinds) * CLIENTS_PER_KIND, "seconds": round(elapsed, 1), "ops": dict(tally.ops),
              "errors": len(tally.errors), "median_and_slowest_s": tally.latency(),
              "http_status_before": before["http_status"], "http_status_after": after["http_status"],
              "mlx_active_growth_mib": round((after["active"] - before["active"]) / 2**20, 1),
              "bank_ram_growth_mib": round((after["bank_ram"] - before["bank_ram"]) / 2**20, 1),
              "rss_growth_mib": round((rss_after - rss_before) / 2**20, 1) if rss_before else None,
              "memory": curve.settle(seconds)}
    print("soak figures:", json.dumps(report))
    assert not tally.errors, Counter(e.split(":")[0] for e in tally.errors).most_common() + tally.errors[:5]
    assert sum(tally.ops.values()) >= len(kinds) * CLIENTS_PER_KIND  # every client got through a call
    assert after["http_status"].get("5xx", 0) == before["http_status"].get("5xx", 0) == 0
    assert greedy_answer(base) == answer
    bank_growth = after["bank_ram"] - before["bank_ram"]
    assert after["active"] - before["active"] <= bank_growth + MEMORY_SLACK
    if rss_before is not None:  # thousands of calls: a leak of even 20 KB a call would show
        assert rss_after - rss_before <= bank_growth + RSS_SLACK, report
    growth = report["memory"]["growth_last_half"]
    if seconds >= SETTLE_MIN_S and growth is not None:  # a leak grows on; warm-up is over by half-time
        assert growth < SETTLE_GROWTH, report["memory"]


async def _settled(base: str, timeout: float = 30.0) -> dict:
    """Figures once every job has left the queue (a cancelled one leaves within a step)."""
    end = time.monotonic() + timeout
    while True:
        now = figures(base)
        queue = now["queue"]
        if not queue["active"] and not any(queue["queued_by_class"].values()):
            return now
        assert time.monotonic() < end, f"the queue did not empty: {queue}"
        await asyncio.sleep(0.1)
