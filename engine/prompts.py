"""Prompt token ids from the tokenizer's own templates: chat, fill-in-the-middle, and
prefix-only code completion for models without FIM tokens.

Everything here works on an mlx-lm TokenizerWrapper (or the Hugging Face
tokenizer it wraps) and plain Python values; no MLX, no asyncio, so adapters
can call it on their side of the queue. Every problem a client can cause is a
ValueError with a message fit to show that client.
"""

from __future__ import annotations

import bisect
import json
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

from jinja2 import TemplateError

from engine.tool_prompts import hermes_messages, template_knows_tools, uses_tools

# Roles every chat template understands. "developer" is OpenAI's newer name for
# "system"; most templates only know the latter, so it is renamed.
CHAT_ROLES = ("system", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}

# FIM triples by naming scheme, in the order they are tried. Each is
# (prefix, suffix, middle); the prompt is laid out prefix-suffix-middle (PSM) unless
# the checkpoint's tokenizer_config.json says "fim_order": "spm".
FIM_SCHEMES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen, StarCoder 2, DeepSeek-style
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("<PRE>", "<SUF>", "<MID>"),  # Code Llama
    ("▁<PRE>", "▁<SUF>", "▁<MID>"),  # Code Llama's SentencePiece spelling
)


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    order: str = "psm"  # or "spm", as the model was trained (engine/training/data.py)
    reads_suffix: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return f"fim-{self.order}"

    def layout(self, prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
        """The prompt after which the model writes the middle."""
        if self.order == "spm":
            return [self.prefix, self.suffix, *suffix_ids, self.middle, *prefix_ids]
        return [self.prefix, *prefix_ids, self.suffix, *suffix_ids, self.middle]


@dataclass(frozen=True)
class PrefixOnly:
    """The layout of a model without FIM tokens (SmolLM2, most Llama-family models): it
    continues the text before the cursor, and the suffix is left out. What follows the
    cursor still bounds the completion, as callers that know it read it from the
    document (adapters/lsp/postprocess.py stops at the line below the cursor)."""

    order: ClassVar[str] = "prefix-only"
    name: ClassVar[str] = "prefix-only"
    reads_suffix: ClassVar[bool] = False

    def layout(self, prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
        return list(prefix_ids)


# -- chat ------------------------------------------------------------------------


def message_text(content: Any) -> str:
    """A message's content as one string: a string, None, or a list of text parts."""
    if content is None:  # an assistant turn that only carried tool calls
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("content must be a string or a list of content parts")
    texts = []
    for part in content:
        kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise ValueError(f"content parts of type {kind!r} are not supported: only text parts are")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string `text`")
        texts.append(part["text"])
    return "".join(texts)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and reduce them to {role, content} strings, keeping
    an assistant turn's `tool_calls` (arguments as objects, as chat templates expect
    them) and a tool turn's `tool_call_id` / `name`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role: Any = message.get("role")
        role = _ROLE_ALIASES.get(role, role)
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)} or developer")
        try:
            out.append({"role": role, "content": message_text(message.get("content")), **_tool_fields(role, message)})
        except ValueError as e:
            raise ValueError(f"messages[{i}]: {e}") from None
    return out


def _tool_fields(role: str, message: dict) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if role == "assistant" and message.get("tool_calls"):
        fields["tool_calls"] = tool_calls_for_template(message["tool_calls"])
    if role == "tool":
        for name in ("tool_call_id", "name"):
            value = message.get(name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"`{name}` must be a string")
            if value is not None:
                fields[name] = value
    return fields


def tool_calls_for_template(calls: Any) -> list[dict[str, Any]]:
    """OpenAI `tool_calls` checked, with `function.arguments` parsed from its JSON string."""
    if not isinstance(calls, list):
        raise ValueError("`tool_calls` must be a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tool_calls[{j}] needs a `function` with a `name`")
        if call.get("type", "function") != "function":
            raise ValueError(f"tool_calls[{j}].type must be 'function'")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise ValueError(f"tool_calls[{j}].function.arguments is not valid JSON") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"tool_calls[{j}].function.arguments must be a JSON object")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ValueError(f"tool_calls[{j}].id must be a string")
        out.append({"id": call_id or f"call_{j}", "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def has_chat_template(tokenizer: Any) -> bool:
    flag = getattr(tokenizer, "has_chat_template", None)
    if isinstance(flag, bool):
        return flag
    return getattr(tokenizer, "chat_template", None) is not None


def chat_prompt_text(tokenizer: Any, messages: Any, tools: list[dict] | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> str:
    """`messages` (and `tools`, OpenAI form) rendered by the model's chat template, ready
    for the assistant's reply (add_generation_prompt=True). A template that knows no tools
    gets them the Hermes way (engine/tool_prompts.py)."""
    if not has_chat_template(tokenizer):
        raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
    normalized = normalize_messages(messages)
    kwargs = dict(template_kwargs or {})
    if tools or uses_tools(normalized):
        if template_knows_tools(tokenizer):
            if tools:
                kwargs["tools"] = tools
        else:
            normalized = hermes_messages(normalized, tools or [])
    try:
        return tokenizer.apply_chat_template(normalized, add_generation_prompt=True, tokenize=False, **kwargs)
    except TemplateError as e:  # the template's own checks (roles must alternate, ...)
        raise ValueError(f"the chat template rejected the messages: {e}") from None


def chat_prompt_ids(tokenizer: Any, messages: Any, tools: list[dict] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of `chat_prompt_text`."""
    # Rendering to text, then encoding without extra special tokens, is the one
    # form every transformers version agrees on (tokenize=True returns a list in
    # some versions and a BatchEncoding in others). The template writes its own BOS.
    text = chat_prompt_text(tokenizer, messages, tools, template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


# -- plain completions and fill-in-the-middle ------------------------------------


def completion_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """A raw prompt, with whatever the tokenizer adds at the start (its BOS)."""
    return list(tokenizer.encode(text))


_fim_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fim_tokens(tokenizer: Any) -> FimTokens:
    """The tokenizer's own FIM special tokens; ValueError when it has none."""
    try:
        cached = _fim_cache.get(tokenizer)
    except TypeError:  # not weak-referenceable: look it up every time
        cached = None
    if cached is None:
        cached = _find_fim(tokenizer)
        try:
            _fim_cache[tokenizer] = cached
        except TypeError:
            pass
    if isinstance(cached, str):
        raise ValueError(cached)
    return cached


def _find_fim(tokenizer: Any) -> FimTokens | str:
    """Look in the added tokens first (cheap, and where FIM tokens live in
    tokenizer.json), then in the whole vocabulary (Code Llama keeps them there)."""
    for vocab in (_added_vocab(tokenizer), _full_vocab(tokenizer)):
        for names in FIM_SCHEMES:
            if all(name in vocab for name in names):
                prefix, suffix, middle = (vocab[name] for name in names)
                return FimTokens(prefix=prefix, suffix=suffix, middle=middle, order=_fim_order(tokenizer))
    return "this model's tokenizer has no fill-in-the-middle tokens, so `suffix` is not supported"


def _fim_order(tokenizer: Any) -> str:
    """The FIM order tokenizer_config.json names (transformers keeps unknown keys in init_kwargs)."""
    order = (getattr(tokenizer, "init_kwargs", None) or {}).get("fim_order", "psm")
    return "spm" if order == "spm" else "psm"


def _added_vocab(tokenizer: Any) -> dict[str, int]:
    get = getattr(tokenizer, "get_added_vocab", None)
    return dict(get()) if callable(get) else {}


def _full_vocab(tokenizer: Any) -> dict[str, int]:
    get = getattr(tokenizer, "get_vocab", None)
    return dict(get()) if callable(get) else {}


def fim_prompt_ids(tokenizer: Any, prefix: str, suffix: str) -> list[int]:
    """prefix-suffix-middle: <PRE> prefix <SUF> suffix <MID>; the model writes the middle.

    The pieces are encoded separately and joined as ids, so text that merely
    looks like a FIM token cannot move the boundaries.
    """
    return healed_fim_prompt_ids(tokenizer, prefix, suffix, heal=False)[0]


def healed_fim_prompt_ids(tokenizer: Any, prefix: str, suffix: str, heal: bool = True) -> tuple[list[int], Heal | None]:
    """`fim_prompt_ids` with the prefix's last token healed (see heal_last_token)."""
    return _cursor_prompt(tokenizer, fim_tokens(tokenizer), prefix, suffix, heal)


def completion_layout(tokenizer: Any) -> FimTokens | PrefixOnly:
    """How code at a cursor is prompted: the model's FIM tokens, else PrefixOnly."""
    try:
        return fim_tokens(tokenizer)
    except ValueError:
        return PrefixOnly()


def cursor_prompt_ids(tokenizer: Any, prefix: str, suffix: str, heal: bool = True) -> tuple[list[int], Heal | None]:
    """`healed_fim_prompt_ids` where the model has FIM tokens, else the prefix alone (its
    last token healed all the same): for callers that complete code at a cursor whatever
    the model. /v1/completions does not: a `suffix` it cannot show is a client error."""
    return _cursor_prompt(tokenizer, completion_layout(tokenizer), prefix, suffix, heal)


def _cursor_prompt(tokenizer: Any, layout: FimTokens | PrefixOnly, prefix: str, suffix: str,
                   heal: bool) -> tuple[list[int], Heal | None]:
    prefix_ids, healed = _encode_plain(tokenizer, prefix), None
    if heal:
        prefix_ids, healed = heal_last_token(tokenizer, prefix_ids)
    suffix_ids = _encode_plain(tokenizer, suffix) if layout.reads_suffix else []
    return [*leading_special(tokenizer), *layout.layout(prefix_ids, suffix_ids)], healed


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def leading_special(tokenizer: Any) -> list[int]:
    """The BOS the tokenizer puts before text, if it puts one (Code Llama does, Qwen does not)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    ids = list(tokenizer.encode("a"))
    return [bos] if ids and ids[0] == bos else []


# -- token healing -------------------------------------------------------------------
# A prompt cut at the cursor often ends inside what the tokenizer would spell as one
# token: after "def " the lone " " is a token byte-level BPE never puts before a name
# (it spells " name"), so the model, seeing it, goes astray. Healing drops the
# prompt's last token and lets the first generated token be any that begins with its
# text: " name" (or " " itself) after "def ", "print" after "pri". The text the
# dropped token stood for is then not repeated to the client (mtplxd/jobs.py).


@dataclass(frozen=True)
class Heal:
    text: str  # what the dropped last token spelled: the output starts with it
    first_tokens: frozenset[int]  # the tokens the first generated one may be


def heal_last_token(tokenizer: Any, ids: list[int]) -> tuple[list[int], Heal | None]:
    """`ids` without their last token, and what the first generated token must then
    begin with; `ids` unchanged and None where there is nothing to heal (no ids, or a
    last token whose text no token begins with, as a special token's or a piece of a
    UTF-8 character's)."""
    if not ids:
        return ids, None
    text = tokenizer.decode([ids[-1]])
    if "\ufffd" in text:  # a piece of a UTF-8 character: its text says nothing of its bytes
        return ids, None
    allowed = tokens_starting_with(tokenizer, text) if text else frozenset()
    if ids[-1] not in allowed:
        return ids, None
    return ids[:-1], Heal(text, allowed)


_token_index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokens_starting_with(tokenizer: Any, text: str) -> frozenset[int]:
    """Every ordinary token whose text begins with `text` (a prefix range of the
    vocabulary sorted by text, built once per tokenizer)."""
    try:
        index = _token_index.get(tokenizer)
    except TypeError:
        index = None
    if index is None:
        special = set(getattr(tokenizer, "all_special_ids", ()))
        ids = [i for i in range(len(tokenizer.vocab)) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in ids])
        index = sorted(zip(texts, ids))
        try:
            _token_index[tokenizer] = index
        except TypeError:
            pass
    start = bisect.bisect_left(index, (text,))
    end = bisect.bisect_left(index, (text + "\U0010ffff",))
    return frozenset(token for _, token in index[start:end])
