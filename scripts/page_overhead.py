"""Does an open page slow decoding? Aggregate tok/s with and without the page open.

    .venv/bin/python scripts/page_overhead.py [--rounds 4] [--streams 4] [--tokens 200]

Starts a daemon on the embedded toy model (two MTP heads), then alternates: a load of
`--streams` concurrent streamed chats of `--tokens` tokens each (greedy, ignore_eos),
once with no page open and once with the page open in headless Chromium (its status
stream, plots and tables updating every second), for `--rounds` rounds of each side.
Prints each round's aggregate tok/s and the two medians (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.daemon_fixture import running_daemon  # noqa: E402
from tests.test_page import CHROMIUM, OFFLINE_FLAGS  # noqa: E402


def load(url: str, streams: int, tokens: int) -> float:
    """Aggregate tok/s of `streams` concurrent streamed chats."""
    body = {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    counts = [0] * streams

    def one(i: int) -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if '"usage"' in line or line.startswith("data: [DONE]"):
                    continue
            counts[i] = tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with running_daemon(Path(tempfile.mkdtemp()) / "state", None) as daemon, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=OFFLINE_FLAGS)
        load(daemon.base_url, args.streams, 20)  # warm-up
        sides: dict[str, list[float]] = {"without page": [], "with page": []}
        for _ in range(args.rounds):
            sides["without page"].append(load(daemon.base_url, args.streams, args.tokens))
            page = browser.new_page()
            page.goto(daemon.base_url + "/")
            page.wait_for_function("() => document.getElementById('conn').dataset.state === 'up'")
            sides["with page"].append(load(daemon.base_url, args.streams, args.tokens))
            page.close()
        browser.close()
    for side, rates in sides.items():
        print(f"{side:>13}: median {statistics.median(rates):6.1f} tok/s  rounds "
              + " ".join(f"{r:.1f}" for r in rates))
    without, with_page = (statistics.median(r) for r in sides.values())
    print(f"with the page open: {100 * (with_page / without - 1):+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
