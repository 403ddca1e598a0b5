"""The engine on MLX's default device, whatever it is (the CPU, Metal, CUDA): greedy MTP
against AR token for token, and decode speed AR vs MTP, on the embedded model or --model.

For a machine whose GPU the suite never sees (CI has none): each configuration runs in each
of --rounds rounds (the first pays the GPU's kernel compilation: read the last round), the
median step and the slowest are printed, then, per mode, whether each prompt's greedy tokens
equal AR's and where they first part. Usage:

    .venv/bin/python scripts/device_check.py [--model PATH or NAME] [--rounds 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import time

import engine
import mlx.core as mx
from engine.engine import Engine, default_dtype
from engine.generation import GenerationRequest
from engine.quantized_rows import describe
from engine.sampler_settings import SamplerSettings
from mtplxd.bench import model_folder

PROMPTS = ("def fibonacci(n):", "import os\n\ndef read_config(path):", "class Stack:\n    def __init__(self):")
MODES = (("ar", 0), ("mtp", 1), ("mtp", 2))


def generate(e: Engine, prompt: str, mode: str, depth: int, temperature: float, tokens: int) -> tuple[list[int], list[float]]:
    """(the tokens, each step's seconds) of one generation."""
    request = GenerationRequest(prompt=tuple(e.tokenizer.encode(prompt)), sampler=SamplerSettings(temperature=temperature),
                                mode=mode, depth=max(depth, 1), max_tokens=tokens, seed=1)
    gen = e.open(request)
    out, steps = [], []
    try:
        while not gen.finished:
            started = time.perf_counter()
            out += gen.step().tokens
            steps.append(time.perf_counter() - started)
    finally:
        gen.close()
    return out, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(engine.EMBEDDED_MODEL), type=model_folder)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    print(f"{mx.default_device()}, weights {default_dtype() or 'as stored'}, quantized products: {describe()}")
    e = Engine.load(args.model)
    modes = MODES if e.backend.n_heads else MODES[:1]
    greedy: dict[tuple[str, int], list[list[int]]] = {}
    for round_ in range(args.rounds):
        for mode, depth in modes:
            for temperature in (0.0, 0.6):
                runs = [generate(e, p, mode, depth, temperature, args.tokens) for p in PROMPTS]
                seconds = sorted(s for _, steps in runs for s in steps)
                n = sum(len(out) for out, _ in runs)
                if temperature == 0.0:
                    greedy[(mode, depth)] = [out for out, _ in runs]
                print(f"round {round_} {mode} depth {depth} T={temperature}: {n / sum(seconds):.1f} tok/s, step median "
                      f"{seconds[len(seconds) // 2] * 1e3:.1f} ms, slowest {seconds[-1] * 1e3:.0f} ms")
    for (mode, depth), outs in greedy.items():
        parted = [next((i for i, (a, b) in enumerate(zip(ar, out)) if a != b), None)
                  for ar, out in zip(greedy[("ar", 0)], outs)]
        print(f"{mode} depth {depth}: greedy equal to AR on {parted.count(None)} of {len(outs)} prompts; "
              f"first difference at token {parted}")


if __name__ == "__main__":
    main()
