"""A draft vocabulary: the MTP heads score only a subset of the vocabulary.

A head's LM head is the trunk's, and on a small model it is a large share of a draft:
SmolLM2-135M's 49,152 x 576 rows are 113 MB of float32 a draft token, a fifth of the whole
trunk's weights. Heads trained against a draft vocabulary (engine/training/trunk_cache.py:
the corpus's most frequent tokens) ship its ids beside their weights, under DRAFT_VOCAB_KEY,
and the head then reads only those rows.

Exactness is untouched: the head's distribution q is zero outside the subset (its logits
there are -inf), which the speculative rule handles like any other q; a token outside is
never drafted, only produced by the trunk. So a sampled draft is filtered and drawn on
the subset's scores alone (`compact`, then `token` and `spread` back): every filter
(temperature, top-k, top-p, min-p) gives the tokens outside zero mass either way, and a
6x shorter row is cheaper to filter (SmolLM2 at T=0.6: a depth-2 cycle 20.1 against 20.6 ms).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine.quantized_rows import quantized_matmul

DRAFT_VOCAB_KEY = "model.mtp_draft_vocab"


class DraftVocabulary:
    """The LM head's rows for `ids` (sorted token ids), as a matrix or a quantized triple
    of the same layout; `logits` scatters their scores into a full-vocabulary row."""

    def __init__(self, ids: mx.array, vocab_size: int):
        self.vocab_size = vocab_size
        # One dict, updated in place: a compiled step swaps its arrays for its own while it
        # traces, so it must read them through the very container it was given.
        self.rows: dict[str, mx.array] = {"ids": ids.astype(mx.int32)}
        self._quantization: tuple[int, int] | None = None
        self._source: mx.array | None = None  # the LM head weight the rows came from

    def follow(self, lm_head: nn.Module) -> None:
        """Take the rows from the LM head unless they came from its current weight (the
        engine may unpack or cast the trunk after loading)."""
        if self._source is not lm_head.weight:
            self.take_rows(lm_head)

    def take_rows(self, lm_head: nn.Module) -> None:
        """Gather the rows from the LM head (an Embedding used as a linear layer, or a
        Linear), quantized or not."""
        ids = self.rows["ids"]
        self._source = lm_head.weight
        for name in ("weight", "scales", "biases"):
            self.rows.pop(name, None)
            if hasattr(lm_head, name):
                self.rows[name] = getattr(lm_head, name)[ids]
        quantized = "scales" in self.rows
        self._quantization = (lm_head.group_size, lm_head.bits) if quantized else None
        mx.eval(self.rows)

    def logits(self, h: mx.array) -> mx.array:
        """h [..., D] -> [..., vocab_size]: the subset's scores, -inf elsewhere."""
        if self._quantization is None:
            scores = h @ self.rows["weight"].T
        else:
            group_size, bits = self._quantization
            scores = quantized_matmul(h, self.rows["weight"], self.rows["scales"], self.rows["biases"],
                                      group_size, bits)
        return self._scatter(scores, -mx.inf)

    def compact(self, logits: mx.array) -> mx.array:
        """Full-vocabulary logits [..., vocab_size] -> the subset's [..., len(ids)]."""
        return mx.take(logits, self.rows["ids"], axis=-1)

    def token(self, index: mx.array) -> mx.array:
        """Indices into the subset -> token ids."""
        return self.rows["ids"][index]

    def spread(self, probs: mx.array | None) -> mx.array | None:
        """A distribution over the subset [..., len(ids)] -> over the vocabulary, zero
        elsewhere (None, a greedy draw's, stays None)."""
        return None if probs is None else self._scatter(probs, 0.0)

    def _scatter(self, values: mx.array, fill: float) -> mx.array:
        full = mx.full((*values.shape[:-1], self.vocab_size), fill, dtype=values.dtype)
        index = mx.broadcast_to(self.rows["ids"], values.shape)
        return mx.put_along_axis(full, index, values, axis=-1)

    @property
    def ids(self) -> mx.array:
        return self.rows["ids"]
