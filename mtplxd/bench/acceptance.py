"""How often the MTP heads' drafts are accepted on held-out code, at temperature 0.

Two prompt sets from the standard-library modules no training run sees
(engine/training/corpus.py): the opening of each module's first `def` (what
`mtplxd bench` and the daemon's calibration decode), and `--lines` cuts at random
line breaks of the same modules (seeded), which reach bodies, docstrings and
class code the first set misses. Each prompt is the text before its cut, up to
CHARS characters; the engine decodes `--tokens` greedy tokens through its own
speculative loop and counts the drafts it accepts. Each rate comes with its
standard error across prompts (engine/training/measure.py): on a handful of
prompts, two sets of heads 0.02 apart are not told apart. Usage:

    python -m mtplxd.bench.acceptance [--model PATH or NAME] [--lines 64] [--depth 1] [--tokens 128]
        [--against PATH or NAME]  # a second model on the same prompts: the difference, paired
"""

from __future__ import annotations

import argparse
import json

import engine
import numpy as np

from engine.engine import Engine
from engine.training.corpus import held_out_files
from engine.training.measure import AcceptanceCounts, count_acceptance, paired_difference
from mtplxd.bench import model_folder
from mtplxd.calibrate import held_out_prompts

CHARS = 1200
MIN_CONTEXT = 200  # characters before a cut: a prompt with some code to go on


def line_prompts(n: int, seed: int = 0, chars: int = CHARS) -> list[str]:
    """`n` texts, each ending at a line break chosen at random (seeded) among every
    line break of the held-out modules with at least MIN_CONTEXT characters before it."""
    cuts = [(doc.text, end + 1) for doc in held_out_files()
            for end in range(MIN_CONTEXT, len(doc.text) - 1) if doc.text[end] == "\n"]
    if not cuts:
        return []
    picked = np.random.default_rng(seed).choice(len(cuts), size=min(n, len(cuts)), replace=False)
    return [text[max(0, end - chars):end] for text, end in (cuts[i] for i in sorted(picked))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=model_folder, default=str(engine.EMBEDDED_MODEL))
    parser.add_argument("--against", type=model_folder, help="a second model on the same prompts: the paired difference")
    parser.add_argument("--lines", type=int, default=64, help="prompts cut at random line breaks")
    parser.add_argument("--defs", type=int, default=100, help="at most this many first-`def` prompts")
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens decoded a prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    engines = [Engine.load(m) for m in (args.model, args.against) if m is not None]
    for model, engine_ in zip((args.model, args.against), engines):
        if not engine_.backend.n_heads:
            parser.error(f"{model} has no MTP heads")
    sets = {"first_defs": held_out_prompts(args.defs), "line_breaks": line_prompts(args.lines, args.seed)}
    found = {}
    for name, prompts in sets.items():
        counts = [count_acceptance(e, prompts, depth=args.depth, n_tokens=args.tokens) for e in engines]
        found[name] = {"prompts": len(prompts), **_figures(counts[0])}
        if len(counts) == 2:
            paired = paired_difference(*counts)
            found[name]["against"] = {**_figures(counts[1]),
                                      "difference_by_depth": [round(d, 3) for d, _ in paired],
                                      "difference_error_by_depth": [round(e, 3) for _, e in paired]}
    print(json.dumps({"model": args.model, "against": args.against, "tokens": args.tokens, **found}))
    return 0


def _figures(counts: AcceptanceCounts) -> dict[str, list]:
    return {"acceptance_by_depth_t0": [round(a, 3) for a in counts.rates()],
            "standard_error_by_depth": [round(e, 3) for e in counts.standard_errors()],
            "drafts_by_depth": [int(n) for n in counts.reached.sum(axis=0)]}


if __name__ == "__main__":
    raise SystemExit(main())
