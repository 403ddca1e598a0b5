"""A GGUF file's tokenizer as Hugging Face tokenizer files (tokenizer.json and
tokenizer_config.json with the chat template).

transformers' GGUF tokenizer converter builds the vocabulary, the merges (derived
from the scores where a sentencepiece file has none) and the special tokens. What it
leaves to guesswork is how text is split before the merges run: llama.cpp names that
in `tokenizer.ggml.pre`, and its tokenizer defines each name by a list of regular
expressions applied in turn (PRE_TOKENIZER_SPLITS, written out here from llama.cpp's
definitions for the families mtplxd imports). A wrong split keeps most text right and
breaks digits or contractions, so an unknown name is refused rather than guessed.

Control tokens (type 3 in `tokenizer.ggml.token_type`, e.g. `<|im_start|>`) stay single
special tokens; user-defined ones (type 4) single plain tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.checkpoint import GGUFError

if TYPE_CHECKING:
    from engine.gguf_import import GGUFPlan

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` -> the regular expressions llama.cpp splits with, in order.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,),
    "gpt-2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
}


def tokenizer_files(plan: "GGUFPlan") -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json object)."""
    from tokenizers import Regex, pre_tokenizers, processors
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    md = plan.metadata
    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{plan.path}: no tokenizer in the metadata (tokenizer.ggml.tokens)")
    if kind not in ("gpt2", "llama"):
        raise GGUFError(f"{plan.path}: tokenizer model {kind!r} is not supported (gpt2 and llama are)")
    source = {
        "tokenizer_type": kind,
        "pre_tokenizer_type": md.get("tokenizer.ggml.pre"),
        "tokens": tokens,
        "token_type": md.get("tokenizer.ggml.token_type"),
        **{name: md[f"tokenizer.ggml.{key}"] for key, name in (
            ("scores", "scores"), ("merges", "merges"), ("add_space_prefix", "add_prefix_space"),
        ) if f"tokenizer.ggml.{key}" in md},
    }
    try:
        tokenizer, _ = convert_gguf_tokenizer(plan.architecture, source)
    except (ValueError, KeyError, IndexError) as e:
        raise GGUFError(f"{plan.path}: cannot build its tokenizer ({' '.join(str(e).split())})")
    if kind == "gpt2":
        pre = md.get("tokenizer.ggml.pre") or "default"
        if pre not in PRE_TOKENIZER_SPLITS:
            raise GGUFError(f"{plan.path}: pre-tokenizer {pre!r} is not known to mtplxd "
                            f"(known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))})")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(expr), behavior="isolated") for expr in PRE_TOKENIZER_SPLITS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    bos = _token(md, tokens, "bos_token_id")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, md["tokenizer.ggml.bos_token_id"])])
    elif kind == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(plan.config.get("max_position_embeddings", 4096)),
        "add_bos_token": add_bos,
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": bos,
        "eos_token": _token(md, tokens, "eos_token_id"),
        "unk_token": _token(md, tokens, "unknown_token_id"),
        "pad_token": _token(md, tokens, "padding_token_id"),
    }
    template = md.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tokenizer.to_str(), {k: v for k, v in config.items() if v is not None}


def _token(md: dict[str, Any], tokens: list[str], key: str) -> str | None:
    index = md.get(f"tokenizer.ggml.{key}")
    return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None
