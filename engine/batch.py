"""Rows decoding together: one forward pass a step for every running generation.

    batch = DecodeBatch(backend, depth=2)     # depth 0: plain AR rows
    batch.join(generation)                    # once generation.decoding (its prompt is in)
    results = batch.step()                    # one cycle for every row: drafts, verify, accept
    batch.leave(generation)                   # its caches back, e.g. to snapshot or close it

On a CPU (and for small models on any device) a step's cost is mostly a fixed cost
per MLX operation, whatever its size: B rows in one forward pay it once, where B
single-row steps pay it B times.

Caches. The rows' trunk and head caches are mlx-lm's batch caches: attention KV in
a `BatchKVCache` (each row left-padded to the longest, masked there, read at its own
rotary position: `offset` holds one per row), recurrent state in an `ArraysCache`
with the rows stacked. A row joins with its own caches (built by its prefill, in
chunks, between the batch's steps) and leaves with them, cut to its own length.

An MTP cycle is `Generation._mtp_cycle` for B rows at once (read that first; the
names match). What differs is that rows are ragged: head k of row i reads the
positions from its cache offset to T_i - 1, a different count per row. Ragged
inputs are right-padded to the longest (`_Ragged`: the padded array and each row's
count), built with one gather from host-made indices, never a loop over rows; a
head's logits are read at each row's last real position. After verification each
row keeps its own accepted length: the trunk drops the K - m_i rejected positions
of its window and each head its padding and its draft positions (a per-row cut of
a `BatchKVCache`: those columns become left padding), recurrent layers replay the
kept prefix from their saved state with the other positions masked.

Exactness. Each row drafts, verifies and draws with its own sampler settings and
its own key sequence, in the calls and order of a lone generation, so its output
is distributed exactly as the model's. A row's logits are computed in the same
matmuls as its neighbours'; their float32 rounding can differ from a lone run's by
a few ulps (another kernel blocking), so greedy output is token for token the
lone run's except after a near-tie of the top two logits, the caveat
tests/test_batch.py checks and states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from engine.backends.base import Backend, Tape
from engine.blas import decode_threads
from engine.generation import Generation, StepResult
from engine.quantized_rows import native
from engine.sessions.arrays import to_host
from engine.sessions.state import Tensor
from engine.sampling import SamplerSettings, compiled_probabilities, probabilities, provisional_probabilities
from engine.speculative import compiled_inverse_cdf, inverse_cdf, verify, verify_greedy

# Each row's key sequence, advanced for all rows at once: row i's (next key, draw key) and
# its uniform are bit for bit what Generation._next_key and `sample` make from its key.
_split_keys = mx.vmap(mx.random.split)  # [B, 2] -> [B, 2, 2]
_uniforms = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))  # [B, 2] -> [B, 1]
# `verify` for rows [n, ...] each with its own key [n, 2] -> ([n, 1], [n, 1]), compiled as
# Generation's is: row for row the same tokens as a lone generation's verification.
_verify_rows = mx.compile(mx.vmap(lambda p, q, drafts, key: verify(p[None], q[None], drafts[None], key)))


def batchable(generation: Generation) -> bool:
    """Whether `generation` can join a batch now: decoding, with caches of the kinds
    the batch stacks (plain KV and recurrent arrays; not sliding windows)."""
    caches = [*generation.cache, *generation.head_caches]
    return generation.decoding and all(type(c) in (KVCache, ArraysCache) for c in caches)


def depth_of(generation: Generation) -> int:
    """The batch a generation joins: its MTP depth, 0 for plain AR."""
    return generation.request.depth if generation.request.mode == "mtp" else 0


@dataclass
class _Ragged:
    """B rows of different lengths: values [B, L, ...] right-padded, counts[i] real."""

    values: mx.array
    counts: list[int]

    def last(self) -> mx.array:
        """Each row's last real position: [B, 1, ...]."""
        index = mx.array([max(c, 1) - 1 for c in self.counts])
        return _take_rows(self.values, index[:, None])

    def row(self, i: int) -> mx.array | None:
        return self.values[i : i + 1, : self.counts[i]] if self.counts[i] else None


class DecodeBatch:
    def __init__(self, backend: Backend, depth: int = 0):
        self.backend = backend
        self.depth = depth  # MTP draft depth of every row; 0: plain AR
        self.rows: list[Generation] = []
        self._cache: list[Any] = []  # trunk, per layer: BatchKVCache or ArraysCache over the rows
        self._heads: list[BatchKVCache] = []  # per head
        self._pending: list[_Ragged] = []  # per head: hidden-ins not consumed yet (Generation._HeadState)
        self._offsets: list[list[int]] = []  # per head, per row: real entries in its cache
        self._keys: mx.array | None = None  # [B, 2]: each row's random key (Generation._key) while in the batch
        self._ranks = backend.ranks  # several ranks: rank 0's draws and verdicts (engine/distributed.py)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, generation: Generation) -> bool:
        return any(row is generation for row in self.rows)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in [*self._cache, *self._heads])

    # -- rows in and out -------------------------------------------------------------

    def join(self, generation: Generation) -> None:
        generation.settle()  # a queued AR step (Generation._ar_step) back: the batch steps its rows together
        if not batchable(generation):
            raise ValueError("only a decoding generation with plain caches can join a batch")
        if depth_of(generation) != self.depth:
            raise ValueError(f"a depth-{depth_of(generation)} generation cannot join a depth-{self.depth} batch")
        pending = [_Ragged(*_padded(state.pending)) for state in generation._heads]
        if self.rows:
            _extend(self._cache, generation.cache)  # the trunk's layers in one operation
            for mine, theirs in zip(self._heads, generation.head_caches):  # each head its own positions
                _extend([mine], [theirs])
            self._pending = [_stacked(a, b) for a, b in zip(self._pending, pending)]
            for offsets, cache in zip(self._offsets, generation.head_caches):
                offsets.append(cache.offset)
        else:
            self._cache = [_one_row(c) for c in generation.cache]
            self._heads = [BatchKVCache.merge([c]) for c in generation.head_caches]
            self._pending = pending
            self._offsets = [[c.offset] for c in generation.head_caches]
        key = generation._key[None]
        self._keys = key if self._keys is None else mx.concatenate([self._keys, key])
        generation.cache, generation.head_caches = [], []  # the batch holds them until the row leaves
        for state in generation._heads:
            state.pending = None
        self.rows.append(generation)

    def leave(self, generation: Generation) -> None:
        """Give the row its caches back (its own length, no padding)."""
        i = next(j for j, row in enumerate(self.rows) if row is generation)
        mx.eval([c.left_padding for c in [*self._cache, *self._heads] if isinstance(c, BatchKVCache)])
        generation.cache = [_extracted(c, i) for c in self._cache]
        generation.head_caches = [_extracted(c, i) for c in self._heads]
        # Standalone arrays, not views into the batch's buffers (which the next step then
        # writes in place), in one evaluation: one a layer cost ~0.3 ms each.
        mx.eval([a for c in [*generation.cache, *generation.head_caches] if isinstance(c, KVCache)
                 for a in (c.keys, c.values) if a is not None])
        for state, pending in zip(generation._heads, self._pending):
            state.pending = pending.row(i)
        assert self._keys is not None  # a row is in
        generation._key = self._keys[i]
        self.rows.pop(i)
        if not self.rows:
            self._cache, self._heads, self._pending, self._offsets, self._keys = [], [], [], [], None
            return
        keep = [j for j in range(len(self.rows) + 1) if j != i]
        index = mx.array(keep)
        self._keys = self._keys[index]
        _drop_row(self._cache, i, index)
        for cache in self._heads:
            _drop_row([cache], i, index)
        self._pending = [_Ragged(p.values[index], [p.counts[j] for j in keep]) for p in self._pending]
        for offsets in self._offsets:
            offsets.pop(i)

    # -- one step ----------------------------------------------------------------------

    def step(self) -> list[StepResult]:
        """One step for every row, in row order: a token each, or an MTP cycle each."""
        if not self.rows:
            return []
        if any(row.finished for row in self.rows):
            raise RuntimeError("a finished generation must leave the batch before its next step")
        with decode_threads():
            if self.depth == 0:
                return self._ar_step()
            results = self._mtp_cycle(exact=False)
            # an exact cycle holds: it has no shortcut to check
            return results if results is not None else cast("list[StepResult]", self._mtp_cycle(exact=True))

    def _ar_step(self) -> list[StepResult]:
        """`Generation._ar_step` for every row: one forward, one draw per group of rows
        sharing sampler settings, one evaluation."""
        tokens = mx.array([[row.tokens[-1]] for row in self.rows])
        logits, hidden = self.backend.forward(tokens, self._cache)
        last = logits[:, -1]
        keys, groups = self._next_keys(), _groups(self.rows)
        drawn, _, checks = _draw_rows(groups, last, keys, exact=False)
        (drawn,) = self._ranks.decide(drawn)
        if not self._ranks.held(checks, [drawn]):  # a top-p cut beyond the shortcut: same keys, exactly
            (drawn,) = self._ranks.decide(_draw_rows(groups, last, keys, exact=True)[0])
        split, hosts = row_logits(last), self._host_rows(last)
        return [row.commit_drawn(token, split[i], None if hidden is None else hidden[i : i + 1], hosts[i])
                for i, (row, token) in enumerate(zip(self.rows, cast("list[int]", drawn.tolist())))]

    def _host_rows(self, logits: mx.array) -> list[Tensor | None]:
        """Each row's logits [1, V] from logits [B, V], copied to the host in one go
        for the rows that keep them for the session bank (Generation._log_logits)."""
        if not any(row._record for row in self.rows):
            return [None] * len(self.rows)
        host = to_host(logits)
        return [Tensor(host.data[i : i + 1], host.dtype) for i in range(len(self.rows))]

    def _next_keys(self) -> mx.array:
        """Every row's `Generation._next_key`: [B, 2]."""
        assert self._keys is not None  # a row is in
        both = _split_keys(self._keys)
        self._keys = both[:, 0]
        return both[:, 1]

    def _mtp_cycle(self, exact: bool) -> list[StepResult] | None:
        """One draft-and-verify cycle for every row. None when a row's top-p shortcut
        did not hold: everything is undone (caches, keys) for the caller to run it
        again `exact`, as a lone generation does."""
        K, rows, groups = self.depth, self.rows, _groups(self.rows)
        T = [len(row.tokens) - 1 for row in rows]
        keys = self._keys
        lengths = [c.size() for c in self._heads]
        checks: list[mx.array] = []
        drafts, q, inputs = self._draft(T, groups, exact, checks)
        window = mx.concatenate([mx.array([[row.tokens[-1]] for row in rows]), drafts], axis=1)
        tape = Tape(length=K + 1)
        logits, hidden = self.backend.forward(window, self._cache, tape)
        verdicts = _verify_groups(groups, logits, q, drafts, self._next_keys(), exact, checks)
        n_accepted, next_tokens = self._ranks.decide(*verdicts)
        if not self._ranks.held(checks, [n_accepted, next_tokens, drafts]):
            self._undo(tape, lengths)
            self._keys = keys
            return None
        accepted, nexts = cast("list[int]", n_accepted.tolist()), cast("list[int]", next_tokens.tolist())
        self._rewind(tape, [m + 1 for m in accepted])
        self._trim_heads(T, accepted, inputs)
        self._pending[0] = _Ragged(hidden, [m + 1 for m in accepted])  # head 0 reads the kept window next
        hosts = self._host_rows(_take_rows(logits, mx.array(accepted)[:, None])[:, 0])
        return [self._commit(i, T[i], accepted[i], nexts[i], drafts, logits, hidden, hosts[i])
                for i in range(len(rows))]

    def _draft(self, T: list[int], groups: list[_Group], exact: bool,
               checks: list) -> tuple[mx.array, list[list], list[_Ragged]]:
        """Every row's `depth` drafts [B, K] from the heads; per depth, each group's
        draft distributions; each head's input. Top-p checks join `checks`."""
        drafts: list[mx.array] = []  # per depth, [B]
        q: list[list] = []  # per depth, per group: [n, V] (None when greedy)
        inputs: list[_Ragged] = []
        outputs: _Ragged | None = None
        for k, cache in enumerate(self._heads):
            # head k > 0 reads the previous head's outputs (set by then)
            hidden_in = self._pending[0] if k == 0 else _joined(self._pending[k], cast(_Ragged, outputs))
            inputs.append(hidden_in)
            tokens = self._head_tokens(k, T, drafts, hidden_in.counts)
            width = max(hidden_in.counts)
            logits, out = self.backend.head(k, hidden_in.values[:, :width], tokens, cache)
            self._add_drafts(_Ragged(logits, hidden_in.counts).last()[:, 0], groups, drafts, q, exact, checks)
            outputs = _Ragged(out, hidden_in.counts)
        final = len(self._heads) - 1
        while len(drafts) < self.depth:  # reuse the last head recurrently
            logits, out = self.backend.head(final, cast(_Ragged, outputs).last(), drafts[-1][:, None],
                                            self._heads[final], last=True)
            self._add_drafts(logits[:, -1], groups, drafts, q, exact, checks)
            outputs = _Ragged(out, [1] * len(self.rows))
        return self._ranks.decide(mx.stack(drafts, axis=1))[0], q, inputs  # rank 0's (Generation._draft)

    def _head_tokens(self, k: int, T: list[int], drafts: list[mx.array], counts: list[int]) -> mx.array:
        """Head k's tokens [B, L]: token_{p+k+1} for each row's positions p from its
        cache offset to T-1, the committed ones, then the drafts so far."""
        committed = [row.tokens[o + k + 1 : t + 1] for row, o, t in zip(self.rows, self._offsets[k], T)]
        if any(len(c) + k != n for c, n in zip(committed, counts)):
            raise RuntimeError(f"head {k}: inputs and tokens disagree")  # a broken invariant, never data
        width = max(1, max(len(c) for c in committed))
        table = mx.array(np.array([c + [0] * (width - len(c)) for c in committed], dtype=np.int32))
        if drafts:
            table = mx.concatenate([table, mx.stack(drafts, axis=1)], axis=1)
        index = [list(range(len(c))) + [width + j for j in range(k)] for c in committed]
        return _take_rows(table, _index_matrix(index, max(counts)))

    def _add_drafts(self, logits: mx.array, groups: list[_Group], drafts: list, q: list, exact: bool,
                    checks: list) -> None:
        vocab = self.backend.draft_vocab  # as Generation._add_draft: drawn on the heads' vocabulary
        rows = logits if vocab is None else vocab.compact(logits)
        tokens, probs, group_checks = _draw_rows(groups, rows, self._next_keys(), exact)
        if vocab is not None:
            tokens, probs = vocab.token(tokens), [vocab.spread(p) for p in probs]
        drafts.append(tokens)
        q.append(probs)
        checks += group_checks

    def _undo(self, tape: Tape, head_lengths: list[int]) -> None:
        """Undo a cycle whose draws must be redone: every row drops its whole window."""
        self._rewind(tape, [0] * len(self.rows))
        for cache, length in zip(self._heads, head_lengths):
            cache.trim(cache.size() - length)

    def _rewind(self, tape: Tape, keep: list[int]) -> None:
        """Each row keeps the first keep[i] positions of the verify window."""
        drop = [tape.length - k for k in keep]
        for layer, cache in enumerate(self._cache):
            if layer in tape.recurrent:
                saved, mixer_input = tape.recurrent[layer]
                cache.cache = list(saved)
                if max(keep) > 0:
                    cache.prepare(lengths=keep)  # the replay masks each row's dropped positions
                    self.backend.replay(layer, mixer_input, cache)
                    cache.finalize()
            else:
                _drop_last(cache, drop)

    def _trim_heads(self, T: list[int], accepted: list[int], inputs: list[_Ragged]) -> None:
        """Keep only real head-cache entries; carry unconsumed real hidden-ins
        (`Generation._trim_heads`, per row)."""
        n = len(self._heads)
        real = [[min(t, t + m - k) for t, m in zip(T, accepted)] for k in range(n)]
        for k, cache in enumerate(self._heads):
            appended = max(inputs[k].counts) + (self.depth - n if k == n - 1 else 0)  # the last: recurrent drafts too
            _drop_last(cache, [appended - (r - o) for r, o in zip(real[k], self._offsets[k])])
        for k in range(1, n):
            # inputs[k] covers positions offsets[k] .. T-1; keep real[k] .. real[k-1]-1
            lo = [r - o for r, o in zip(real[k], self._offsets[k])]
            hi = [r - o for r, o in zip(real[k - 1], self._offsets[k])]
            self._pending[k] = _slice_rows(inputs[k], lo, hi)
        self._offsets = real

    def _commit(self, i: int, T: int, m: int, next_token: int, drafts: mx.array, logits: mx.array,
                hidden: mx.array, host_logits: Tensor | None) -> StepResult:
        """Row i's part of `Generation._mtp_cycle` after its verdict."""
        row = self.rows[i]
        row._fed = T + m + 1
        row._log_hidden(hidden[i : i + 1, : m + 1])
        accepted = cast("list[int]", drafts[i, :m].tolist())
        result = row._commit(accepted + [next_token])
        if len(row.tokens) < row._fed:  # a stop or the budget cut tokens the trunk was fed
            row._extra_fed = (row.tokens[: T + 1] + accepted)[len(row.tokens):]
        row._log_logits(logits[i : i + 1, m], host_logits)
        result.drafted = self.depth
        result.accepted = [j < m for j in range(self.depth)]
        return result


# -- draws ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    """Rows that share sampler settings: one filter and one draw serve them all."""

    settings: SamplerSettings
    compiled: bool
    index: list[int]  # the rows, in batch order
    chosen: mx.array | None  # the same as an array; None when the group is the whole batch

    def of(self, values: mx.array) -> mx.array:
        return values if self.chosen is None else values[self.chosen]

    def probabilities(self, logits: mx.array, exact: bool, checks: list) -> mx.array:
        """`Generation._probs` for the group's rows: filtered float32 probabilities."""
        logits = logits.astype(mx.float32)
        if exact:
            return probabilities(logits, self.settings)
        covered: mx.array | None
        if self.compiled:
            probs, covered = compiled_probabilities(self.settings)(logits)
        else:
            probs, covered = provisional_probabilities(logits, self.settings)
        if covered is not None:
            checks.append(covered)
        return probs


def _groups(rows: list[Generation]) -> list[_Group]:
    by_settings: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        by_settings.setdefault((row.request.sampler, row.request.compiled), []).append(i)
    whole = len(by_settings) == 1
    return [_Group(settings, compiled, index, None if whole else mx.array(index))
            for (settings, compiled), index in by_settings.items()]


def _in_batch_order(groups: list[_Group], parts: list[mx.array]) -> mx.array:
    """Per-group results [n, ...] as one array in the rows' order."""
    joined = mx.concatenate(parts) if len(parts) > 1 else parts[0]
    order = [i for group in groups for i in group.index]
    return joined if order == sorted(order) else joined[mx.array(np.argsort(order))]


def _draw_rows(groups: list[_Group], logits: mx.array, keys: mx.array,
               exact: bool) -> tuple[mx.array, list[mx.array | None], list[mx.array]]:
    """`Generation._draw` for every row of logits [B, V], row i with its own settings
    and key keys[i], one filter and one draw per group. Returns the tokens [B], each
    group's filtered distributions [n, V] (None when greedy), and the top-p shortcut
    checks to hold (unless `exact`)."""
    uniforms = None
    parts: list[mx.array] = []
    probs_of: list[mx.array | None] = []
    checks: list[mx.array] = []
    for group in groups:
        rows_logits = group.of(logits)
        if group.settings.greedy:
            parts.append(mx.argmax(rows_logits.astype(mx.float32), axis=-1).astype(mx.int32))
            probs_of.append(None)
            continue
        uniforms = _uniforms(keys) if uniforms is None else uniforms
        probs = group.probabilities(rows_logits, exact, checks)
        parts.append((compiled_inverse_cdf if group.compiled else inverse_cdf)(probs, group.of(uniforms)))
        probs_of.append(probs)
    return _in_batch_order(groups, parts), probs_of, checks


def _verify_groups(groups: list[_Group], logits: mx.array, q: list[list], drafts: mx.array, keys: mx.array,
                   exact: bool, checks: list) -> tuple[mx.array, mx.array]:
    """`Generation._verify` for every row: (accepted drafts [B], next token [B]), from
    the verify window's logits [B, K+1, V] and, per depth, each group's draft
    distributions."""
    accepted, following = [], []
    for g, group in enumerate(groups):
        if group.settings.greedy:
            n, token = verify_greedy(group.of(logits), group.of(drafts))
        else:
            p = group.probabilities(group.of(logits), exact, checks)
            n, token = _verify_rows(p, mx.stack([by_group[g] for by_group in q], axis=1), group.of(drafts),
                                    group.of(keys))
        accepted.append(n.reshape(-1))
        following.append(token.reshape(-1))
    return _in_batch_order(groups, accepted), _in_batch_order(groups, following)


# -- ragged rows ------------------------------------------------------------------------


def row_logits(logits: mx.array) -> list[mx.array]:
    """Each row's logits [1, ...] from logits [B, ...], in row order."""
    return [logits[i : i + 1] for i in range(logits.shape[0])]


def _take_rows(values: mx.array, index: mx.array) -> mx.array:
    """values [B, L, ...] gathered along L with index [B, L'] -> [B, L', ...]."""
    expanded = index.reshape(*index.shape, *([1] * (values.ndim - 2)))
    return mx.take_along_axis(values, expanded, axis=1)


def _index_matrix(rows: list[list[int]], width: int) -> mx.array:
    """[B, width] int32: each row's indices, padded with its last one (or 0)."""
    return mx.array(np.array([r + [r[-1] if r else 0] * (width - len(r)) for r in rows], dtype=np.int32))


def _joined(first: _Ragged, then: _Ragged) -> _Ragged:
    """Each row's real entries of `first`, then of `then`."""
    if max(first.counts) == 0:
        return then
    width = first.values.shape[1]
    both = mx.concatenate([first.values, then.values], axis=1)
    index = [list(range(a)) + [width + j for j in range(b)] for a, b in zip(first.counts, then.counts)]
    counts = [a + b for a, b in zip(first.counts, then.counts)]
    return _Ragged(_take_rows(both, _index_matrix(index, max(counts))), counts)


def _slice_rows(ragged: _Ragged, lo: list[int], hi: list[int]) -> _Ragged:
    """Each row's entries lo[i] .. hi[i]-1."""
    counts = [max(0, h - l) for l, h in zip(lo, hi)]
    index = [list(range(l, l + c)) for l, c in zip(lo, counts)]
    return _Ragged(_take_rows(ragged.values, _index_matrix(index, max(1, max(counts)))), counts)


def _padded(pending: mx.array | None) -> tuple[mx.array, list[int]]:
    """A lone generation's pending hidden-ins [1, n, D] (or None) as one ragged row."""
    if pending is None or pending.shape[1] == 0:
        return mx.zeros((1, 1, 1)), [0]
    return pending, [pending.shape[1]]


def _stacked(a: _Ragged, b: _Ragged) -> _Ragged:
    """Two sets of rows in one, padded to the wider; an all-empty side adopts the other's width."""
    if max(b.counts) == 0 and a.values.shape[-1] != b.values.shape[-1]:
        b = _Ragged(mx.zeros((b.values.shape[0], 1, a.values.shape[-1]), a.values.dtype), b.counts)
    if max(a.counts) == 0 and a.values.shape[-1] != b.values.shape[-1]:
        a = _Ragged(mx.zeros((a.values.shape[0], 1, b.values.shape[-1]), b.values.dtype), a.counts)
    width = max(a.values.shape[1], b.values.shape[1])

    def pad(x: mx.array) -> mx.array:
        return mx.pad(x, [(0, 0), (0, width - x.shape[1]), (0, 0)]) if x.shape[1] < width else x

    return _Ragged(mx.concatenate([pad(a.values), pad(b.values.astype(a.values.dtype))]), a.counts + b.counts)


# -- batch caches -------------------------------------------------------------------------


def _one_row(cache: Any) -> Any:
    """A single row's cache as a one-row batch cache."""
    if isinstance(cache, KVCache):
        return BatchKVCache.merge([cache])
    return ArraysCache.merge([cache])


def _extracted(cache: Any, i: int) -> Any:
    if isinstance(cache, BatchKVCache) and cache.keys is None:
        return KVCache()
    row = cache.extract(i)
    if isinstance(row, KVCache) and row.keys is not None and row.keys.shape[2] == 0:
        return KVCache()
    return row


def _extend(batch: list[Any], row: list[Any]) -> None:
    """Each of the batch's caches extended by the joining row's cache of the same layer:
    their attention buffers in one native operation where they allow it (`_laid_out`),
    else mlx-lm's `extend` for each."""
    if _alike(batch) and all(type(c) is KVCache and c.keys is not None and c.keys.dtype == mx.float32 for c in row):
        length = row[0].offset
        if all(c.offset == length for c in row):
            first = batch[0]
            joined = max(first._idx, length)
            places = [(0, b, 0, first._idx, joined - first._idx) for b in range(first.keys.shape[0])]
            offset = mx.concatenate([first.offset, mx.array([length])])
            if _laid_out(batch, [row], places + [(1, 0, 0, length, joined - length)], max(first.keys.shape[2], length)):
                for cache in batch:
                    cache.offset = offset  # one array for all the blocks, as MiMoBackend._run keeps it
                    cache.left_padding = mx.concatenate([cache.left_padding + (joined - cache._idx),
                                                         mx.array([joined - length])])
                    cache._idx = joined
                return
    for mine, theirs in zip(batch, row):
        mine.extend(_one_row(theirs))


def _drop_row(batch: list[Any], i: int, index: mx.array) -> None:
    """`_without_row` for each cache, the attention buffers in one native operation
    where they allow it; left_padding is evaluated (DecodeBatch.leave)."""
    if _alike(batch):
        first = batch[0]
        padding = cast("list[int]", first.left_padding.tolist())
        keep = [j for j in range(len(padding)) if j != i]
        cut = min(padding[j] for j in keep)
        places = [(0, j, cut, first._idx - cut, 0) for j in keep]
        if _laid_out(batch, [], places, first.keys.shape[2] - cut):
            offset = first.offset[index]
            for cache in batch:
                cache.offset, cache.left_padding = offset, cache.left_padding[index] - cut
                cache._idx -= cut
            return
    for cache in batch:
        _without_row(cache, i, index)


def _alike(batch: list[Any]) -> bool:
    """Attention caches of float32 buffers, every one as many rows, columns and positions."""
    first = batch[0]
    return all(type(c) is BatchKVCache and c.keys is not None and c.keys.dtype == c.values.dtype == mx.float32
               and c.keys.shape[:3] == first.keys.shape[:3] and c._idx == first._idx for c in batch)


def _laid_out(batch: list[BatchKVCache], rows: list[list[KVCache]], places: list[tuple[int, int, int, int, int]],
              width: int) -> bool:
    """The batch's keys and values laid out anew in one native operation (`rows_laid_out`:
    each output row from one row of the batch's buffers or of `rows`' caches), where MLX's
    operations make a copy a layer's keys or values, one thread each (a row leaving 8
    SmolLM2 rows: 16-18 ms against 28-37, docs/performance.md). False where there is no
    native module: the caller's MLX operations run."""
    module = native()
    if module is None:
        return False
    groups: list[list[Any]] = [batch, *rows]
    sets = [[a for c in caches for a in (c.keys, c.values)] for caches in groups]
    out = module.rows_laid_out(sets, places, width)
    for k, cache in enumerate(batch):
        cache.keys, cache.values = out[2 * k], out[2 * k + 1]
    return True


def _without_row(cache: Any, i: int, index: mx.array) -> None:
    """The cache without row i (`index`: the rows kept), and of a BatchKVCache without the
    columns of padding every kept row has, copied into new buffers by slices. mlx-lm's
    `filter` gathers the rows (MLX's gather copies element by element: 1.2 ms a SmolLM2
    layer's keys at 6 rows) and then cuts the padding as a view, which each block's
    operation (engine/native) must copy again in the next step before it writes there."""
    if type(cache) is not BatchKVCache:
        cache.filter(index)
        return
    cache.offset, cache.left_padding = cache.offset[index], cache.left_padding[index]
    cut = min(cast("list[int]", cache.left_padding.tolist()))
    if cache.keys is not None:
        cache.keys, cache.values = (mx.concatenate([buffer[:i, :, cut:], buffer[i + 1 :, :, cut:]])
                                    for buffer in (cache.keys, cache.values))
    cache._idx -= cut
    cache.left_padding = cache.left_padding - cut


def _drop_last(cache: BatchKVCache, counts: list[int]) -> None:
    """Drop each row's last counts[i] entries: they become left padding (the row's
    entries shift right by as many columns)."""
    if min(counts, default=0) == max(counts, default=0):
        cache.trim(counts[0] if counts else 0)
    else:
        cache.prepare(right_padding=counts)
        cache.finalize()
