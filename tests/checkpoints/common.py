"""Helpers to write tiny checkpoints in real Hugging Face layout.

A checkpoint folder holds config.json, one or more safetensors files with
the real key names, and a small character-level tokenizer (tokenizer.json +
tokenizer_config.json) that transformers' AutoTokenizer loads.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Sequence

import numpy as np
from safetensors.numpy import save_file

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|fim_prefix|>",
    "<|fim_suffix|>",
    "<|fim_middle|>",
    "<|im_start|>",
    "<|im_end|>",
]
# ChatML, as Qwen-family tokenizers carry it.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHARS = list(string.ascii_lowercase + string.digits + " \n_():=.,+-*[]'\"#")
# The tools variant (tests/checkpoints/tools.py) also writes JSON, tags and capitals.
TOOL_CHARS = CHARS + list(string.ascii_uppercase + "{}<>/|!?;&%$@^~`\\")
# Tool-call and reasoning markers: added tokens, not special (they are part of the text,
# as in Qwen's tokenizers).
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


def tokenizer_vocab_size(n_chars: int = len(CHARS)) -> int:
    return len(SPECIAL_TOKENS) + 1 + n_chars  # + <unk>


def write_tokenizer(folder: Path, n_chars: int = len(CHARS), *, chars: list[str] | None = None,
                    added: Sequence[str] = (), chat_template: str = CHAT_TEMPLATE, split: str = ".") -> int:
    """A character-level tokenizer with FIM and chat special tokens; returns its size.

    `n_chars` keeps only the first characters: a smaller vocabulary makes
    exact enumeration of output distributions cheap in tests. `chars` replaces
    the character set, `added` adds (non-special) multi-character tokens. `split`
    is the pre-tokenizer's pattern for one character ("." leaves runs of newlines
    whole, and unknown; the tools variant uses "[\\s\\S]").
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ["<unk>"] + (chars or CHARS[:n_chars]))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        unk_token="<unk>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(folder))
    return len(fast)


def write_config(folder: Path, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def save_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    save_file(
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
        str(path),
        metadata={"format": "pt"},
    )


class RandomWeights:
    """Seeded random float32 tensors, scaled so tiny models stay well conditioned."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def matrix(self, rows: int, cols: int) -> np.ndarray:
        return self.rng.normal(0.0, cols**-0.5, size=(rows, cols))

    def vector(self, n: int, scale: float = 0.02) -> np.ndarray:
        return self.rng.normal(0.0, scale, size=(n,))

    def norm(self, n: int, zero_centred: bool = False) -> np.ndarray:
        base = 0.0 if zero_centred else 1.0
        return base + self.rng.normal(0.0, 0.1, size=(n,))

    def like(self, shape: tuple[int, ...], scale: float = 0.1) -> np.ndarray:
        return self.rng.normal(0.0, scale, size=shape)


def drop_fim_tokens(folder: Path) -> Path:
    """Make a written checkpoint's tokenizer one without fill-in-the-middle tokens, as a
    Llama-family model's (SmolLM2): the FIM tokens are renamed to reserved names and keep
    their ids, so the vocabulary still fits the weights."""
    renamed = {name: f"<|reserved_{i}|>" for i, name in enumerate(SPECIAL_TOKENS) if "fim" in name}
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    for token in data["added_tokens"]:
        token["content"] = renamed.get(token["content"], token["content"])
    data["model"]["vocab"] = {renamed.get(name, name): i for name, i in data["model"]["vocab"].items()}
    path.write_text(json.dumps(data))
    config_path = folder / "tokenizer_config.json"  # some transformers versions list them here too
    config = json.loads(config_path.read_text())
    for token in config.get("added_tokens_decoder", {}).values():
        token["content"] = renamed.get(token["content"], token["content"])
    config_path.write_text(json.dumps(config))
    return folder
