"""Does the draft vocabulary pay? MTP with the heads scoring the whole LM head against
MTP with them scoring only the draft vocabulary's rows, and AR, side by side.

    .venv/bin/python scripts/draft_vocab_bench.py [--model SmolLM2-135M-Instruct] [--rounds 2]

First the cost of one drafted token (head 0, one position; the two sides interleaved),
then `mtplxd bench`'s runs (held-out code prompts, 64 tokens, T=0 and T=0.6) for AR and
MTP at depths 1 and 2 with either LM head, the order rotated per prompt so that a busy
machine slows every side alike. Prints tokens/s (tokens over decoding time), tokens per
cycle and acceptance per depth (docs/performance.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import engine  # noqa: E402,F401  (BLAS before mlx)
import mlx.core as mx  # noqa: E402

from engine.engine import Engine  # noqa: E402
from engine.profiles import MEASURED_SAMPLERS  # noqa: E402
from mtplxd.bench.decode import Config, Tally, run_once  # noqa: E402
from mtplxd.calibrate import held_out_prompts  # noqa: E402
from mtplxd.config import load_settings  # noqa: E402


def draft_token_ms(engine_: Engine, reps: int = 100) -> dict[str, float]:
    backend, draft = engine_.backend, engine_.backend.draft_vocab
    hidden = mx.random.normal((1, 1, backend.trunk.args.hidden_size), key=mx.random.key(0))
    token = mx.array([[42]])
    times: dict[str, list[float]] = {"full": [], "draft": []}
    for i in range(reps + 10):
        sides = [("full", None), ("draft", draft)]
        for name, vocab in sides if i % 2 else sides[::-1]:
            backend.draft_vocab = vocab
            start = time.perf_counter()
            mx.eval(*backend.head(0, hidden, token, backend.make_head_caches()[0], last=True))
            if i >= 10:  # the first calls compile
                times[name].append(time.perf_counter() - start)
    backend.draft_vocab = draft
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def decode(engine_: Engine, rounds: int) -> dict[tuple, Tally]:
    backend, draft = engine_.backend, engine_.backend.draft_vocab
    prompts = [tuple(engine_.tokenizer.encode(p)) for p in held_out_prompts(4)]
    sides = [("ar", 0, None), ("mtp", 1, None), ("mtp", 1, draft), ("mtp", 2, None), ("mtp", 2, draft)]
    tallies: dict[tuple, Tally] = {}
    for r in range(rounds):
        for temperature in MEASURED_SAMPLERS:
            for j, ids in enumerate(prompts):
                turn = (r + j) % len(sides)
                for mode, depth, vocab in sides[turn:] + sides[:turn]:
                    backend.draft_vocab = vocab
                    key = (temperature, mode, depth, "draft" if vocab else "full")
                    run_once(engine_, ids, Config(mode, depth, temperature), 64, tallies.setdefault(key, Tally()))
    backend.draft_vocab = draft
    return tallies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    engine_ = Engine.load(load_settings({"model": args.model}).model_path)  # a path, or a models-folder name
    if engine_.backend.draft_vocab is None:
        print(f"{args.model}: its heads have no draft vocabulary", file=sys.stderr)
        return 2
    print("ms a drafted token (median):", {k: round(v, 2) for k, v in draft_token_ms(engine_).items()})
    for (temperature, mode, depth, lm_head), t in sorted(decode(engine_, args.rounds).items()):
        acceptance = [round(a / n, 3) for a, n in zip(t.accepted, t.reached) if n][:depth]
        print(f"T={MEASURED_SAMPLERS[temperature].temperature} {mode} depth {depth} {lm_head if depth else '':5} "
              f"{t.decoded / t.seconds:6.1f} tok/s  {t.decoded / max(t.cycles, 1):.2f} tokens/cycle  "
              f"acceptance {acceptance}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
