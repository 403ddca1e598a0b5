"""What one speculative cycle costs, part by part, against one AR token.

`mtplxd bench` measures whole generations; this takes a cycle apart on one
model (the embedded one by default): a trunk forward of 1 and of K+1 tokens,
one draft through a head, a filtered distribution and its draw, the verify
window's K+1 filtered rows and the verification, each timed alone (median of
`--repeats`, the parts taken in turn, evaluated, after `--context` cached tokens). From those parts it
gives, per depth K, the best speedup over AR possible even if every draft
were accepted (K+1 tokens a cycle), and how many tokens a cycle must yield
for a target speedup. Timing parts alone loses the overlap of the thread
that builds a step's graph with the thread that runs it, for AR and MTP alike.
Usage:

    python -m mtplxd.bench.cycle [--model PATH or NAME] [--context 300] [--target 1.8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import engine
import mlx.core as mx

from mtplxd.bench import model_folder
from mtplxd.bench.rows import forward_step
from engine.engine import Engine
from engine.sampling import SamplerSettings, compiled_probabilities
from engine.speculative import compiled_sample, compiled_verify, verify_greedy

SAMPLED = SamplerSettings(temperature=0.6, top_p=0.95)
DEPTHS = (1, 2, 3)


def interleaved_medians(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each step, the steps taken in turn (A B C A B C ...)
    so that the machine's drift hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(repeats + 1):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if round_:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def measure_parts(engine_: Engine, context: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of each part of a cycle, keyed by name."""
    backend = engine_.backend
    vocab = backend.trunk.args.vocab_size
    prompt = mx.array([[(7 + 13 * i) % vocab for i in range(context)]])
    cache = backend.make_cache()
    logits, hidden = backend.forward(prompt, cache)
    mx.eval(logits, hidden)
    head_cache = backend.make_head_caches()[0]
    mx.eval(backend.head(0, hidden, prompt, head_cache, last=True)[0])
    filtered = compiled_probabilities(SAMPLED)
    key = mx.random.key(0)
    rows = {n: logits[0, -n:] for n in range(1, max(DEPTHS) + 2)}

    def draft():
        mx.eval(backend.head(0, hidden[:, -1:], mx.array([[5]]), head_cache, last=True)[0])
        head_cache.trim(1)

    def verify_steps(depth: int) -> dict[str, Callable[[], None]]:
        window = rows[depth + 1]
        p = filtered(window)[0][None]
        q = mx.stack([filtered(rows[1])[0]] * depth, axis=1)
        drafts = mx.zeros((1, depth), dtype=mx.int32)
        mx.eval(p, q)
        return {
            f"filter_{depth + 1}": lambda: mx.eval(filtered(window)),
            f"verify_sampled_{depth}": lambda: mx.eval(compiled_verify(p, q, drafts, key)),
            f"verify_greedy_{depth}": lambda: mx.eval(verify_greedy(window[None], drafts)),
        }

    steps = {f"forward_{n}": forward_step(backend, cache, n) for n in rows}
    steps["draft"] = draft
    steps["draw_sampled"] = lambda: mx.eval(compiled_sample(filtered(rows[1])[0], key))
    steps["draw_greedy"] = lambda: mx.eval(mx.argmax(rows[1], axis=-1))
    for depth in DEPTHS:
        steps |= verify_steps(depth)
    return interleaved_medians(steps, repeats)


def cycle_ms(parts: dict[str, float], depth: int, sampled: bool) -> float:
    """A cycle at `depth`: the window, `depth` drafts with their draws, and the
    verification (at T > 0 with the window's filtered rows)."""
    kind = "sampled" if sampled else "greedy"
    cost = parts[f"forward_{depth + 1}"] + depth * (parts["draft"] + parts[f"draw_{kind}"])
    cost += parts[f"verify_{kind}_{depth}"]
    return cost + (parts[f"filter_{depth + 1}"] if sampled else 0.0)


def ar_token_ms(parts: dict[str, float], sampled: bool) -> float:
    return parts["forward_1"] + parts["draw_sampled" if sampled else "draw_greedy"]


def bounds(parts: dict[str, float], target: float) -> list[dict]:
    """Per depth and temperature: the speedup if every draft were accepted, and the
    tokens a cycle must yield to reach `target`."""
    out = []
    for sampled in (False, True):
        ar = ar_token_ms(parts, sampled)
        for depth in DEPTHS:
            cycle = cycle_ms(parts, depth, sampled)
            out.append({"temperature": SAMPLED.temperature if sampled else 0.0, "depth": depth,
                        "cycle_ms": round(cycle, 3), "ar_token_ms": round(ar, 3),
                        "best_speedup": round((depth + 1) * ar / cycle, 2),
                        "tokens_per_cycle_for_target": round(target * cycle / ar, 2)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(engine.EMBEDDED_MODEL), type=model_folder)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--target", type=float, default=1.8)
    args = parser.parse_args()
    engine_ = Engine.load(args.model)
    if not engine_.backend.n_heads:
        raise SystemExit(f"{args.model}: no MTP head to draft with")
    parts = measure_parts(engine_, args.context, args.repeats)
    print(f"{args.model}, {args.context} cached tokens; parts, median ms:")
    print("  " + ", ".join(f"{name} {ms:.3f}" for name, ms in parts.items()))
    print(f"{'T':>4} {'depth':>5} {'cycle ms':>9} {'AR ms/token':>12} {'best speedup':>13} "
          f"{'tokens/cycle for ' + str(args.target) + 'x':>24}")
    for b in bounds(parts, args.target):
        print(f"{b['temperature']:>4} {b['depth']:>5} {b['cycle_ms']:>9} {b['ar_token_ms']:>12} "
              f"{b['best_speedup']:>12}x {b['tokens_per_cycle_for_target']:>24}")


if __name__ == "__main__":
    main()
