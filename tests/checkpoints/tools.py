"""Tool-calling test checkpoints: a tools-aware chat template and a model that follows a script.

`write_tokenizer(folder)` writes the character-level test tokenizer with JSON
characters, Qwen's tool-call and think markers as (non-special) added tokens
and TOOLS_CHAT_TEMPLATE: ChatML in the Hermes / Qwen way (tools in the system
turn, calls as <tool_call> JSON, results as <tool_response> in user turns,
`enable_thinking=False` closing an empty think block, `think_in_prompt=True`
opening one, as reasoning templates do). Transformers renders templates with
trim_blocks, so a newline right after a block tag is written as {{ '\\n' }}.

`write_checkpoint(folder, script)` writes a tiny MiMo model (with an MTP head)
that, after the prompt's last token "\\n" (where ChatML's generation prompt
ends), writes the tokens of `script` one after the other, then end-of-text.
It is a bigram model built by hand: attention and MLP outputs are zero, so the
last hidden state is the current token's embedding; each scripted token's
embedding is its own basis vector and the LM head maps it to the next
scripted token with a margin of about 57 logits, so any temperature up to 1
follows the script. Random MTP heads draft and the exact sampler rejects them:
the daemon's real decode path produces the scripted text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.checkpoints import mimo
from tests.checkpoints.common import (
    TOOL_CHARS, TOOL_TOKENS, RandomWeights, save_tensors, write_config,
)
from tests.checkpoints.common import write_tokenizer as write_char_tokenizer

TOOLS_CHAT_TEMPLATE = (
    "{% set system = messages[0].content if messages[0].role == 'system' else none %}"
    "{% if tools %}<|im_start|>system\n{% if system %}{{ system }}\n\n{% endif %}"
    "# Tools\n\nFunctions you may call, one JSON signature per line:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "To call one, answer <tool_call>\n{\"name\": <function name>, \"arguments\": <JSON object>}\n</tool_call>"
    "<|im_end|>\n"
    "{% elif system %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for call in m.tool_calls or [] %}{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% if think_in_prompt is defined and think_in_prompt %}<think>\n{% endif %}"
    "{% endif %}"
)
PROMPT_END = "\n"  # the last character of every generation prompt above
EOS = "<|endoftext|>"
# What the scripted model of the end-to-end tests says after any chat prompt: reasoning,
# then a Hermes call. The call's JSON is split where the named-tool prefill ends
# (adapters/common/tool_parsers.HermesParser.prefill), so a forced call continues the script.
WEATHER_SCRIPT = ["<think>", "the user wants the weather", "</think>", "<tool_call>",
                  '\n{"name": "get_weather", "arguments": ', '{"city": "paris"}}', "</tool_call>"]


def write_tokenizer(folder: Path, added: list[str] = (), chat_template: str = TOOLS_CHAT_TEMPLATE) -> int:
    """The tools tokenizer, with `added` multi-character tokens; returns its size."""
    extra = [t for t in added if t not in TOOL_TOKENS]
    return write_char_tokenizer(folder, chars=TOOL_CHARS, added=[*TOOL_TOKENS, *extra],
                                chat_template=chat_template, split=r"[\s\S]")


def write_checkpoint(folder: Path, script: list[str], *, mtp_heads: int = 1, seed: int = 0,
                     chat_template: str = TOOLS_CHAT_TEMPLATE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    multi = [t for t in script if len(t) > 1]
    vocab_size = write_tokenizer(folder, multi, chat_template)
    ids = _token_ids(folder)
    chain = [PROMPT_END, *script, EOS]
    if len(set(chain)) != len(chain) or len(chain) > mimo.D:
        raise ValueError(f"a script needs distinct tokens, at most {mimo.D - 2} of them")
    w = RandomWeights(seed)
    embed = w.like((vocab_size, mimo.D), 1.0)
    head = np.zeros((vocab_size, mimo.D))
    for dim, (token, following) in enumerate(zip(chain, chain[1:])):
        embed[ids[token]] = np.eye(mimo.D)[dim]
        head[ids[following], dim] = 10.0
    trunk = {"model.embed_tokens.weight": embed, "model.norm.weight": np.ones(mimo.D), "lm_head.weight": head}
    for layer in range(mimo.LAYERS):
        block = mimo.decoder_block(w, f"model.layers.{layer}.")
        block[f"model.layers.{layer}.self_attn.o_proj.weight"] *= 0.0  # the residual stream stays the embedding
        block[f"model.layers.{layer}.mlp.down_proj.weight"] *= 0.0
        trunk.update(block)
    heads = {k: v for i in range(mtp_heads) for k, v in mimo.mtp_layer(w, i).items()}
    save_tensors(folder / "model.safetensors", {**trunk, **heads})
    write_config(folder, mimo.config(vocab_size, mtp_heads))
    return folder


def _token_ids(folder: Path) -> dict[str, int]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return tokenizer.get_vocab()
