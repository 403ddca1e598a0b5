"""Documents -> token stream -> fixed-length training windows.

Each document is cut at line breaks into pieces that fit one sequence. About
half of the pieces (seeded) become fill-in-the-middle samples, cut as an
editor's request is (`fim_split`), in PSM or SPM order (`_fim_sample`):

    <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|> middle <|endoftext|>
    <|fim_prefix|> <|fim_suffix|> suffix <|fim_middle|> prefix middle <|endoftext|>

The others stay plain text, with `<|endoftext|>` after a document's last
piece. Everything is concatenated into one stream; window i is
stream[i*L : i*L + L + 1] (inputs and shifted targets). The order of windows
is a seeded permutation per epoch, so the data position is a single integer:
the number of windows consumed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.training.tokenizer import EOS, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, special_ids


def fim_split(text: str, rng: random.Random, cursors: Sequence[int] | None = None) -> tuple[str, str, str]:
    """(prefix, middle, suffix) shaped like an editor's request.

    The cursor (the middle's start) is one of `cursors`, sorted positions
    where a token of the whole text starts (default: any character). The
    middle runs to the end of the cursor's line (half the samples), to the end
    of a line 1-8 lines further (a quarter), or to a later cursor position (a
    quarter). Editors ask for the rest of a line with the text after it as
    suffix, after the prompt's last token was healed away (engine/prompts.py);
    middles cut at random characters taught a small model to continue
    mid-word and to run on across lines instead.
    """
    cursors = cursors or range(len(text) + 1)
    i = rng.randrange(len(cursors))
    start, shape = cursors[i], rng.random()
    if shape < 0.75:
        end = _line_end(text, start)
        if shape >= 0.5:  # and a few lines more
            for _ in range(rng.randint(1, 8)):
                end = _line_end(text, end + 1) if end < len(text) else end
    else:
        end = cursors[rng.randrange(i, len(cursors))]
    return text[:start], text[start:end], text[end:]


def _line_end(text: str, start: int) -> int:
    end = text.find("\n", start)
    return len(text) if end < 0 else end


def token_starts(encoding, text: str) -> list[int] | None:
    """Sorted character positions where `encoding`'s tokens of `text` start, and its end
    (None when the encoder gives no offsets)."""
    offsets = getattr(encoding, "offsets", None)
    if not offsets:
        return None
    return sorted({start for start, _ in offsets if start < len(text)} | {len(text)})


def fim_ids(tok, prefix: str, middle: str, suffix: str, order: str = "psm") -> list[int]:
    """The FIM sample's ids, each part tokenized on its own."""
    s = special_ids(tok)
    enc = tok.encode_batch([prefix, suffix, middle], add_special_tokens=False)
    return _fim_sample(s, order, enc[0].ids, enc[1].ids, enc[2].ids)


def _fim_sample(s: dict[str, int], order: str, prefix: list[int], suffix: list[int],
                middle: list[int]) -> list[int]:
    """PSM: <PRE> prefix <SUF> suffix <MID> middle. SPM: <PRE> <SUF> suffix <MID> prefix
    middle, where the middle continues the prefix as in plain text, so what a small model
    learns from plain text carries over (in PSM the middle's start must be found across
    the whole suffix)."""
    if order == "spm":
        return [s[FIM_PREFIX], s[FIM_SUFFIX], *suffix, s[FIM_MIDDLE], *prefix, *middle, s[EOS]]
    return [s[FIM_PREFIX], *prefix, s[FIM_SUFFIX], *suffix, s[FIM_MIDDLE], *middle, s[EOS]]


def split_lines(text: str, max_chars: int) -> list[str]:
    """Cut `text` at line breaks into pieces of at most ~max_chars characters."""
    pieces: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        if current and size + len(line) > max_chars:
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        pieces.append("".join(current))
    return pieces


def build_stream(tok, texts: list[str], seq_len: int, fim_rate: float = 0.5, seed: int = 0,
                 eos_id: int | None = None, fim_order: str = "psm") -> np.ndarray:
    """Tokenize, FIM-transform and concatenate every text (uint16/int32 ids).

    `tok` is a `tokenizers.Tokenizer` (or anything with encode/encode_batch
    returning objects with `.ids`, token_to_id and get_vocab_size). FIM needs
    its three special tokens; `eos_id` defaults to `<|endoftext|>`'s id.
    """
    s = {name: tok.token_to_id(name) for name in (EOS, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE)}
    if eos_id is not None:
        s[EOS] = eos_id
    if s[EOS] is None:
        raise ValueError("no end-of-text token id")
    if fim_rate > 0 and None in (s[FIM_PREFIX], s[FIM_SUFFIX], s[FIM_MIDDLE]):
        raise ValueError("fill-in-the-middle needs <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> tokens")
    sample = "".join(texts)[:200_000]
    chars_per_token = max(1.0, len(sample) / max(1, len(tok.encode(sample).ids)))
    max_chars = max(16, int(seq_len * chars_per_token * 0.8))
    rng = random.Random(seed)
    pieces = [(piece, j == len(split) - 1) for text in texts for split in [split_lines(text, max_chars)]
              for j, piece in enumerate(split)]
    is_fim = [rng.random() < fim_rate and len(piece) > 1 for piece, _ in pieces]
    fim_pieces = [piece for (piece, _), fim in zip(pieces, is_fim) if fim]
    cursors = iter([token_starts(e, piece) for e, piece in
                    zip(tok.encode_batch(fim_pieces, add_special_tokens=False), fim_pieces)])
    strings: list[str] = []
    plan: list[tuple[str, int]] = []  # ("plain"|"plain_eos"|"fim", first string index)
    for (piece, last), fim in zip(pieces, is_fim):
        if fim:
            prefix, middle, suffix = fim_split(piece, rng, next(cursors))
            plan.append(("fim", len(strings)))
            strings += [prefix, suffix, middle]
        else:
            plan.append(("plain_eos" if last else "plain", len(strings)))
            strings.append(piece)
    encoded = [e.ids for e in tok.encode_batch(strings, add_special_tokens=False)]
    out: list[int] = []
    for kind, i in plan:
        if kind == "fim":
            out += _fim_sample(s, fim_order, encoded[i], encoded[i + 1], encoded[i + 2])
        else:
            out += encoded[i]
            if kind == "plain_eos":
                out.append(s[EOS])
    dtype = np.uint16 if max(out, default=0) < 65536 else np.int32
    return np.asarray(out, dtype=dtype)


@dataclass
class Batches:
    """Seeded, resumable batches of windows [batch, seq_len + 1] from a stream."""

    stream: np.ndarray
    seq_len: int
    batch: int
    seed: int = 0

    def __post_init__(self) -> None:
        self.n_windows = (len(self.stream) - 1) // self.seq_len
        if self.n_windows < 1:
            raise ValueError(f"corpus too small: {len(self.stream)} tokens for one window of {self.seq_len + 1}")
        self._perms: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)}
        return self._perms[epoch]

    def window(self, position: int) -> np.ndarray:
        epoch, i = divmod(position, self.n_windows)
        start = int(self._order(epoch)[i]) * self.seq_len
        return self.stream[start : start + self.seq_len + 1]

    def get(self, position: int) -> np.ndarray:
        """The batch starting at data position `position` (windows consumed so far)."""
        return np.stack([self.window(position + j) for j in range(self.batch)]).astype(np.int32)
