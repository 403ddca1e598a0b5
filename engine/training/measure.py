"""Acceptance of a model's MTP heads, measured through the real engine loop."""

from __future__ import annotations

from typing import Sequence

from engine.generation import GenerationRequest
from engine.sampler_settings import SamplerSettings


def measure_acceptance(engine, prompts: Sequence[str | Sequence[int]], depth: int, n_tokens: int) -> list[float]:
    """Per-depth acceptance at temperature 0 over greedy generations of `n_tokens`.

    Entry i is the fraction of speculative cycles that accepted draft i among
    those that accepted drafts 0..i-1 (the per-position acceptance `a` of the
    cost model); 0.0 where no cycle got that far. Prompts are text (encoded
    with the engine's tokenizer) or token ids.
    """
    reached = [0] * depth
    accepted = [0] * depth
    for prompt in prompts:
        ids = tuple(engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt)
        gen = engine.open(GenerationRequest(
            prompt=ids, sampler=SamplerSettings(temperature=0.0), mode="mtp", depth=depth,
            max_tokens=n_tokens,
        ))
        try:
            while not gen.finished:
                result = gen.step()
                for i, ok in enumerate(result.accepted):
                    reached[i] += 1
                    accepted[i] += ok
                    if not ok:
                        break
        finally:
            gen.close()
    return [a / r if r else 0.0 for a, r in zip(accepted, reached)]
