"""What a verify window costs: a trunk forward of L tokens against one token.

Speculative decoding pays when checking K+1 tokens costs about as much as
decoding one. This measures that ratio on random MiMo-layout trunks of a few
sizes (after `--context` cached tokens, one BLAS thread, as decode steps run),
with the BLAS shim's few-row kernel on and, side by side in the same process,
its AVX2 form (the same as "shim" on CPUs without AVX-512) and off (plain
sgemm). Absolute times of the one-token step and the 4-token window follow.
Usage:

    python -m mtplxd.bench.rows [--sizes 192x8,512x8,1024x12] [--context 450]
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from typing import Any, cast

import engine  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import mimo

from engine.backends.base import Backend
from engine.backends.mimo import MiMoBackend
from engine.blas import ensure_fast_blas, set_threads

LENGTHS = (1, 2, 4)


def trunk(hidden: int, layers: int) -> MiMoBackend:
    heads = max(1, hidden // 64)
    args = mimo.ModelArgs(model_type="mimo", hidden_size=hidden, num_hidden_layers=layers,
                          intermediate_size=hidden * 11 // 4, num_attention_heads=heads,
                          num_key_value_heads=max(1, heads // 4), rms_norm_eps=1e-6,
                          vocab_size=4096, tie_word_embeddings=True)
    model = mimo.Model(args)
    mx.eval(model.parameters())
    return MiMoBackend(model, [])


def forward_step(backend: Backend, cache: list, length: int) -> Callable[[], None]:
    """One evaluated trunk forward of `length` tokens, its cache entries trimmed
    again, so that every call runs at the same context."""
    def step():
        logits, hidden = backend.forward(mx.array([[5] * length]), cache)
        mx.eval(logits, hidden)
        for c in cache:
            c.trim(length)
    return step


def forward_ms(backend: MiMoBackend, cache: list, length: int, repeats: int) -> float:
    step = forward_step(backend, cache, length)
    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats * 1e3


def few_rows_switch():
    blas = ensure_fast_blas()
    if blas.library != "openblas" or blas.path is None:
        return None
    return getattr(ctypes.CDLL(blas.path), "mtplxd_few_rows", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="192x8,512x8,1024x12,2048x8", help="hidden x layers, comma-separated")
    parser.add_argument("--context", type=int, default=450)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    set_threads(1)
    switch = few_rows_switch()
    modes = {"shim": 1, "avx2": 2, "sgemm": 0} if switch else {"sgemm": None}
    print(f"{'params':>8}  {'1 token':>9}  " + "  ".join(f"L={n} {m}" for m in modes for n in LENGTHS[1:])
          + "  " + "  ".join(f"{m} 1 / L=4 ms" for m in modes))
    for size in args.sizes.split(","):
        hidden, layers = map(int, size.split("x"))
        backend = trunk(hidden, layers)
        # without `destination`, tree_flatten returns a list of (key, value) (its hint says list or dict)
        flat = cast(list[tuple[str, Any]], tree_flatten(backend.trunk.parameters()))
        params = sum(v.size for _, v in flat)
        cache = backend.make_cache()
        mx.eval(backend.forward(mx.arange(args.context)[None] % 4096, cache))
        repeats = max(3, int(2000 / max(hidden, 1) ** 1.2))
        best: dict[tuple[str, int], float] = {}
        for _ in range(args.rounds):  # A B A B: kernel on, off
            for mode, flag in modes.items():
                if switch:
                    switch(flag)
                for length in LENGTHS:
                    ms = forward_ms(backend, cache, length, repeats)
                    best[mode, length] = min(best.get((mode, length), ms), ms)
        if switch:
            switch(1)
        one = best[next(iter(modes)), 1]
        ratios = "  ".join(f"{best[m, n] / best[m, 1]:>9.2f}" for m in modes for n in LENGTHS[1:])
        absolute = "  ".join(f"{best[m, 1]:>7.2f} / {best[m, LENGTHS[-1]]:<7.2f}" for m in modes)
        print(f"{params / 1e6:>7.1f}M  {one:>7.2f}ms  {ratios}  {absolute}", flush=True)


if __name__ == "__main__":
    main()
