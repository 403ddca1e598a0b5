"""Quantized weights on the CPU: kept packed for the decode kernel (engine/quantized_rows.py)
against unpacked to float32 (what the engine did before), side by side in one process.

    .venv/bin/python scripts/quantized_rows_bench.py [--model SmolLM2-135M-Instruct] [--rounds 2]

1. One product, a 576 x 1536 4-bit matrix (SmolLM2's MLP) at 1..64 rows: the kernel, the
   unpack-then-BLAS path, MLX's own quantized_matmul and a float32 matmul, interleaved
   (where the kernel hands over to BLAS: ROWS_MAX).
2. One trunk forward of 1..16 tokens over a warm cache, both weight forms interleaved.
3. Time to first token of a 2,048-token prompt (cold, in 512-token prefill chunks as the
   engine takes them), both weight forms interleaved.
4. Decoding (`mtplxd bench`'s held-out code prompts, 64 tokens, T=0 and T=0.6): AR and
   MTP at depths 1 and 2 with both weight forms, the order rotated per prompt so that a
   busy machine slows every side alike. Read the ratios: on a shared machine a single
   absolute figure means little.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import engine  # noqa: E402,F401  (BLAS before mlx)
import mlx.core as mx  # noqa: E402

import engine.engine  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.generation import GenerationRequest  # noqa: E402
from engine.profiles import MEASURED_SAMPLERS  # noqa: E402
from engine.quantized_rows import describe, native  # noqa: E402
from mtplxd.bench.decode import Config, Tally, run_once  # noqa: E402
from mtplxd.calibrate import held_out_prompts  # noqa: E402
from mtplxd.commands.doctor import measure_read_gbs, weights_read_per_token  # noqa: E402
from mtplxd.config import load_settings  # noqa: E402


def median_us(sides: dict[str, Callable[[], mx.array]], reps: int, warmup: int = 3) -> dict[str, float]:
    """Each side timed `reps` times after `warmup` untimed runs, the sides alternating;
    medians in microseconds."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(reps + warmup):
        order = list(sides.items())
        for name, fn in order if i % 2 else order[::-1]:
            start = time.perf_counter()
            mx.eval(fn())
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def one_product(reps: int) -> None:
    kernel = native()
    assert kernel is not None
    w = mx.random.normal((1536, 576), key=mx.random.key(0))
    packed = mx.quantize(w, group_size=32, bits=4)
    unpacked = mx.dequantize(*packed, group_size=32, bits=4)
    mx.eval(packed, unpacked)
    print("one product, 576 x 1536 at 4 bits (us, median):")
    for rows in (1, 2, 4, 8, 16, 32, 64):
        x = mx.random.normal((rows, 576), key=mx.random.key(rows))
        mx.eval(x)
        sides = {
            "kernel": lambda: kernel.quantized_rows(x, *packed, 32, 4),
            "unpack+BLAS": lambda: x @ mx.dequantize(*packed, group_size=32, bits=4).T,
            "MLX qmm": lambda: mx.quantized_matmul(x, *packed, transpose=True, group_size=32, bits=4),
            "float32": lambda: x @ unpacked.T,
        }
        print(f"  {rows:3d} rows", "  ".join(f"{k} {v:7.0f}" for k, v in median_us(sides, reps).items()))


def load(model: str, packed: bool) -> Engine:
    path = load_settings({"model": model}).model_path
    if packed:
        return Engine.load(path)
    with mock.patch.object(engine.engine, "keep_packed", lambda trunk: 0):
        return Engine.load(path)


def one_forward(engines: dict[str, Engine], reps: int) -> None:
    print("one trunk forward over a warm cache of 300 tokens (ms, median):")
    for tokens in (1, 2, 3, 4, 8, 16):
        sides = {}
        for name, e in engines.items():
            backend = e.backend
            cache = backend.make_cache()
            mx.eval(backend.forward(mx.array([list(range(100, 400))]), cache)[0])

            def step(backend=backend, cache=cache) -> mx.array:
                for layer in cache:  # the same 300 positions every time
                    layer.offset = 300
                return backend.forward(mx.array([[42] * tokens]), cache)[0]
            sides[name] = step
        print(f"  {tokens:3d} tokens", "  ".join(f"{k} {v / 1e3:6.1f}" for k, v in median_us(sides, reps).items()))


def first_token(engines: dict[str, Engine], reps: int) -> None:
    first = next(iter(engines.values()))
    text = "\n\n".join(held_out_prompts(12, chars=4000))
    prompt = tuple(first.tokenizer.encode(text))[:2048]
    assert len(prompt) == 2048, len(prompt)

    def ttft(e: Engine) -> Callable[[], mx.array]:
        def run() -> mx.array:
            gen = e.open(GenerationRequest(prompt=prompt, sampler=MEASURED_SAMPLERS["t0"], mode="ar", max_tokens=1))
            while not gen.finished:
                gen.step()
            gen.close()
            return mx.array(0)
        return run
    times = median_us({name: ttft(e) for name, e in engines.items()}, reps, warmup=1)
    print("time to first token, 2,048-token prompt, cold (s, median):",
          "  ".join(f"{k} {v / 1e6:.2f}" for k, v in times.items()))


def decode(engines: dict[str, Engine], rounds: int, prompts: int) -> dict[tuple, Tally]:
    first = next(iter(engines.values()))
    ids = [tuple(first.tokenizer.encode(p)) for p in held_out_prompts(prompts)]
    sides = [(name, mode, depth) for name in engines for mode, depth in (("ar", 0), ("mtp", 1), ("mtp", 2))]
    tallies: dict[tuple, Tally] = {}
    for r in range(rounds):
        for temperature in MEASURED_SAMPLERS:
            for j, prompt in enumerate(ids):
                turn = (r + j) % len(sides)
                for name, mode, depth in sides[turn:] + sides[:turn]:
                    tally = tallies.setdefault((temperature, name, mode, depth), Tally())
                    run_once(engines[name], prompt, Config(mode, depth, temperature), 64, tally)
    print("decoding, 64 tokens a prompt (tokens over decoding time):")
    for temperature in MEASURED_SAMPLERS:
        base = {name: tallies[(temperature, name, "ar", 0)] for name in engines}
        for (t, name, mode, depth), tally in sorted(tallies.items()):
            if t != temperature:
                continue
            rate = tally.decoded / tally.seconds
            ar = base[name].decoded / base[name].seconds
            reference = tallies[(t, "float32", mode, depth)]
            acceptance = [round(a / n, 2) for a, n in zip(tally.accepted, tally.reached) if n][:depth]
            per_token = {part: 1e3 * seconds / tally.decoded for part, seconds in
                         (("wall", tally.seconds), ("python", tally.python_cpu), ("worker", tally.worker_cpu))}
            print(f"  T={MEASURED_SAMPLERS[t].temperature} {name:8} {mode} depth {depth}: {rate:6.1f} tok/s, "
                  f"{rate / ar:.2f}x its AR, {rate / (reference.decoded / reference.seconds):.2f}x float32's, "
                  f"acceptance {acceptance}; ms a token: "
                  + ", ".join(f"{part} {ms:.1f}" for part, ms in per_token.items()))
    return tallies


def bandwidth(engines: dict[str, Engine], tallies: dict[tuple, Tally]) -> None:
    """What AR reads a token against the memory's measured read rate."""
    read_gbs = measure_read_gbs()
    print(f"where a token's time goes (AR, T=0; memory read {read_gbs:.1f} GB/s, one thread):")
    for name, e in engines.items():
        tally = tallies[("t0", name, "ar", 0)]
        per_token = weights_read_per_token(e.backend.trunk)
        rate = tally.decoded / tally.seconds
        floor = no_matmul_floor_ms(e)
        print(f"  {name:8}: {per_token / 1e6:.0f} MB a token, limit {read_gbs * 1e9 / per_token:.0f} tok/s; "
              f"achieved {per_token * rate / 1e9:.1f} GB/s ({per_token * rate / 1e9 / read_gbs:.0%} of the limit); "
              f"a one-token forward with its blocks' matmuls replaced by a trivial op: {floor:.1f} ms "
              f"(against {1e3 / rate:.1f} ms a decoded token)")


def no_matmul_floor_ms(e: Engine, reps: int = 20) -> float:
    """One-token forward time with every block's linear layer made trivial: what the rest
    of a step (attention, norms, the LM head, dispatch, graph building) costs."""
    class Trivial:
        def __init__(self, out: int):
            self.out = out

        def __call__(self, x: mx.array) -> mx.array:
            return mx.zeros((*x.shape[:-1], self.out)) + x[..., :1]

    backend = e.backend
    saved = []
    for layer in backend.trunk.model.layers:
        for module, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for attr in names:
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, Trivial(getattr(module, attr).weight.shape[0]))
    backend._compiled.clear()
    try:
        cache = backend.make_cache()
        mx.eval(backend.forward(mx.array([list(range(100, 400))]), cache)[0])

        def step() -> mx.array:
            for layer in cache:
                layer.offset = 300
            return backend.forward(mx.array([[42]]), cache)[0]
        return median_us({"floor": step}, reps)["floor"] / 1e3
    finally:
        for module, attr, layer in saved:
            setattr(module, attr, layer)
        backend._compiled.clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    if native() is None:
        print(f"quantized weights: {describe()}", file=sys.stderr)
        return 2
    print(f"quantized weights: {describe()}")
    one_product(args.reps)
    engines = {"float32": load(args.model, packed=False), "packed": load(args.model, packed=True)}
    one_forward(engines, args.reps)
    first_token(engines, max(1, args.reps // 10))
    bandwidth(engines, decode(engines, args.rounds, args.prompts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
