"""`mtplxd bench --ranks 1,2`: decode speed per world size, AR and MTP side by side.

One daemon per world size on the same model, started as users start them
(`ranks = N` in the config file: N processes on this machine, the model split over
them, mtplxd/ranks/). All of them run at once but only one is measured at a time;
each round measures every (world size, mode) once, in alternating order (A B, then
B A). A measurement is one completion of `max_tokens` tokens at T=0.6 (ignore_eos):
decode tok/s is the daemon's own figure (tokens after the first over the time after
the first), so prefill is left out. Reported per world size, medians over the
rounds: AR tok/s, MTP tok/s at `depth`, MTP/AR, and each side against one rank.

On one machine the ranks share its cores and memory bandwidth: the figures say what
the split costs here (collectives on loopback), not what two machines gain.
"""

from __future__ import annotations

import contextlib
import json
import statistics

import httpx

from mtplxd.bench.serve import PROMPT, scratch_daemon


def decode_tok_s(base_url: str, mode: str, depth: int, max_tokens: int) -> float:
    body = {"model": "default", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.6,
            "ignore_eos": True, "generation_mode": mode, "depth": depth}
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    return float(reply.json()["timings"]["decode_tokens_per_s"])


def measure(urls: dict[int, str], rounds: int, max_tokens: int, depth: int) -> dict[tuple[int, str], float]:
    sides = [(n, mode) for n in urls for mode in ("ar", "mtp")]
    for n, mode in sides:  # warm-up: compile and page in, untimed
        decode_tok_s(urls[n], mode, depth, 16)
    samples: dict[tuple[int, str], list[float]] = {side: [] for side in sides}
    for r in range(rounds):
        for n, mode in sides if r % 2 == 0 else sides[::-1]:
            samples[(n, mode)].append(decode_tok_s(urls[n], mode, depth, max_tokens))
    return {side: statistics.median(values) for side, values in samples.items()}


def table(speeds: dict[tuple[int, str], float], sizes: list[int], depth: int) -> list[dict]:
    base = min(sizes)
    rows = []
    for n in sizes:
        ar, mtp = speeds[(n, "ar")], speeds[(n, "mtp")]
        rows.append({"ranks": n, "ar_tok_s": round(ar, 1), f"mtp{depth}_tok_s": round(mtp, 1),
                     "mtp_over_ar": round(mtp / ar, 2),
                     "ar_vs_base": round(ar / speeds[(base, "ar")], 2),
                     "mtp_vs_base": round(mtp / speeds[(base, "mtp")], 2)})
    return rows


def run(model: str | None, sizes: list[int], rounds: int, max_tokens: int, depth: int, as_json: bool) -> int:
    with contextlib.ExitStack() as stack:
        urls = {n: stack.enter_context(scratch_daemon(model, {"ranks": n, "calibrate_tokens": 0})) for n in sizes}
        rows = table(measure(urls, rounds, max_tokens, depth), sizes, depth)
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    base = min(sizes)
    print(f"decode tok/s per world size ({rounds} rounds alternating, {max_tokens} tokens, T=0.6, medians)")
    print(f"{'ranks':>5}  {'AR':>8}  {'MTP' + str(depth):>8}  {'MTP/AR':>6}  {f'AR vs {base}':>9}  {f'MTP vs {base}':>10}")
    for row in rows:
        print(f"{row['ranks']:>5}  {row['ar_tok_s']:>8}  {row[f'mtp{depth}_tok_s']:>8}  {row['mtp_over_ar']:>6}  "
              f"{row['ar_vs_base']:>9}  {row['mtp_vs_base']:>10}")
    return 0
