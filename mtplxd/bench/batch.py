"""What a batch buys the engine alone, without HTTP or the scheduler.

B generations of `--max-tokens` tokens decode in one `DecodeBatch` (engine/batch.py),
plainly (AR) and with MTP at each depth, against one lone generation decoding with
MTP at its best depth (what one stream gets). Every configuration runs in each of
`--rounds` rounds, in turn, so a drift of the machine's speed hits all alike; the
median per configuration is reported, in tokens per second of all rows together,
and as a multiple of the lone generation. Usage:

    python -m mtplxd.bench.batch [--model PATH or NAME] [--rows 1,2,4,8,16] [--depths 1,2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine import EMBEDDED_MODEL
from engine.batch import DecodeBatch
from engine.engine import Engine
from engine.generation import GenerationRequest
from engine.profiles import BATCH_TEMPERATURE, MEASURED_SAMPLERS
from mtplxd.bench import model_folder

PROMPT = "def fibonacci(n):\n    "


def lone(engine: Engine, prompt: tuple[int, ...], depth: int, max_tokens: int) -> float:
    """tok/s of one generation decoding alone (MTP at `depth`)."""
    generation = engine.open(_request(prompt, depth, max_tokens, seed=0))
    generation.step()  # the prompt and the first token
    started, tokens = time.perf_counter(), 0
    while not generation.finished:
        tokens += len(generation.step().tokens)
    return tokens / (time.perf_counter() - started)


def batched(engine: Engine, prompt: tuple[int, ...], rows: int, depth: int, max_tokens: int) -> float:
    """tok/s of `rows` generations decoding in one batch (depth 0: AR)."""
    batch = DecodeBatch(engine.backend, depth)
    for seed in range(rows):
        generation = engine.open(_request(prompt + (seed,), depth, max_tokens, seed))
        generation.step()
        batch.join(generation)
    started, tokens = time.perf_counter(), 0
    while len(batch):
        tokens += sum(len(result.tokens) for result in batch.step())
        for generation in [g for g in batch.rows if g.finished]:
            batch.leave(generation)
    return tokens / (time.perf_counter() - started)


def _request(prompt: tuple[int, ...], depth: int, max_tokens: int, seed: int) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, sampler=MEASURED_SAMPLERS[BATCH_TEMPERATURE], mode="mtp" if depth else "ar",
                             depth=max(depth, 1), max_tokens=max_tokens, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(EMBEDDED_MODEL), type=model_folder)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--depths", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    engine = Engine.load(args.model)
    prompt = tuple(engine.tokenizer.encode(PROMPT))
    rows = [int(r) for r in args.rows.split(",")]
    depths = [0, *(int(d) for d in args.depths.split(","))] if engine.backend.n_heads else [0]
    runs = [("lone", 0, d) for d in depths if d] + [("batch", r, d) for r in rows for d in depths]
    for run in runs:  # warm-up: every shape traced once
        _measure(engine, prompt, run, 16)
    speeds: dict[tuple, list[float]] = {run: [] for run in runs}
    for _ in range(args.rounds):
        for run in runs:
            speeds[run].append(_measure(engine, prompt, run, args.max_tokens))
    median = {run: statistics.median(s) for run, s in speeds.items()}
    best_lone = max((v for (kind, _, _), v in median.items() if kind == "lone"), default=0.0) or median[runs[0]]
    print(f"lone generation, best MTP depth: {best_lone:.0f} tok/s (T={BATCH_TEMPERATURE[1:]})")
    print(f"{'rows':>5} " + " ".join(f"{'AR' if d == 0 else f'MTP d={d}':>16}" for d in depths))
    for r in rows:
        cells = [f"{median['batch', r, d]:7.0f} (x{median['batch', r, d] / best_lone:4.2f})" for d in depths]
        print(f"{r:>5} " + " ".join(f"{c:>16}" for c in cells))


def _measure(engine: Engine, prompt: tuple[int, ...], run: tuple, max_tokens: int) -> float:
    kind, rows, depth = run
    return lone(engine, prompt, depth, max_tokens) if kind == "lone" else batched(engine, prompt, rows, depth,
                                                                                 max_tokens)


if __name__ == "__main__":
    main()
