"""What the scheduler runs: requests in, events out. No threads, no asyncio.

A `TextJob` turns engine steps into `TextDelta` events (incrementally
detokenized, never splitting a UTF-8 character, never emitting part of a
stop string) and ends with one `Done`. An `EmbedJob` pools hidden states.
Both run one short step at a time on the engine worker thread.

Session bank (engine/sessions/bank.py): a `TextJob` looks up the longest cached
prefix of its prompt in its workspace before the first step and restores it
instead of prefilling it (`Usage.cached_tokens`); it offers a snapshot once its
prompt is in the caches (at its second step, after the first token went out) and
another when it closes (end of generation, or cancellation). A `WarmJob`
(background warm-up) only prefills and offers snapshots.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from engine.engine import Engine
from engine.generation import Generation, GenerationRequest, StepResult
from engine.profiles import DecodePlan
from engine.sessions.bank import SessionBank
from engine.sessions.state import SnapshotMismatch
from mtplxd.requests import (
    Done, EmbedRequest, Embeddings, Event, FinishReason, MTPStats, TextDelta, TextRequest, Usage, Warmed, WarmRequest,
    token_sources,
)

log = logging.getLogger("mtplxd.jobs")


# -- jobs ------------------------------------------------------------------------


class StopMatcher:
    """Finds stop strings in streamed text without ever emitting part of one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.hit: str | None = None  # the stop string found

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            i, self.hit = min(hits, key=lambda h: h[0])
            out, self.pending = self.pending[:i], ""
            return out, True
        hold = max((_overlap(self.pending, s) for s in self.stops), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


# Special tokens that are part of the text all the same: tool-call and reasoning markers
# (DeepSeek's <｜tool▁call▁begin｜>, some <think>s) carry structure the adapters parse.
_MARKUP_WORDS = ("tool", "think")


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids of every special (control) token: named ones and special added tokens,
    except tool-call and reasoning markers."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    markup = {i for i, t in added.items() if any(w in str(t.content).lower() for w in _MARKUP_WORDS)}
    return special - markup


def open_generation(engine: Engine, request: GenerationRequest, bank: SessionBank | None,
                    workspace: str | None) -> Generation:
    """Open a generation, restored from the bank's longest prefix of the prompt when it
    has one. A snapshot that does not fit is a miss, never an error. On several ranks
    each restores its own slice, and all of them restore the same length or none does
    (a rank whose slice was evicted makes it a miss everywhere)."""
    generation = _restored(engine, request, bank, workspace)
    agreed = engine.backend.ranks.same(generation.reused if generation is not None else 0)
    if generation is None or not agreed:
        if generation is not None:
            generation.close()
        generation = engine.open(request, record=True) if bank is not None else engine.open(request)
    return generation


def _restored(engine: Engine, request: GenerationRequest, bank: SessionBank | None,
              workspace: str | None) -> Generation | None:
    if bank is None:
        return None
    try:
        restore = bank.lookup(workspace, request.prompt)
    except Exception:  # the bank must never fail a request
        log.exception("session bank lookup failed")
        return None
    if restore is None:
        return None
    try:
        return engine.open(request, restore=restore, record=True)
    except SnapshotMismatch as e:
        log.warning("session snapshot not used: %s", e)
        return None


def attach_bank(engine: Engine, bank: SessionBank | None) -> None:
    """Bind the session bank to the loaded model (fingerprint, layout, disk tier). Its
    probe runs a forward: on several ranks every rank calls this, in the same place."""
    if bank is None:
        return
    try:
        from engine.sessions.arrays import describe

        key = describe(engine)
        if key is None:
            log.info("session bank off: this model's caches cannot be snapshotted")
            return
        bank.attach(key)
    except Exception as e:  # a model without the usual engine surface, a broken disk: run without
        log.warning("session bank off: %s: %s", type(e).__name__, e)


def start_job(request: Any, engine: Engine, plan: DecodePlan | None, seed: int | None,
              bank: SessionBank | None) -> Any:
    """The job that runs `request` (a follower rank builds the same from rank 0's plan and seed)."""
    from mtplxd.calibrate import CalibrateJob, CalibrateRequest

    if isinstance(request, EmbedRequest):
        return EmbedJob(request, engine)
    if isinstance(request, WarmRequest):
        return WarmJob(request, engine, bank)
    if isinstance(request, CalibrateRequest):
        return CalibrateJob(request, engine)
    assert plan is not None and seed is not None
    return TextJob(request, engine, plan, seed, bank)


# A text job offers a snapshot only when it fed at least this many tokens beyond what it
# restored: copying the whole cache out for a handful of new tokens (a keystroke's
# completion, a cancelled request) would cost more than it could save.
MIN_NEW_TOKENS = 32


def offer_snapshot(bank: SessionBank | None, workspace: str | None, generation: Generation,
                   min_new: int = 0) -> bool:
    """Copy the generation's caches into the bank unless the bank already covers them."""
    if bank is None:
        return False
    if generation.reused and generation.fed_count - generation.reused < min_new:
        return False
    try:
        tokens = generation.fed_tokens
        if not tokens or not bank.wants(workspace, tokens, logits=generation.has_logits):
            return False
        return bank.add(workspace, generation.snapshot())
    except Exception:
        log.exception("session snapshot failed")
        return False


def _bank(bank: SessionBank | None) -> SessionBank | None:
    return bank if bank is not None and bank.enabled else None


class TextJob:
    def __init__(self, request: TextRequest, engine: Engine, plan: DecodePlan, seed: int,
                 bank: SessionBank | None = None):
        self.started = time.perf_counter()  # time to first token counts the bank lookup and restore
        self.queue_wait_s = 0.0  # before that, waiting for a slot (the scheduler tells)
        self.request = request
        self.plan = plan
        depth, mode = plan.depth, plan.mode
        self.bank = _bank(bank)
        self.generation: Generation = open_generation(
            engine,
            GenerationRequest(
                prompt=request.prompt_ids,
                sampler=request.sampler,
                mode=mode,
                depth=depth,
                seed=seed,
                max_tokens=request.max_tokens,
                prefill_chunk=plan.prefill_chunk,
                stop_token_ids=frozenset() if request.ignore_eos else frozenset(engine.tokenizer.eos_token_ids),
                first_tokens=request.heal.first_tokens if request.heal else None,
            ),
            self.bank,
            request.workspace,
        )
        self.cached_tokens = self.generation.reused
        self._prompt_snapshot_due = self.bank is not None
        self._broken = False  # a step raised: the caches may be half-updated
        self.detokenizer = engine.tokenizer.detokenizer
        if request.continuation or request.heal:
            # The output continues the prompt's text: keep its leading space, which a
            # detokenizer drops at the start of a text, by giving it a word to start
            # with ("x =" then " 0" must read "x = 0"; a healed heal.text is left out below).
            for token in engine.tokenizer.encode("a", add_special_tokens=False):
                self.detokenizer.add_token(token)
            _ = self.detokenizer.last_segment
        # Control tokens (chat and FIM markers) are never part of the text.
        self.hidden_ids = special_token_ids(engine.tokenizer)
        self.stops = StopMatcher(request.stop)
        self.unhealed = request.heal.text if request.heal else ""  # still to leave out of the text
        self.mtp = MTPStats(depth=depth if mode == "mtp" else 0)
        self.first_token_at: float | None = None
        self.finished = False

    def step(self) -> list[Event]:
        self.offer_prompt_snapshot()
        try:
            result = self.generation.step()
        except BaseException:
            self._broken = True
            raise
        return self.events(result)

    def offer_prompt_snapshot(self) -> None:
        """Once the prompt is in the caches and the first token went out: before the
        next step, or before the generation joins a batch (engine/batch.py)."""
        if self._prompt_snapshot_due and self.generation.started:
            self._prompt_snapshot_due = False
            offer_snapshot(self.bank, self.request.workspace, self.generation, MIN_NEW_TOKENS)

    def events(self, result: StepResult, batch: int = 1) -> list[Event]:
        """The events of one engine step of this generation, alone or in a batch of `batch` rows."""
        self.mtp.add(result.accepted)
        if result.tokens and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        for token in result.tokens:
            if token not in self.hidden_ids:
                self.detokenizer.add_token(token)
        finish = result.finish_reason
        if finish:
            self.detokenizer.finalize()
        text, hit_stop = self.stops.feed(self._healed(self.detokenizer.last_segment))
        if finish and not hit_stop:
            text += self.stops.flush()
        events: list[Event] = []
        if text or result.tokens:
            sources = token_sources(len(result.tokens), result.accepted)
            events.append(TextDelta(text, tuple(result.tokens), result.drafted, tuple(result.accepted), batch, sources))
        if hit_stop:
            events.append(self._done("stop"))
        elif finish:
            events.append(self._done(finish))
        return events

    def _healed(self, text: str) -> str:
        """The text without what the prompt's healed last token spelled (the first
        token begins with it, though the detokenizer may hand it out in pieces)."""
        n = min(len(self.unhealed), len(text))
        self.unhealed = self.unhealed[n:]
        return text[n:]

    def _done(self, reason: FinishReason) -> Done:
        self.finished = True
        now = time.perf_counter()
        first = self.first_token_at or now
        generated = self.generation.generated
        decode_s = now - first
        return Done(
            finish_reason=reason,
            usage=Usage(len(self.request.prompt_ids), generated, self.cached_tokens),
            mtp=self.mtp,
            time_to_first_token_s=first - self.started,
            decode_tokens_per_s=(generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
            stop_sequence=self.stops.hit if reason == "stop" else None,
            queue_wait_s=self.queue_wait_s,
        )

    def broken(self) -> None:
        """A step raised (alone or in a batch): the caches may be half-updated."""
        self._broken = True

    def close(self) -> None:
        if not self._broken:  # end of generation, or cancelled between two steps
            offer_snapshot(self.bank, self.request.workspace, self.generation, MIN_NEW_TOKENS)
        self.generation.close()


class WarmJob:
    """Prefill a prompt into the session bank at background priority; no text.

    Hybrid models only reuse whole snapshots, so a warm-up of one also keeps up to
    CHECKPOINTS evenly spaced ones at prefill chunk boundaries (a completion
    anywhere in the file then starts from the last one before its cursor)."""

    CHECKPOINTS = 8

    def __init__(self, request: WarmRequest, engine: Engine, bank: SessionBank | None, prefill_chunk: int = 512):
        self.request = request
        self.bank = _bank(bank)
        self.finished = False
        self.stored = 0
        self.generation: Generation | None = None
        if self.bank is None or not self.bank.wants(request.workspace, request.prompt_ids):
            return  # nothing to do (no bank, or already warm)
        self.generation = open_generation(
            engine,
            GenerationRequest(prompt=request.prompt_ids, mode="ar", max_tokens=1, prefill_chunk=prefill_chunk),
            self.bank,
            request.workspace,
        )
        chunks = math.ceil(len(request.prompt_ids) / prefill_chunk)
        self.every = 0 if self.bank.trimmable else prefill_chunk * max(1, math.ceil(chunks / self.CHECKPOINTS))
        self._broken = False

    def step(self) -> list[Event]:
        gen = self.generation
        if gen is None:
            self.finished = True
            n = len(self.request.prompt_ids)
            return [Warmed(n, n if self.bank is not None else 0, 0)]
        try:
            gen.step()
        except BaseException:
            self._broken = True
            raise
        if gen.started:
            self.stored += offer_snapshot(self.bank, self.request.workspace, gen)
            self.finished = True
            return [Warmed(len(self.request.prompt_ids), gen.reused, self.stored)]
        if self.every and gen.fed_count % self.every == 0:
            self.stored += offer_snapshot(self.bank, self.request.workspace, gen)
        return []

    def close(self) -> None:
        if self.generation is not None:
            if not self._broken and not self.finished:
                offer_snapshot(self.bank, self.request.workspace, self.generation)
            self.generation.close()


class EmbedJob:
    def __init__(self, request: EmbedRequest, engine: Engine):
        self.request = request
        self.engine = engine
        self.finished = False

    def step(self) -> list[Event]:
        vectors = [self.engine.embed(ids) for ids in self.request.inputs]
        self.finished = True
        tokens = sum(len(ids) for ids in self.request.inputs)
        return [Embeddings(vectors, tokens)]

    def close(self) -> None:
        pass
