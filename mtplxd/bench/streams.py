"""`mtplxd bench --streams 1,4,8`: what concurrency buys, with batching on and off.

Two daemons on the same model, started as users start them: one as configured
(continuous batching, engine/batch.py), one with `batch_rows = 1` (every generation
steps alone). For each stream count N, in alternating order (A B, then B A), N
concurrent streamed completions of `max_tokens` tokens (T=0.6, ignore_eos) go
through the real HTTP API. Reported per side and N:
- aggregate tok/s: completion tokens (from `usage`) / wall time of the round;
- per-stream inter-token latency p50/p95: each stream's decode time / (tokens - 1);
- time to first token p50/p95;
the MTP depth the daemon decodes with per batch size (its calibration, which the
run waits for); and, per side, an editor-sized interactive completion (32 tokens, the interactive
class): its whole latency, request to last token, idle and behind 8 normal streams.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from mtplxd.bench.serve import StreamTiming, busy_streams, percentiles, scratch_daemon, stream_completion

SIDES: dict[str, dict[str, int]] = {"batched": {}, "alone": {"batch_rows": 1}}


@dataclass
class StreamsFigures:
    streams: int
    tok_s: float
    itl_ms: dict[str, float]
    ttft_ms: dict[str, float]


def one_round(base_url: str, streams: int, max_tokens: int) -> tuple[float, list[StreamTiming]]:
    """N concurrent streams; (aggregate tok/s, each stream's timing)."""
    timings: list[StreamTiming] = []
    lock = threading.Lock()

    def stream() -> None:
        with httpx.Client(base_url=base_url, timeout=600) as client:
            timing = stream_completion(client, "normal", max_tokens)
        with lock:
            timings.append(timing)

    threads = [threading.Thread(target=stream) for _ in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return sum(t.completion_tokens for t in timings) / wall, timings


def calibrated(base_url: str, timeout_s: float = 600) -> dict[str, int]:
    """Wait for the daemon's background calibration (it decides the depth per batch
    size); the depth it chose per batch size."""
    deadline = time.monotonic() + timeout_s
    while True:
        decoding = httpx.get(f"{base_url}/health", timeout=30).json().get("decoding") or {}
        if decoding.get("calibrated") or time.monotonic() > deadline:
            return decoding.get("batched_depth") or {}
        time.sleep(0.5)


def interactive_latency(base_url: str, background: int, n: int = 12) -> dict[str, float]:
    """p50/p95 ms of 32-token interactive completions, behind `background` normal streams."""
    with busy_streams(base_url, background), httpx.Client(base_url=base_url, timeout=600) as client:
        stream_completion(client, "interactive", 32)
        latencies = []
        for _ in range(n):
            timing = stream_completion(client, "interactive", 32)
            latencies.append((timing.ttft_s + timing.decode_s) * 1000)
    return percentiles(latencies)


def _figures(streams: int, rates: list[float], timings: list[StreamTiming]) -> StreamsFigures:
    itl = [t.decode_s / (t.completion_tokens - 1) * 1000 for t in timings if t.completion_tokens > 1]
    return StreamsFigures(streams, round(statistics.median(rates), 1), percentiles(itl),
                          percentiles([t.ttft_s * 1000 for t in timings]))


def run(model: str | None, counts: list[int], rounds: int, max_tokens: int, as_json: bool) -> int:
    # One daemon's background calibration at a time: two measuring at once on a small
    # machine would time each other's load.
    with scratch_daemon(model, SIDES["batched"]) as batched_url:
        batched_depth = calibrated(batched_url)
        with scratch_daemon(model, SIDES["alone"]) as alone_url:
            calibrated(alone_url)
            return _compare({"batched": batched_url, "alone": alone_url}, batched_depth, counts, rounds,
                            max_tokens, as_json)


def _compare(urls: dict[str, str], batched_depth: dict[str, int], counts: list[int], rounds: int, max_tokens: int,
             as_json: bool) -> int:
    for url in urls.values():
        for n in counts:
            one_round(url, n, 16)  # warm-up: trace the step functions for each batch size
    rates: dict[tuple[str, int], list[float]] = {}
    timings: dict[tuple[str, int], list[StreamTiming]] = {}
    for r in range(rounds):
        for n in counts:
            for side in (("batched", "alone") if r % 2 == 0 else ("alone", "batched")):
                rate, times = one_round(urls[side], n, max_tokens)
                rates.setdefault((side, n), []).append(rate)
                timings.setdefault((side, n), []).extend(times)
    latency: dict[str, dict[str, Any]] = {}
    for side, url in urls.items():
        idle, loaded = interactive_latency(url, 0), interactive_latency(url, 8)
        latency[side] = {"idle": idle, "behind_8_streams": loaded, "p95_ratio": round(loaded["p95"] / idle["p95"], 2)}
    table = {side: [asdict(_figures(n, rates[side, n], timings[side, n])) for n in counts] for side in SIDES}
    if as_json:
        print(json.dumps({"table": table, "interactive_ms": latency, "depth_by_batch_rows": batched_depth}, indent=2))
    else:
        _print(table, latency, batched_depth, counts)
    return 0


def _print(table: dict, latency: dict[str, dict[str, Any]], batched_depth: dict[str, int], counts: list[int]) -> None:
    # x one: against one stream on the batching daemon (alone, it decodes with MTP)
    single = table["batched"][0]["tok_s"] if counts and counts[0] == 1 else None
    print(f"{'side':8} {'streams':>7} {'tok/s':>8} {'x one':>6} {'ITL p50':>8} {'ITL p95':>8} {'TTFT p50':>9} {'TTFT p95':>9}")
    for side in SIDES:
        for row in table[side]:
            ratio = f"{row['tok_s'] / single:.2f}" if single else "-"
            print(f"{side:8} {row['streams']:>7} {row['tok_s']:>8} {ratio:>6} {row['itl_ms']['p50']:>8} "
                  f"{row['itl_ms']['p95']:>8} {row['ttft_ms']['p50']:>9} {row['ttft_ms']['p95']:>9}")
    print("depth by rows in a batch (0: plain AR):", batched_depth)
    for side, figures in latency.items():
        print(f"interactive 32-token completion ({side}): idle p50 {figures['idle']['p50']} p95 "
              f"{figures['idle']['p95']} ms; behind 8 streams p50 {figures['behind_8_streams']['p50']} p95 "
              f"{figures['behind_8_streams']['p95']} ms (p95 x{figures['p95_ratio']})")
