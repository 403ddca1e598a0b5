"""Heads-only training on a real trunk, with the trunk run once.

A frozen trunk gives the same hidden states and next-token distributions every epoch,
and on a CPU its forward is most of a naive step: SmolLM2-135M took 27-33 s a step that
way. So the trunk runs once over the corpus windows (`trunk_outputs`), keeping per
position its final-normed hidden state (float16) and the top-k of its next-token
distribution; the heads then train on that for as many epochs as wanted, at the cost of
the heads alone.

Both distributions live on a draft vocabulary: the `size` most frequent tokens of the
corpus (`draft_vocabulary`). A vocabulary-wide LM head (49k x 576 for SmolLM2) costs a
head's step twice over and its softmax and top-k half the trunk's forward again, while
the tokens code never uses teach a head nothing. The loss is the top-k cross-entropy
H(p_topk, q) of the head against the trunk, both softmaxes over the draft vocabulary:
KL(p || q) less p's own entropy, with the mass outside the top k left out. At decode
time the head still scores the whole vocabulary.

Windows can also be half written by the trunk itself (`continued_outputs`): corpus text,
then the trunk's own greedy continuation of it. Heads draft what the trunk writes, and a
small model's writing is not the corpus (it repeats itself, names things its own way):
trained on as many windows of each, heads agreed with the trunk on its own continuations
of held-out code 0.39 of the time against 0.28 (docs/performance.md). The heads learn at
every position of such a window, the prompt's too: taught the trunk's own positions only,
they learnt less a step, and no more in the same time (docs/performance.md).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.backends.mimo import MTPLayer
from engine.training.model import fast_exp, log_softmax, topk_cross_entropy


def draft_vocabulary(stream: np.ndarray, size: int) -> mx.array:
    """The `size` most frequent token ids of the corpus stream (sorted ids)."""
    counts = np.bincount(stream.astype(np.int64))
    chosen = np.argsort(-counts, kind="stable")[:size]
    return mx.array(np.sort(chosen[counts[chosen] > 0]).astype(np.int32))


@dataclass
class TrunkOutputs:
    """Per window i and position t < S: what the trunk read (tokens[i, :S]) and said."""

    tokens: mx.array  # [N, S+1] int32: the window (inputs and the token after the last)
    hidden: mx.array  # [N, S, D] float16: final-normed hidden (what head 0 reads)
    top_ids: mx.array  # [N, S, K] int32: the k most likely next tokens (draft-vocabulary indices)
    top_logp: mx.array  # [N, S, K] float16: their log-probabilities over the draft vocabulary
    # [N] int32: where the trunk's own text starts (a continued window's prompt length; 0:
    # corpus text throughout), where the agreement with it is measured
    first: mx.array

    FIELDS = ("tokens", "hidden", "top_ids", "top_logp", "first")

    def save(self, path) -> None:
        mx.save_safetensors(str(path), {name: getattr(self, name) for name in self.FIELDS})

    @classmethod
    def load(cls, path) -> TrunkOutputs:
        arrays = cast(dict[str, mx.array], mx.load(str(path)))  # a .safetensors file: a dict
        if "first" not in arrays:  # saved before `first` was kept
            arrays["first"] = mx.zeros(arrays["tokens"].shape[0], dtype=mx.int32)
        return cls(*(arrays[name] for name in cls.FIELDS))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def concatenate(cls, parts: list[TrunkOutputs]) -> TrunkOutputs:
        return cls(*(mx.concatenate([getattr(p, name) for p in parts]) for name in cls.FIELDS))


def _said(h: mx.array, lm_rows: mx.array, top_k: int) -> tuple[mx.array, mx.array, mx.array]:
    """What is kept of the trunk's hidden states h [B, L, D]: (h as float16, the top_k
    draft-vocabulary ids of each next-token distribution, their log-probabilities)."""
    lp = log_softmax((h @ lm_rows.T).astype(mx.float32))
    top = mx.argpartition(lp, -top_k, axis=-1)[..., -top_k:].astype(mx.int32)
    kept = (h.astype(mx.float16), top, mx.take_along_axis(lp, top, axis=-1).astype(mx.float16))
    mx.eval(*kept)
    return kept


class _Progress:
    def __init__(self, what: str, total: int, on: bool):
        self.what, self.total, self.on, self.started = what, total, on, time.perf_counter()

    def __call__(self, done: int, tokens: int) -> None:
        if self.on:
            rate = tokens / (time.perf_counter() - self.started)
            end = "\n" if done >= self.total else ""
            print(f"\r{self.what}: {done}/{self.total} windows, {rate:.0f} tokens/s", end=end, file=sys.stderr,
                  flush=True)


def trunk_outputs(hidden_of: Callable[[mx.array], mx.array], lm_rows: mx.array, windows: np.ndarray, top_k: int,
                  chunk: int = 4, progress: bool = False) -> TrunkOutputs:
    """Run the frozen trunk over every window once. `hidden_of`: tokens [B, L] -> the
    final-normed hidden (a prefill without cache); `lm_rows`: the LM head's rows of the
    draft vocabulary [V', D]."""
    S = windows.shape[1] - 1
    top_k = min(top_k, lm_rows.shape[0])
    said = []
    report = _Progress("trunk outputs", len(windows), progress)
    for i in range(0, len(windows), chunk):
        said.append(_said(hidden_of(mx.array(windows[i:i + chunk, :S])), lm_rows, top_k))
        report(min(i + chunk, len(windows)), min(i + chunk, len(windows)) * S)
    hidden, ids, logp = zip(*said)
    return TrunkOutputs(mx.array(windows.astype(np.int32)), mx.concatenate(list(hidden)),
                        mx.concatenate(list(ids)), mx.concatenate(list(logp)), mx.zeros(len(windows), mx.int32))


def continued_outputs(backend, lm_rows: mx.array, prompts: np.ndarray, new_tokens: int, top_k: int,
                      batch: int = 32, progress: bool = False) -> TrunkOutputs:
    """Windows of prompt [P tokens of corpus text] + the trunk's greedy continuation of
    it [new_tokens], with what the trunk said at each of the P + new_tokens - 1 positions.
    `backend.forward(tokens, cache)` gives (logits, final-normed hidden); the prompts of a
    batch have one length, so they share one cache. The hidden states are the ones the
    generation computed: the continuation costs no second pass."""
    top_k = min(top_k, lm_rows.shape[0])
    parts = []
    report = _Progress("trunk continuations", len(prompts), progress)
    for i in range(0, len(prompts), batch):
        tokens = [mx.array(prompts[i:i + batch].astype(np.int32))]
        cache = backend.make_cache()
        logits, h = backend.forward(tokens[0], cache, last=True)
        hidden = [h]
        for _ in range(new_tokens - 1):
            tokens.append(logits[:, -1:].argmax(axis=-1).astype(mx.int32))
            logits, h = backend.forward(tokens[-1], cache)
            hidden.append(h)
            mx.async_eval(logits, h)
        tokens.append(logits[:, -1:].argmax(axis=-1).astype(mx.int32))
        window = mx.concatenate(tokens, axis=1)
        first = mx.full(window.shape[0], prompts.shape[1], dtype=mx.int32)
        parts.append(TrunkOutputs(window, *_said(mx.concatenate(hidden, axis=1), lm_rows, top_k), first))
        done = min(i + batch, len(prompts))
        report(done, done * (prompts.shape[1] + new_tokens - 1))
    return TrunkOutputs.concatenate(parts)


def continuation_prompts(stream: np.ndarray, line_ends: np.ndarray, length: int, count: int,
                         seed: int) -> np.ndarray:
    """`count` prompts of `length` tokens of the stream, each ending with a line break
    (a token in `line_ends`), so the trunk's continuation starts a line as an editor's
    or an agent's request does. Chosen at random (seeded) from the whole stream."""
    ends = np.flatnonzero(np.isin(stream[length - 1:], line_ends)) + length
    if len(ends) == 0:
        raise ValueError(f"no line break after the first {length} tokens of the corpus to continue from")
    picked = np.sort(np.random.default_rng(seed).choice(ends, size=count, replace=count > len(ends)))
    return np.stack([stream[end - length:end] for end in picked]).astype(np.int32)


def corpus_windows(stream: np.ndarray, seq_len: int, limit: int | None, seed: int) -> np.ndarray:
    """Non-overlapping windows of seq_len + 1 tokens of the stream; `limit` of them, chosen
    at random (seeded) from the whole corpus, when given."""
    n = (len(stream) - 1) // seq_len
    starts = np.arange(n) * seq_len
    if limit is not None and limit < n:
        starts = np.sort(np.random.default_rng(seed).choice(starts, size=limit, replace=False))
    return np.stack([stream[i:i + seq_len + 1] for i in starts]).astype(np.int32)


def continuation_shape(seq_len: int) -> tuple[int, int]:
    """(prompt tokens, tokens the trunk adds) of a continued window: the trunk writes
    half of its seq_len + 1 tokens."""
    return seq_len + 1 - seq_len // 2, seq_len // 2


def line_end_ids(tokenizer, stream: np.ndarray) -> np.ndarray:
    """The token ids of the stream whose text ends with a line break."""
    ids = np.unique(stream.astype(np.int64))
    return np.array([i for i in ids if tokenizer.decode([int(i)]).endswith("\n")], dtype=np.int64)


class CachedHeads(nn.Module):
    """New MiMo-style heads trained against cached trunk outputs.

    `embed` is the trunk's (frozen) input embedding, `lm_rows` its LM head's rows for the
    draft vocabulary (tied models: the embedding's)."""

    def __init__(self, args, n_heads: int, embed: mx.array, lm_rows: mx.array):
        super().__init__()
        self.mtp_layers = [MTPLayer(args) for _ in range(n_heads)]
        self._embed = embed
        self._lm_rows = lm_rows  # [V', D]

    @property
    def n_heads(self) -> int:
        return len(self.mtp_layers)

    def heads_logits(self, hidden: mx.array, x: mx.array, first: int = 0):
        """Yield (k, skip, head k's draft-vocabulary logits at positions skip..): at position
        p head k reads (head k-1's output or the trunk's hidden at p, x[p+k+1]) and drafts
        x[p+k+2], the trunk's choice at p+k+1; from `first` on, those tokens are the ones
        from x[first]. Every position goes through the head's block (later ones attend to
        it); the LM head runs from `skip`."""
        S = x.shape[1] - 1
        for k, layer in enumerate(self.mtp_layers):
            n = S - k - 1
            if n < 1:
                break
            hidden = layer(hidden[:, :n], self._embed[x[:, k + 1:k + 1 + n]], None)
            skip = min(n - 1, max(0, first - k - 2))
            yield k, skip, hidden[:, skip:] @ self._lm_rows.T

    def loss(self, outputs: TrunkOutputs, batch: mx.array):
        """(total, per-head losses): top-k cross-entropy against the trunk at p+k+1."""
        x = outputs.tokens[batch]
        h = outputs.hidden[batch].astype(mx.float32)
        top = outputs.top_ids[batch]
        p = fast_exp(outputs.top_logp[batch].astype(mx.float32))
        losses = []
        for k, _, logits in self.heads_logits(h, x):
            at = slice(k + 1, k + 1 + logits.shape[1])
            losses.append(topk_cross_entropy(logits, top[:, at], p[:, at]).mean())
        return sum(losses), mx.stack(losses)

    def agreement(self, outputs: TrunkOutputs, batch: mx.array) -> list[float]:
        """Per head: how often its argmax is the trunk's (teacher-forced, held-out windows),
        on the tokens from the batch's first window's `first` on (continued windows: the
        trunk's own tokens)."""
        x = outputs.tokens[batch]
        h = outputs.hidden[batch].astype(mx.float32)
        greedy = mx.take_along_axis(outputs.top_ids[batch], outputs.top_logp[batch].argmax(axis=-1)[..., None],
                                    axis=-1)[..., 0]
        agree = []
        for k, skip, logits in self.heads_logits(h, x, cast(int, outputs.first[batch][0].item())):
            same = logits.argmax(axis=-1) == greedy[:, k + 1 + skip:k + 1 + skip + logits.shape[1]]
            agree.append(same.astype(mx.float32).mean().item())
        return agree


class WindowBatches:
    """The trainer's batch source over cached windows: a batch is an array of window
    indices, a seeded permutation per epoch (the data position is one integer)."""

    def __init__(self, n_windows: int, seq_len: int, batch: int, seed: int):
        self.n, self.seq_len, self.batch, self.seed = n_windows, seq_len, batch, seed

    def get(self, position: int) -> np.ndarray:
        epoch, start = divmod(position, self.n)
        order = np.random.default_rng(self.seed + epoch).permutation(self.n)
        picked = np.concatenate([order, np.random.default_rng(self.seed + epoch + 1).permutation(self.n)])
        return picked[start:start + self.batch].astype(np.int32)
