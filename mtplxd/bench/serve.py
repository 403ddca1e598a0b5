"""`mtplxd bench --serve`: does a keystroke completion wait behind agents?

Against a daemon (a running one, or one started for the run on a scratch
state directory), in one run:
  1. time to first token of interactive-class completions alone (idle);
  2. the same while 4 normal-class streams generate (loaded);
  3. decode tok/s of one stream over HTTP against the engine's own tok/s
     (the `Done` figure the daemon reports), i.e. the HTTP overhead.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

PROMPT = "def fibonacci(n):\n    "


@dataclass
class ServeBench:
    idle_ttft_ms: dict[str, float]
    loaded_ttft_ms: dict[str, float]
    p95_ratio: float
    http_tok_s: float
    engine_tok_s: float
    http_overhead: float


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 1), "p95": round(p95, 1)}


@dataclass
class StreamTiming:
    ttft_s: float  # request sent -> first text
    decode_s: float  # first text -> last text
    completion_tokens: int
    engine_decode_tok_s: float  # the daemon's own figure for the same stream


def stream_completion(client: httpx.Client, priority: str, max_tokens: int) -> StreamTiming:
    """One streamed completion, timed as the client sees it."""
    body = {"model": "default", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.6, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    first = last = None
    final: dict = {}
    with client.stream("POST", "/v1/completions", json=body, headers={"X-Mtplx-Priority": priority}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                final = chunk
    first = first or time.perf_counter()
    return StreamTiming(
        ttft_s=first - start,
        decode_s=(last or first) - first,
        completion_tokens=final.get("usage", {}).get("completion_tokens", 0),
        engine_decode_tok_s=float(final.get("timings", {}).get("decode_tokens_per_s") or 0.0),
    )


def ttft_series(client: httpx.Client, n: int) -> list[float]:
    return [stream_completion(client, "interactive", 8).ttft_s * 1000 for _ in range(n)]


def run_bench(base_url: str, n: int = 20, background_streams: int = 4) -> ServeBench:
    """Interactive TTFT idle and behind `background_streams` normal streams; HTTP overhead."""
    with httpx.Client(base_url=base_url, timeout=600) as client:
        ttft_series(client, 2)  # warm-up
        idle = ttft_series(client, n)
        with busy_streams(base_url, background_streams):
            loaded = ttft_series(client, n)
        alone = stream_completion(client, "normal", 256)
    http_tok_s = (alone.completion_tokens - 1) / alone.decode_s if alone.decode_s else 0.0
    engine_tok_s = alone.engine_decode_tok_s
    idle_p, loaded_p = percentiles(idle), percentiles(loaded)
    return ServeBench(
        idle_ttft_ms=idle_p,
        loaded_ttft_ms=loaded_p,
        p95_ratio=round(loaded_p["p95"] / idle_p["p95"], 2),
        http_tok_s=round(http_tok_s, 1),
        engine_tok_s=round(engine_tok_s, 1),
        http_overhead=round(engine_tok_s / http_tok_s, 3) if http_tok_s else 0.0,
    )


@contextmanager
def busy_streams(base_url: str, count: int) -> Iterator[None]:
    """`count` normal-priority streams of 256 tokens, one after another each, until the
    block ends (after a second to get going)."""
    stop = threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=base_url, timeout=600) as client:
            while not stop.is_set():
                stream_completion(client, "normal", 256)

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    time.sleep(1.0 if count else 0.0)
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


@contextmanager
def scratch_daemon(model: str | None, settings: dict[str, int] | None = None):
    """A daemon started as users start it, on a scratch state directory, with more
    `settings` in its config file (`{"batch_rows": 1}`)."""
    from mtplxd.client import read_address

    with tempfile.TemporaryDirectory() as state:
        lines = [f"{key} = {value}" for key, value in (settings or {}).items()]
        (Path(state) / "config.toml").write_text("\n".join(lines) + "\n")
        cmd = [sys.executable, "-m", "mtplxd", "start", "--detach", "--port", "0", "--state-dir", state]
        if model:
            cmd += ["--model", model]
        subprocess.run(cmd, check=True)
        try:
            address = read_address(Path(state))
            if address is None:  # `start --detach` returned: the daemon should be listening
                raise RuntimeError(f"the daemon in {state} published no address")
            host, port = address
            yield f"http://{host}:{port}"
        finally:
            subprocess.run([sys.executable, "-m", "mtplxd", "stop", "--state-dir", state], check=False)


def run(model: str | None, n: int, as_json: bool) -> int:
    with scratch_daemon(model) as base_url:
        result = run_bench(base_url, n)
    if as_json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print(f"interactive TTFT idle   p50 {result.idle_ttft_ms['p50']} ms  p95 {result.idle_ttft_ms['p95']} ms")
        print(f"interactive TTFT loaded p50 {result.loaded_ttft_ms['p50']} ms  p95 {result.loaded_ttft_ms['p95']} ms"
              f"  (4 normal streams; p95 ratio {result.p95_ratio}, target <= 1.5)")
        print(f"decode over HTTP {result.http_tok_s} tok/s, engine {result.engine_tok_s} tok/s"
              f" (overhead x{result.http_overhead})")
    return 0
