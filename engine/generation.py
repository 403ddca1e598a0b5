"""One generation: prefill in chunks, then AR steps or speculative MTP cycles.

`step()` does one short unit of work (a prefill chunk or one decode cycle)
and returns the tokens it committed, so a scheduler can interleave many
generations and abandon any of them between two steps.

Plain decoding runs one step ahead. An AR step feeds the token it draws back to
the trunk and draws the next one, on device, before it copies its own token to
the host: the worker computes the next step while Python commits this one and
the caller streams it, as mlx-lm's own loop does (SmolLM2 on two cores, where the
worker bounds a step: 1.03-1.05x). The caches then hold the last committed token too,
and `_Ahead` the queued draw. What the host learns can undo it: a top-p cut
beyond the shortcut's candidates (the token is drawn again exactly) or a stop
token; then the queued position is rewound, and the state is the one a step at a
time leaves. `settle()` rewinds it too, for a batch to take the row.

MTP head caches. Head k at position p reads (hidden-in_p, token_{p+k+1}) and
predicts token_{p+k+2}; its hidden-in is the trunk's hidden for k = 0 and
head k-1's output otherwise. A head-cache entry is *real* when its token is
committed and its hidden-in is real; after every cycle each head cache is
trimmed back to its real entries, so it always equals what feeding the
committed tokens one by one would build. `_HeadState.pending` holds the real
hidden-ins a head has not consumed yet (positions offset .. offset+n-1).

Session bank (engine/sessions/state.py, engine/sessions/arrays.py). Between two
steps the state is always consistent, so `snapshot()` may copy it out (a
generation opened with `record=True` also keeps the trunk's hidden state of
every position and the last logits for that). A generation opened with `restore=` starts from a
snapshot's first `length` tokens instead of prefilling them: trunk caches are
copied in (cut to `length` for attention-only models); the heads keep their
stored caches when the snapshot is used whole, otherwise every head is cut back
to one common offset c with head 0's pending inputs taken from the stored
hidden states, which is again the state feeding one by one would build. When
the whole prompt is restored, the first token is sampled from the stored
logits. The random key sequence is untouched (keys are only split to sample),
so a restored generation samples with the same keys as a cold one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, cast

import mlx.core as mx
import numpy as np

from engine.backends.base import Backend, Tape
from engine.blas import decode_threads
from engine.sampling import SamplerSettings, compiled_probabilities, probabilities, provisional_probabilities
from engine.sessions.arrays import (
    capture_head,
    capture_layer,
    restore_head,
    restore_layer,
    supported,
    to_device,
    to_host,
)
from engine.sessions.state import Restore, Snapshot, SnapshotMismatch, Tensor
from engine.speculative import compiled_sample, compiled_verify, sample, verify_greedy


@dataclass(frozen=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    sampler: SamplerSettings = SamplerSettings()
    mode: Literal["ar", "mtp"] = "mtp"
    depth: int = 2
    seed: int = 0
    max_tokens: int = 256
    stop_token_ids: frozenset[int] = frozenset()
    prefill_chunk: int = 512
    compiled: bool = True  # mx.compile the sampling filters and draws (off: the eager reference, for tests)
    first_tokens: frozenset[int] | None = None  # what the first token may be (token healing); None: any

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt must contain at least one token")
        if self.mode not in ("ar", "mtp"):
            raise ValueError(f"mode must be 'ar' or 'mtp', not {self.mode!r}")
        if self.mode == "mtp" and self.depth < 1:
            raise ValueError("depth must be at least 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.first_tokens is not None and not self.first_tokens:
            raise ValueError("first_tokens, when given, must allow at least one token")


FinishReason = Literal["stop", "length"]


@dataclass
class StepResult:
    tokens: list[int]  # committed by this step (empty for a non-final prefill chunk)
    prefill_tokens: int = 0  # prompt tokens processed by this step
    drafted: int = 0
    accepted: list[bool] = field(default_factory=list)  # per depth, this cycle
    finish_reason: FinishReason | None = None


@dataclass
class _Ahead:
    """An AR step queued before the host saw the previous token (`Generation._ar_step`)."""

    token: mx.array  # int32 [1], drawn on device, not committed yet
    logits: mx.array  # [1, V] it was drawn from: the trunk's after the last fed token
    checks: list[mx.array]  # its draw's top-p shortcut checks
    key: mx.array  # the key it was drawn with (to draw again exactly)
    key_before: mx.array  # the generator's key before that draw
    logits_before: Tensor | mx.array | None  # `_last_logits` before the fed position
    tape: Tape  # what undoing the fed position takes


@dataclass
class _HeadState:
    pending: mx.array | None = None  # [1, n, D] real hidden-ins from the cache offset on


class Generation:
    def __init__(
        self,
        backend: Backend,
        request: GenerationRequest,
        restore: Restore | None = None,
        record: bool = False,
    ):
        if request.mode == "mtp" and backend.n_heads == 0:
            raise ValueError(f"{backend.family}: this checkpoint has no MTP head; use mode 'ar'")
        self.backend = backend
        self.request = request
        self.cache = backend.make_cache()
        self.tokens: list[int] = list(request.prompt)  # committed sequence
        self.generated = 0
        self.finish_reason: FinishReason | Literal["cancelled"] | None = None
        self._fed = 0  # tokens fed to the trunk
        self._key = mx.random.key(request.seed)
        self._logits: mx.array | None = None  # trunk logits after the last fed token
        n_used = min(request.depth, backend.n_heads) if request.mode == "mtp" else 0
        self.head_caches = backend.make_head_caches()[:n_used]
        self._heads = [_HeadState() for _ in range(n_used)]
        self.reused = 0  # prompt tokens restored from a snapshot instead of prefilled
        self._record = record
        self._hidden_log: list[mx.array] = []  # trunk hidden of every fed position (record)
        # the logits after the last fed token (record): a host copy, or on device until a snapshot copies it
        self._last_logits: Tensor | mx.array | None = None
        self._first_logits: mx.array | None = None  # restored whole prompt: sample the first token from these
        self._extra_fed: list[int] = []  # fed to the trunk but cut from `tokens` by a stop or the budget
        self._sampled = False  # the first token has been sampled
        self._ahead: _Ahead | None = None  # the next AR step, queued (plain decoding on one rank)
        self._checks: list[mx.array] = []  # top-p shortcuts taken since the last sync (sampling.py)
        if restore is not None:
            self._restore(restore.snapshot, restore.length)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def step(self) -> StepResult:
        if self.finished:
            raise RuntimeError("generation already finished")
        if self._fed < len(self.request.prompt):
            return self._prefill_chunk()
        with decode_threads():
            if self._first_logits is not None:
                return self._first_from_restored()
            if self.request.mode == "ar":
                return self._ar_step()
            return self._mtp_cycle()

    def close(self) -> None:
        """Drop every cache reference; safe to call at any point."""
        self.cache = []
        self.head_caches = []
        self._heads = []
        self._logits = None
        self._hidden_log = []
        self._first_logits = None
        self._ahead = None
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    # -- prefill --------------------------------------------------------------

    def _prefill_chunk(self) -> StepResult:
        start = self._fed
        chunk = self.request.prompt[start : start + self.request.prefill_chunk]
        logits, hidden = self.backend.forward(mx.array([chunk]), self.cache, last=True)
        self._fed += len(chunk)
        self._queue_trunk_hidden(hidden)
        self._log_hidden(hidden)
        self._advance_heads()
        heads = [[c.state for c in self.head_caches], [h.pending for h in self._heads if h.pending is not None]]
        if self._fed < len(self.request.prompt):
            mx.eval([c.state for c in self.cache], heads, self._hidden_log[-1:])
            return StepResult([], prefill_tokens=len(chunk))
        last = logits[:, -1]
        result = self._commit([self._draw_token(last)])
        mx.eval(heads)
        self._log_logits(last)
        result.prefill_tokens = len(chunk)
        return result

    def _advance_heads(self) -> None:
        """Feed each head the pending positions whose tokens are committed: in
        prefill, the prompt's. That is prompt work: done here, in chunks, it keeps
        the first decode cycle from running every head over the whole prompt
        (a step several times longer than the others)."""
        for k, (state, cache) in enumerate(zip(self._heads, self.head_caches)):
            start = cache.offset
            waiting = 0 if state.pending is None else state.pending.shape[1]
            end = min(start + waiting, len(self.tokens) - k - 1)  # token_{p+k+1} is committed for p < end
            if end <= start:
                return  # the later heads wait for this one's outputs
            tokens = mx.array(self.tokens[start + k + 1 : end + k + 1])[None]
            pending = cast(mx.array, state.pending)  # `waiting` > 0
            _, outputs = self.backend.head(k, pending[:, : end - start], tokens, cache, last=True)
            state.pending = pending[:, end - start :] if end - start < waiting else None
            if k + 1 < len(self._heads):
                self._heads[k + 1].pending = _concat(self._heads[k + 1].pending, outputs)

    def _first_from_restored(self) -> StepResult:
        """The whole prompt came from a snapshot: sample from its stored logits."""
        logits, self._first_logits = cast(mx.array, self._first_logits), None  # step() saw them
        return self._commit([self._draw_token(logits)])

    # -- plain autoregressive decoding -----------------------------------------

    def _ar_step(self) -> StepResult:
        ahead = self._ahead or self._queue(mx.array([[self.tokens[-1]]]), self._last_logits)
        self._ahead = None
        following = None
        if self.backend.ranks.size == 1 and supported(self.cache) and self.generated + 1 < self.request.max_tokens:
            following = self._queue(ahead.token[None], ahead.logits)  # the next step, before this one's sync
            mx.async_eval(following.token, *following.checks)
        token = ahead.token
        if not self.backend.ranks.held(ahead.checks, [token]):  # a top-p cut beyond the shortcut
            if following is not None:
                self._undo(following)
                following = None
            (token,) = self.backend.ranks.decide(self._draw(ahead.logits, ahead.key, exact=True)[0])
        result = self._commit([int(cast(int, token.item()))])
        if following is not None and self.finished:  # a stop token: not fed, as without the queued step
            self._undo(following)
            following = None
        self._ahead = following
        self._log_logits((following or ahead).logits)
        return result

    def _queue(self, token: mx.array, logits_before: Tensor | mx.array | None) -> _Ahead:
        """Feed `token` [1, 1] to the trunk and draw the next token on device: no host sync."""
        tape = Tape(length=1)
        key_before = self._key
        logits, hidden = self.backend.forward(token, self.cache, tape)
        self._fed += 1
        self._log_hidden(hidden)
        last = logits[:, -1]
        checks, self._checks = self._checks, []
        key = self._next_key()
        (drawn,) = self.backend.ranks.decide(self._draw(last, key, exact=False)[0])
        drawn_checks, self._checks = self._checks, checks
        return _Ahead(drawn, last, drawn_checks, key, key_before, logits_before, tape)

    def _undo(self, ahead: _Ahead) -> None:
        """Take back the position `ahead` fed, and its draw."""
        self.backend.rewind(self.cache, ahead.tape, keep=0)
        self._fed -= 1
        if self._record and self._hidden_log:
            last = self._hidden_log.pop()
            if last.shape[1] > 1:
                self._hidden_log.append(last[:, :-1])
        self._key = ahead.key_before
        self._last_logits = ahead.logits_before

    def settle(self) -> None:
        """Take back the queued AR step, if any: then every committed token but the last is
        in the caches, as between two steps of a batch (engine/batch.py)."""
        if self._ahead is not None:
            self._undo(self._ahead)
            self._ahead = None

    # -- one row of a batch (engine/batch.py) -----------------------------------------

    @property
    def decoding(self) -> bool:
        """Between two decode steps: every committed token but the last is in the caches."""
        return (self._sampled and not self.finished and self._first_logits is None
                and self._fed - (self._ahead is not None) == len(self.tokens) - 1)

    def to_ar(self) -> None:
        """Decode plainly from now on: drop the MTP heads. The trunk's caches are the
        same in both modes between two steps, so the output stays exactly the model's."""
        if self.request.mode == "mtp":
            self.request = replace(self.request, mode="ar")
            self.head_caches, self._heads = [], []

    def commit_drawn(self, token: int, logits: mx.array, hidden: mx.array | None,
                     host_logits: Tensor | None = None) -> StepResult:
        """Commit an AR step's token (a batch of rows draws its rows' tokens together,
        and copies their logits to the host at once: engine/batch.py); logits [1, V] and
        hidden [1, 1, D] of the fed position."""
        self._fed += 1
        self._log_hidden(hidden)
        result = self._commit([token])
        self._log_logits(logits, host_logits)
        return result

    # -- speculative cycle -----------------------------------------------------

    def _mtp_cycle(self, exact: bool = False) -> StepResult:
        """One draft-and-verify cycle, with a single host sync at its end. `exact`:
        filter without the top-p shortcut, for the rare cycle it did not cover;
        that cycle is undone and run again with the same keys."""
        depth = self.request.depth
        T = len(self.tokens) - 1  # index of the last committed token, not yet fed
        offsets = [c.offset for c in self.head_caches]
        key = self._key
        drafts, q, head_inputs = self._draft(T, depth, exact)
        tape = Tape(length=depth + 1)
        window = mx.concatenate([mx.array([self.tokens[-1]]), drafts])[None]
        logits, hidden = self.backend.forward(window, self.cache, tape)
        n_accepted, next_token = self._verify(logits, q, drafts, exact, self._next_key())
        if not self._covered(n_accepted, next_token, drafts):
            self.backend.rewind(self.cache, tape, keep=0)
            for cache, offset in zip(self.head_caches, offsets):
                cache.trim(cache.offset - offset)
            self._key = key
            return self._mtp_cycle(exact=True)
        m = int(cast(int, n_accepted.item()))
        self.backend.rewind(self.cache, tape, keep=m + 1)
        self._fed = T + m + 1
        self._trim_heads(T, m, offsets, head_inputs)
        self._queue_trunk_hidden(hidden[:, : m + 1])
        self._log_hidden(hidden[:, : m + 1])
        accepted = cast("list[int]", drafts[:m].tolist())
        result = self._commit(accepted + [int(cast(int, next_token.item()))])
        if len(self.tokens) < self._fed:  # a stop or the budget cut tokens the trunk was fed
            self._extra_fed = (self.tokens[: T + 1] + accepted)[len(self.tokens):]
        self._log_logits(logits[:, m])
        result.drafted = depth
        result.accepted = [i < m for i in range(depth)]
        return result

    def _draft(self, T: int, depth: int, exact: bool) -> tuple[mx.array, list[mx.array], list[mx.array]]:
        """Draft `depth` tokens with the heads, on device."""
        drafts: list[mx.array] = []
        q: list[mx.array] = []
        head_inputs: list[mx.array] = []
        outputs: mx.array | None = None  # previous head's hidden outputs
        for k, (state, cache) in enumerate(zip(self._heads, self.head_caches)):
            # every head has inputs in a cycle: the trunk's hidden, or the previous head's outputs
            hidden_in = cast(mx.array, state.pending if k == 0 else _concat(state.pending, outputs))
            head_inputs.append(hidden_in)
            start = cache.offset
            # token_{p+k+1} for p in [start, T-1]: committed ones, then drafts.
            committed = self.tokens[start + k + 1 : T + 1]
            tokens = mx.concatenate([mx.array(committed, dtype=mx.int32), *drafts])[None]
            logits, outputs = self.backend.head(k, hidden_in, tokens, cache, last=True)
            self._add_draft(logits[:, -1], drafts, q, exact)
        final = len(self._heads) - 1
        while len(drafts) < depth:  # reuse the last head recurrently
            logits, outputs = self.backend.head(
                final, cast(mx.array, outputs)[:, -1:], drafts[-1][None], self.head_caches[final], last=True
            )
            self._add_draft(logits[:, -1], drafts, q, exact)
        # Several ranks: the trunk reads rank 0's drafts. Another rank's own drafts only
        # ever feed its own heads, whose outputs nothing commits: one decision suffices.
        return self.backend.ranks.decide(mx.concatenate(drafts))[0], q, head_inputs

    def _add_draft(self, logits: mx.array, drafts: list, q: list, exact: bool) -> None:
        vocab = self.backend.draft_vocab  # q is zero outside it: filtered and drawn on it alone
        token, probs = self._draw(logits if vocab is None else vocab.compact(logits), self._next_key(), exact)
        if vocab is not None:
            token, probs = vocab.token(token), vocab.spread(probs)  # probs [1, V], or None when greedy
        drafts.append(token)
        q.append(probs)

    def _verify(self, logits: mx.array, q: list, drafts: mx.array, exact: bool,
                key: mx.array) -> tuple[mx.array, ...]:
        """The exact rule on the verify window's logits [1, K+1, V]; greedy decoding
        needs no distributions: it is the same rule on one-hot p and q."""
        decide = self.backend.ranks.decide
        if self.request.sampler.greedy:
            return decide(*verify_greedy(logits, drafts[None]))
        p = self._probs(logits[0], exact)[None]
        return decide(*compiled_verify(p, mx.stack(q, axis=1), drafts[None], key))

    def _trim_heads(self, T: int, m: int, offsets: list[int], head_inputs: list[mx.array]) -> None:
        """Keep only real head-cache entries; carry unconsumed real hidden-ins."""
        real = [min(T, T + m - k) for k in range(len(self._heads))]
        for k, cache in enumerate(self.head_caches):
            cache.trim(cache.offset - real[k])
        for k in range(1, len(self._heads)):
            # head_inputs[k] covers positions offsets[k] .. T-1; keep
            # real[k] .. real[k-1]-1 (real outputs of head k-1 not yet consumed).
            lo, hi = real[k] - offsets[k], real[k - 1] - offsets[k]
            self._heads[k].pending = head_inputs[k][:, lo:hi] if hi > lo else None  # none waiting, as in a batch
        if self._heads:
            self._heads[0].pending = None  # head 0 consumed every trunk hidden up to T-1

    # -- session bank: snapshot and restore ----------------------------------------

    @property
    def fed_tokens(self) -> list[int]:
        """The tokens the trunk caches hold (the committed ones, plus any a stop cut)."""
        return (self.tokens + self._extra_fed)[: self._fed]

    @property
    def fed_count(self) -> int:
        return self._fed

    @property
    def has_logits(self) -> bool:
        """A snapshot now would carry the logits after its last token."""
        return self._last_logits is not None

    @property
    def started(self) -> bool:
        """The prompt is in the caches and the first token has been sampled."""
        return self._sampled

    def snapshot(self) -> Snapshot | None:
        """A host copy of the caches now (between two steps). None when this generation
        was not opened with `record=True`, is closed, holds nothing, or has caches that
        cannot be copied out."""
        if not self._record or not self.cache or self._fed == 0 or not supported(self.cache):
            return None
        n = self._fed
        layers = [capture_layer(c, n) for c in self.cache]
        heads = [
            capture_head(cache, state.pending if k > 0 else None)
            for k, (cache, state) in enumerate(zip(self.head_caches, self._heads))
        ]
        hidden = None
        if self._hidden_log:
            joined = mx.concatenate(self._hidden_log, axis=1) if len(self._hidden_log) > 1 else self._hidden_log[0]
            self._hidden_log = [joined]
            if joined.shape[1] != n:
                raise SnapshotMismatch(f"hidden log holds {joined.shape[1]} positions, {n} fed")
            hidden = to_host(joined)
        elif self.head_caches or self.backend.n_heads:
            return None  # a backend with heads must keep the hidden states
        tokens = np.array(self.fed_tokens, dtype=np.int32)
        tokens.flags.writeable = False
        if isinstance(self._last_logits, mx.array):
            self._last_logits = to_host(self._last_logits)
        return Snapshot(tokens, layers, heads, hidden, self._last_logits)

    def _restore(self, snap: Snapshot, length: int) -> None:
        prompt = self.request.prompt
        if not 0 < length <= min(snap.n, len(prompt)):
            raise SnapshotMismatch(f"cannot restore {length} tokens of a {snap.n}-token snapshot")
        if tuple(int(t) for t in snap.tokens[:length]) != tuple(prompt[:length]):
            raise SnapshotMismatch("the snapshot's tokens are not a prefix of the prompt")
        whole = length == snap.n
        if not whole and not snap.trimmable:
            raise SnapshotMismatch("recurrent state cannot be cut: only a whole snapshot restores")
        if length == len(prompt) and not (whole and snap.logits is not None):
            raise SnapshotMismatch("restoring the whole prompt needs the snapshot's logits")
        cache = self.backend.make_cache()
        if len(cache) != len(snap.layers):
            raise SnapshotMismatch("the snapshot has a different number of layers")
        for c, layer in zip(cache, snap.layers):
            restore_layer(c, layer, length)
        hidden = to_device(snap.hidden.slice_seq(1, 0, length)) if snap.hidden is not None else None
        used = len(self._heads)
        if used and hidden is None:
            raise SnapshotMismatch("the heads need the snapshot's hidden states")
        if used and whole and used <= len(snap.heads):
            for k in range(used):  # the heads as they were
                restore_head(self.head_caches[k], snap.heads[k], snap.heads[k].offset)
                pending = snap.heads[k].pending
                self._heads[k].pending = to_device(pending) if k > 0 and pending is not None else None
            self._heads[0].pending = cast(mx.array, hidden)[:, snap.heads[0].offset:]  # heads: hidden checked
        elif used:
            # One common offset c for every head: head k's entries below c read tokens
            # before `length`, heads k >= 1 then need no pending inputs, head 0's come
            # from the stored hidden states.
            offsets = [snap.heads[k].offset for k in range(used)] if used <= len(snap.heads) else [0]
            c = max(0, min(offsets + [length - used]))
            for k in range(used):
                if c > 0:
                    restore_head(self.head_caches[k], snap.heads[k], c)
                self._heads[k].pending = None
            self._heads[0].pending = cast(mx.array, hidden)[:, c:]
        self.cache = cache
        self._fed = length
        self.reused = length
        if self._record and hidden is not None:
            self._hidden_log = [hidden]
        if length == len(prompt):
            self._first_logits = to_device(cast(Tensor, snap.logits))  # checked above
            self._last_logits = snap.logits

    def _log_hidden(self, hidden: mx.array | None) -> None:
        if self._record and hidden is not None:
            self._hidden_log.append(hidden)
            if len(self._hidden_log) >= 64:  # one array per cycle otherwise: keep the list short
                joined = mx.concatenate(self._hidden_log, axis=1)
                mx.async_eval(joined)  # not waiting for a queued step
                self._hidden_log = [joined]

    def _log_logits(self, logits: mx.array, host: Tensor | None = None) -> None:
        """Keep the logits after the last fed token (`host`: a host copy made already); a
        snapshot copies them to the host, so that a queued step is not waited for here."""
        if self._record:
            self._last_logits = host if host is not None else logits

    # -- shared helpers --------------------------------------------------------

    def _queue_trunk_hidden(self, hidden: mx.array) -> None:
        if self._heads:
            self._heads[0].pending = _concat(self._heads[0].pending, hidden)

    def _probs(self, logits: mx.array, exact: bool) -> mx.array:
        """Filtered probabilities; unless `exact`, provisional ones whose check joins
        `_checks` for the next `_covered`."""
        logits = logits.astype(mx.float32)
        if exact:
            return probabilities(logits, self.request.sampler)
        covered: mx.array | None
        if self.request.compiled:
            probs, covered = compiled_probabilities(self.request.sampler)(logits)
        else:
            probs, covered = provisional_probabilities(logits, self.request.sampler)
        if covered is not None:
            self._checks.append(covered)
        return probs

    def _covered(self, *results: mx.array) -> bool:
        """Evaluate results with the pending top-p checks; whether all held."""
        checks, self._checks = self._checks, []
        return self.backend.ranks.held(checks, list(results))

    def _draw_token(self, logits: mx.array) -> int:
        """One token from logits [1, V], on the host; the first one among
        `request.first_tokens` when given."""
        if not self._sampled and self.request.first_tokens is not None:
            allowed = mx.zeros((logits.shape[-1],), dtype=mx.bool_)
            allowed[mx.array(sorted(self.request.first_tokens))] = True
            logits = mx.where(allowed, logits, -mx.inf)
        key = self._next_key()
        decide = self.backend.ranks.decide  # several ranks: rank 0's draw is everyone's
        (token,) = decide(self._draw(logits, key, exact=False)[0])
        if not self._covered(token):
            (token,) = decide(self._draw(logits, key, exact=True)[0])
        return int(cast(int, token.item()))

    def _draw(self, logits: mx.array, key: mx.array, exact: bool) -> tuple[mx.array, mx.array | None]:
        """A token (int32 [1]) from the filtered distribution of logits [1, V], and that
        distribution; None when greedy, where the argmax is the one-hot's only token.
        A key is used either way, so greedy and sampled runs split keys alike."""
        if self.request.sampler.greedy:
            return mx.argmax(logits.astype(mx.float32), axis=-1).astype(mx.int32), None
        probs = self._probs(logits, exact)
        return (compiled_sample if self.request.compiled else sample)(probs, key), probs

    def _next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def _commit(self, new_tokens: list[int]) -> StepResult:
        """Append tokens, applying stop ids and the token budget (on an unfinished
        generation: step() and the batch see to it)."""
        self._sampled = True
        budget = self.request.max_tokens - self.generated
        kept: list[int] = []
        reason: FinishReason | None = None
        for token in new_tokens[:budget]:
            if token in self.request.stop_token_ids:
                reason = "stop"
                break
            kept.append(token)
        self.tokens.extend(kept)
        self.generated += len(kept)
        if reason is None and self.generated >= self.request.max_tokens:
            reason = "length"
        self.finish_reason = reason
        return StepResult(kept, finish_reason=reason)


def _concat(a: mx.array | None, b: mx.array | None) -> mx.array | None:
    if a is None or a.shape[1] == 0:
        return b
    if b is None:
        return a
    return mx.concatenate([a, b], axis=1)
