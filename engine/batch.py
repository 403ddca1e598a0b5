"""Rows decoding together: one trunk forward a step for every running generation.

    batch = DecodeBatch(backend)
    batch.join(generation)            # once generation.decoding (its prompt is in)
    results = batch.step()            # one token for every row, in one forward
    batch.leave(generation)           # its caches back, e.g. to snapshot or close it

On a CPU (and for small models on any device) a step's cost is mostly a fixed cost
per MLX operation, whatever its size: B rows in one forward pay it once, where B
single-row steps pay it B times.

The rows' caches are mlx-lm's batch caches: attention KV in a `BatchKVCache`, each
row left-padded to the longest and masked there, read at its own rotary position
(`offset` holds one per row); recurrent state in an `ArraysCache` with the rows
stacked. A row joins with its own caches (built by its prefill, in chunks, between
the batch's steps) and leaves with them, cut back to its own length.

Exactness. Each row draws its token from its own logits row with its own sampler
settings and its own key sequence: the calls and keys of a plain AR step
(`Generation.draw_batched` / `commit_batched` are its two halves). A row's logits
are computed with the other rows in the same matmuls; its float32 rounding can
differ from a single-row run's by a few ulps (another kernel blocking), so greedy
output is the same token for token except after a near-tie of the top two logits,
the caveat tests/test_batch.py checks and states. MTP rows are decoded plainly once
they join (`Generation.to_ar`): the distribution is the model's either way.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from engine.backends.base import Backend
from engine.blas import decode_threads
from engine.generation import Generation, StepResult


def batchable(generation: Generation) -> bool:
    """Whether `generation` can join a batch now: decoding, with caches of the kinds
    the batch stacks (plain KV and recurrent arrays; not sliding windows)."""
    return generation.decoding and all(type(c) in (KVCache, ArraysCache) for c in generation.cache)


class DecodeBatch:
    def __init__(self, backend: Backend):
        self.backend = backend
        self.rows: list[Generation] = []
        self._cache: list[Any] = []  # per layer: BatchKVCache or ArraysCache over the rows

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, generation: Generation) -> bool:
        return any(row is generation for row in self.rows)

    def join(self, generation: Generation) -> None:
        if not batchable(generation):
            raise ValueError("only a decoding generation with plain caches can join a batch")
        generation.to_ar()
        own = [_one_row(c) for c in generation.cache]
        if self.rows:
            for mine, theirs in zip(self._cache, own):
                mine.extend(theirs)
        else:
            self._cache = own
        generation.cache = []  # the batch holds them until the row leaves
        self.rows.append(generation)

    def leave(self, generation: Generation) -> None:
        """Give the row its caches back (its own length, no padding)."""
        i = next(j for j, row in enumerate(self.rows) if row is generation)
        generation.cache = [_extracted(c, i) for c in self._cache]
        self.rows.pop(i)
        if not self.rows:
            self._cache = []
            return
        keep = mx.array([j for j in range(len(self.rows) + 1) if j != i])
        for c in self._cache:
            c.filter(keep)

    def step(self) -> list[StepResult]:
        """One token for every row, in row order."""
        if not self.rows:
            return []
        with decode_threads():
            tokens = mx.array([[row.tokens[-1]] for row in self.rows])
            logits, hidden = self.backend.forward(tokens, self._cache)
            last = row_logits(logits)
            drawn = [row.draw_batched(row_logits) for row, row_logits in zip(self.rows, last)]
            mx.eval(drawn)  # every row's draw in one evaluation
            return [
                row.commit_batched(token, row_logits, None if hidden is None else hidden[i : i + 1])
                for i, (row, token, row_logits) in enumerate(zip(self.rows, drawn, last))
            ]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._cache)


def row_logits(logits: mx.array) -> list[mx.array]:
    """Each row's logits [1, V] at its last position, in row order."""
    return [logits[i : i + 1, -1] for i in range(logits.shape[0])]


def _one_row(cache: Any) -> Any:
    """A single row's cache as a one-row batch cache."""
    if isinstance(cache, KVCache):
        return BatchKVCache.merge([cache])
    return ArraysCache.merge([cache])


def _extracted(cache: Any, i: int) -> Any:
    row = cache.extract(i)
    if isinstance(row, KVCache):
        mx.eval(row.keys, row.values)  # standalone arrays, not views into the batch's
    return row
