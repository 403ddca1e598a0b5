"""The native softmax, causal softmax and SwiGLU (engine/native) against MLX's operations,
end to end: one process per side, the sides alternating (A B, then B A), medians.

The side without them replaces `engine.sampling.native` and `engine.backends.decode_ops.native`
by `lambda: None` before the engine loads, so sampling, attention and the MLP activation take
their MLX forms; both sides keep the quantized-rows kernel and its unpacking. Usage:

    .venv/bin/python scripts/native_ops_bench.py [--model PATH] [--rounds 6] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

SIDES = ("without", "with")


def measure(model: str, tokens: int) -> dict[str, float]:
    import engine
    from engine.engine import Engine
    from engine.generation import GenerationRequest
    from engine.sampling import SamplerSettings
    from mtplxd.bench.batch import batched

    loaded = Engine.load(model)
    source = open(engine.__file__.replace("__init__.py", "generation.py")).read()
    prompt = tuple(loaded.tokenizer.encode(source))[:200]

    def lone(mode: str, temperature: float, depth: int = 1) -> float:
        sampler = SamplerSettings(temperature=temperature)
        g = loaded.open(GenerationRequest(prompt=prompt, sampler=sampler, mode=mode, depth=depth,
                                          max_tokens=tokens, seed=0))
        g.step()
        start, n = time.perf_counter(), 0
        while not g.finished:
            n += len(g.step().tokens)
        return n / (time.perf_counter() - start)

    def prefill() -> float:
        g = loaded.open(GenerationRequest(prompt=prompt, sampler=SamplerSettings(temperature=0.0), mode="ar",
                                          max_tokens=1, seed=0))
        start = time.perf_counter()
        g.step()
        return len(prompt) / (time.perf_counter() - start)

    lone("ar", 0.0), batched(loaded, prompt, 4, 0, 16)  # warm-up: trace the shapes
    return {"AR T=0 tok/s": lone("ar", 0.0), "AR T=0.6": lone("ar", 0.6), "MTP depth 1 T=0.6": lone("mtp", 0.6),
            "4 batched rows": batched(loaded, prompt, 4, 0, tokens),
            "8 batched rows": batched(loaded, prompt, 8, 0, tokens), "prefill tok/s": prefill()}


def side(name: str, model: str, tokens: int) -> None:
    if name == "without":
        import engine.backends.decode_ops as decode_ops
        import engine.sampling as sampling

        sampling.native = decode_ops.native = lambda: None  # type: ignore[assignment]
    print(json.dumps(measure(model, tokens)))


def main() -> None:
    from engine import EMBEDDED_MODEL

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(EMBEDDED_MODEL))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in its own process
    args = parser.parse_args()
    if args.side:
        return side(args.side, args.model, args.tokens)
    results: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    for r in range(args.rounds):
        for name in SIDES if r % 2 == 0 else SIDES[::-1]:
            out = subprocess.run([sys.executable, __file__, "--side", name, "--model", args.model, "--tokens",
                                  str(args.tokens)], check=True, capture_output=True, text=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
    for key in results["with"][0]:
        a, b = (statistics.median(d[key] for d in results[s]) for s in SIDES)
        print(f"{key:20} without {a:9.1f}   with {b:9.1f}   x{b / a:.2f}")


if __name__ == "__main__":
    main()
