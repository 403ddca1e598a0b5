"""A byte-level BPE tokenizer trained on the corpus, saved in Hugging Face layout.

tokenizer.json + tokenizer_config.json (PreTrainedTokenizerFast, eos
`<|endoftext|>`, a ChatML chat template): AutoTokenizer and mlx-lm load it
without remote code. FIM and chat markers are special tokens, one id each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

EOS = "<|endoftext|>"
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Pre-tokenization for source code: letters with at most one leading
# non-letter (" def", ".append", "_name"), digits one by one, punctuation runs
# with the line breaks after them, line breaks with the blanks before them,
# and runs of blanks that leave their last space to the next word (indents).
SPLIT_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """Train a byte-level BPE (a `tokenizers.Tokenizer`) on `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab size {vocab_size} is below 256 bytes + {len(SPECIAL_TOKENS)} special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, folder: Path, model_max_length: int = 2048, fim_order: str = "psm") -> None:
    """Write tokenizer.json, tokenizer_config.json (and the chat template; `fim_order`
    when it is not the usual prefix-suffix-middle)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    # Portable across transformers 4.x and 5.x: the class name both know and
    # the chat template inside tokenizer_config.json (older versions read
    # only that; a separate chat_template.jinja would take precedence).
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config["additional_special_tokens"] = SPECIAL_TOKENS[1:]
    config.pop("backend", None)
    if fim_order != "psm":
        config["fim_order"] = fim_order
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def load_tokenizer(folder: Path):
    """The raw `tokenizers.Tokenizer` saved in `folder` (fast batch encoding)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def special_ids(tok) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}")
    return ids
