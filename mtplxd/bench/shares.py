"""`mtplxd bench --shares`: do chats keep going while editors type?

One daemon (started for the run on a scratch state directory, as users start it), three
phases of `seconds` each, in alternating order from round to round (A B C, then C B A):
- chat: 4 chat clients, each streaming chat completions back to back (normal class);
- mixed: the same 4 chat clients, and 4 editor clients sending interactive completions
  back to back (`X-Mtplx-Priority: interactive`, non-streamed, as an editor waits for one);
- editors: the 4 editor clients alone.
Reported, against the targets of the scheduler's shares (mtplxd/shares.py):
- chat answers/s in mixed over chat alone (target >= 0.5);
- chat time to first token p99 in mixed (target <= 2 s);
- editors' latency p95 in mixed over their p95 alone (target <= 1.5).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from mtplxd.bench.serve import PROMPT, scratch_daemon
from mtplxd.bench.streams import calibrated

CHAT = [{"role": "user", "content": "Write a short function that adds two numbers."}]
PHASES = ("chat", "mixed", "editors")
CHAT_TOKENS = 48  # a short chat answer
EDITOR_TOKENS = 24  # an editor-sized completion
TARGETS = {"chat_ratio": 0.5, "chat_ttft_p99_s": 2.0, "editor_p95_ratio": 1.5}


@dataclass
class Phase:
    seconds: float = 0.0
    answers: int = 0  # chat answers finished
    chat_ttft_s: list[float] = field(default_factory=list)
    editor_s: list[float] = field(default_factory=list)  # request -> whole answer


def chat_answer(client: httpx.Client, max_tokens: int) -> float:
    """One streamed chat answer; its time to first token (s)."""
    body = {"model": "default", "messages": CHAT, "max_tokens": max_tokens, "stream": True, "temperature": 0.6,
            "ignore_eos": True}
    start = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]" and _text_of(line):
                first = time.perf_counter()
    return (first or time.perf_counter()) - start


def _text_of(line: str) -> str:
    """The text a chat chunk carries (the first chunk carries only the role)."""
    choices = json.loads(line[6:]).get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


def editor_completion(client: httpx.Client, max_tokens: int) -> float:
    """One interactive completion as an editor asks for it; its latency (s)."""
    body = {"model": "default", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True}
    start = time.perf_counter()
    r = client.post("/v1/completions", json=body, headers={"X-Mtplx-Priority": "interactive"})
    r.raise_for_status()
    return time.perf_counter() - start


def run_phase(base_url: str, phase: str, seconds: float, chat_tokens: int, editor_tokens: int) -> Phase:
    """Clients back to back for `seconds`; the rates and the editors' latencies count what
    finished before the end."""
    result = Phase(seconds)
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def loop(one: Callable[[httpx.Client], float], record: Callable[[float, bool], None]) -> None:
        with httpx.Client(base_url=base_url, timeout=600) as client:
            while time.perf_counter() < deadline:
                value = one(client)
                with lock:
                    record(value, time.perf_counter() <= deadline)

    def chat_done(ttft: float, in_time: bool) -> None:
        # Every answer sent in the phase has its first token timed (one that took longer
        # than the phase counts too); the rate counts answers done within it.
        result.answers += in_time
        result.chat_ttft_s.append(ttft)

    def editor_done(latency: float, in_time: bool) -> None:
        if in_time:
            result.editor_s.append(latency)

    threads = []
    if phase in ("chat", "mixed"):
        threads += [threading.Thread(target=loop, args=(lambda c: chat_answer(c, chat_tokens), chat_done))
                    for _ in range(4)]
    if phase in ("editors", "mixed"):
        threads += [threading.Thread(target=loop, args=(lambda c: editor_completion(c, editor_tokens), editor_done))
                    for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result


def quantile(values: list[float], q: float) -> float:
    """The q-quantile; infinite without values (no chat answer came: starved)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("inf")


def figures(phases: dict[str, Phase]) -> dict[str, float]:
    chat, mixed, editors = (phases[p] for p in PHASES)
    chat_rate, mixed_rate = chat.answers / chat.seconds, mixed.answers / mixed.seconds
    idle_p95, mixed_p95 = quantile(editors.editor_s, 0.95), quantile(mixed.editor_s, 0.95)
    return {
        "chat_answers_per_s_alone": round(chat_rate, 2),
        "chat_answers_per_s_with_editors": round(mixed_rate, 2),
        "chat_ratio": round(mixed_rate / chat_rate, 3) if chat_rate else 0.0,
        "chat_ttft_p99_s": round(quantile(mixed.chat_ttft_s, 0.99), 3),
        "chat_ttft_p99_alone_s": round(quantile(chat.chat_ttft_s, 0.99), 3),
        "editor_p95_alone_ms": round(idle_p95 * 1000, 1),
        "editor_p95_with_chats_ms": round(mixed_p95 * 1000, 1),
        "editor_p95_ratio": round(mixed_p95 / idle_p95, 3) if idle_p95 else 0.0,
        "editor_completions_alone": len(editors.editor_s),
        "editor_completions_with_chats": len(mixed.editor_s),
    }


def measure(base_url: str, rounds: int, seconds: float, chat_tokens: int, editor_tokens: int) -> dict[str, float]:
    for phase in PHASES:  # warm-up: trace the step functions for these shapes
        run_phase(base_url, phase, 2.0, chat_tokens, editor_tokens)
    total = {p: Phase() for p in PHASES}
    for r in range(rounds):
        for phase in PHASES if r % 2 == 0 else PHASES[::-1]:
            got = run_phase(base_url, phase, seconds, chat_tokens, editor_tokens)
            into = total[phase]
            into.seconds += got.seconds
            into.answers += got.answers
            into.chat_ttft_s += got.chat_ttft_s
            into.editor_s += got.editor_s
    return figures(total)


def run(model: str | None, rounds: int, seconds: float, settings: dict[str, int], as_json: bool) -> int:
    with scratch_daemon(model, settings) as base_url:
        calibrated(base_url)  # its background calibration would time itself against the clients
        result = measure(base_url, rounds, seconds, CHAT_TOKENS, EDITOR_TOKENS)
    if as_json:
        print(json.dumps({"figures": result, "targets": TARGETS, "settings": settings}, indent=2))
        return 0
    _print(result)
    return 0


def _print(f: dict[str, float]) -> None:
    def verdict(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    print(f"chat answers/s: {f['chat_answers_per_s_alone']} alone, {f['chat_answers_per_s_with_editors']} with "
          f"4 editors: x{f['chat_ratio']} (target >= {TARGETS['chat_ratio']}: "
          f"{verdict(f['chat_ratio'] >= TARGETS['chat_ratio'])})")
    print(f"chat time to first token p99 with editors: {f['chat_ttft_p99_s']} s (alone {f['chat_ttft_p99_alone_s']} s;"
          f" target <= {TARGETS['chat_ttft_p99_s']}: {verdict(f['chat_ttft_p99_s'] <= TARGETS['chat_ttft_p99_s'])})")
    print(f"editor completion p95: {f['editor_p95_alone_ms']} ms alone, {f['editor_p95_with_chats_ms']} ms with 4 "
          f"chats: x{f['editor_p95_ratio']} (target <= {TARGETS['editor_p95_ratio']}: "
          f"{verdict(f['editor_p95_ratio'] <= TARGETS['editor_p95_ratio'])}); "
          f"{f['editor_completions_alone']} and {f['editor_completions_with_chats']} completions")
