"""OpenAI request parsing and validation: JSON bodies in, scheduler requests out.

Every problem a client can cause becomes an `ApiError` that the app renders
in OpenAI's error shape, with `param` naming the offending field, so
openai-python raises the matching exception (BadRequestError, ...).
Unsupported OpenAI features are refused explicitly rather than ignored, so a
client never silently gets something other than what it asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from engine.profiles import PROFILE_NAMES
from engine.prompts import Heal, completion_prompt_ids, healed_fim_prompt_ids
from engine.sampler_settings import SamplerSettings
from adapters.common.errors import ApiError, bad
from mtplxd.requests import EmbedRequest, Priority, TextRequest
from mtplxd.runtime import ModelInfo

if TYPE_CHECKING:  # imported for annotations only: both modules import this one
    from adapters.common.chat_turn import ChatTurn
    from adapters.common.json_output import ResponseFormat

DEFAULT_MAX_TOKENS = 512
MAX_STOPS = 4  # OpenAI's limit
MAX_EMBED_INPUTS = 2048  # OpenAI's limit
DEFAULT_MODEL_ALIAS = "default"  # accepted besides the loaded model's id
@dataclass(frozen=True)
class TextParams:
    request: TextRequest
    stream: bool
    include_usage: bool
    turn: ChatTurn | None = None  # chat: how to read the reply (reasoning, tool calls)
    response_format: ResponseFormat | None = None  # chat: JSON to check the answer against
    token_marks: bool = False  # extension: stream chunks say how each token was produced


# -- reading fields ----------------------------------------------------------------


MAX_JSON_DEPTH = 100  # the deepest tool schemas nest a few dozen levels


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object (RFC 8259: UTF-8, no NaN or Infinity), or a 400
    saying what is wrong with it. Depth is bounded, and every string must be
    encodable text (an escaped lone surrogate is not), so nothing downstream fails on it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not UTF-8 text: {e.reason} at byte {e.start}") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark, which RFC 8259 lets parsers ignore
    if not text.strip():
        raise bad("the request body is empty: send a JSON object")
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_json_type(body)}")
    _check_tree(body)
    return body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_tree(body: Any) -> None:
    pending = [(body, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key)
                pending.append((item, depth + 1))
        elif isinstance(value, list):
            pending.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            _check_text(value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"the request body holds an escaped lone surrogate (\\u{ord(text[e.start]):04x}), "
                  "which is not text") from None


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def get_int(body: dict, name: str, default: int | None = None, lo: int | None = None,
            hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"`{name}` must be an integer, got {type(value).__name__}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad(f"`{name}` must be {bounds}, got {value}", name)
    return value


def get_float(body: dict, name: str, default: float | None, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"`{name}` must be a number, got {type(value).__name__}", name)
    if not lo <= value <= hi:  # also rejects NaN
        raise bad(f"`{name}` must be in [{lo}, {hi}], got {value}", name)
    return float(value)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"`{name}` must be a boolean, got {type(value).__name__}", name)
    return value


def get_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad(f"`{name}` must be a string, got {type(value).__name__}", name)
    return value


def check_model(body: dict, model_id: str) -> None:
    """Accept the loaded model's id and "default"; a missing model means the loaded one."""
    name = get_str(body, "model")
    if name is not None and name not in (model_id, DEFAULT_MODEL_ALIAS):
        raise ApiError(404, f"the model {name!r} does not exist; this daemon serves {model_id!r}",
                       param="model", code="model_not_found")


def parse_priority(header: str | None) -> Priority:
    if header is None:
        return Priority.NORMAL
    try:
        return Priority[header.strip().upper()]
    except KeyError:
        raise bad("X-Mtplx-Priority must be interactive, normal or background") from None


# -- text generation -----------------------------------------------------------------


def parse_completion(body: dict, model: ModelInfo, priority: Priority) -> TextParams:
    check_model(body, model.id)
    if get_bool(body, "echo"):
        raise bad("`echo` is not supported", "echo")
    if get_int(body, "best_of", 1) != 1:
        raise bad("`best_of` must be 1", "best_of")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict)
                                        or response_format.get("type") != "text"):
        raise bad("/v1/completions supports only response_format {'type': 'text'}", "response_format")
    prompt, heal = _completion_prompt(body, model)
    return text_params(body, model, prompt, "prompt", priority, continuation=True, heal=heal)


def _completion_prompt(body: dict, model: ModelInfo) -> tuple[list[int], Heal | None]:
    """The prompt's ids; with a `suffix` (fill-in-the-middle, as editors ask at a cursor)
    the prefix's last token is healed (engine/prompts.py)."""
    prompt, suffix = body.get("prompt"), get_str(body, "suffix")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise bad("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):  # token ids
        if suffix is not None:
            raise bad("`suffix` needs a string prompt", "suffix")
        return _token_ids(prompt, model, "prompt"), None
    if not isinstance(prompt, str):
        raise bad("`prompt` must be a string, a list of one string, or a list of token ids", "prompt")
    if suffix is None:
        return completion_prompt_ids(model.tokenizer, prompt), None
    try:
        return healed_fim_prompt_ids(model.tokenizer, prompt, suffix)
    except ValueError as e:
        raise bad(str(e), "suffix") from None


def _token_ids(value: Any, model: ModelInfo, param: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad(f"`{param}` token arrays must be lists of integers", param)
    if any(not 0 <= t < model.vocab_size for t in value):
        raise bad(f"`{param}` holds a token id outside [0, {model.vocab_size})", param)
    return value


def text_params(body: dict, model: ModelInfo, prompt: list[int], prompt_param: str,
                priority: Priority, continuation: bool = False, heal: Heal | None = None) -> TextParams:
    _refuse_unsupported(body)
    if get_int(body, "n", 1) != 1:
        raise bad("only n=1 is supported", "n")
    if not prompt:
        raise bad("the prompt is empty", prompt_param)
    stream = get_bool(body, "stream")
    mode, profile = decode_extensions(body)
    request = TextRequest(
        prompt_ids=tuple(prompt),
        max_tokens=_max_tokens(body, model, len(prompt), prompt_param),
        sampler=_sampler(body, model),
        mode=mode,
        profile=profile,
        depth=get_int(body, "depth", model.default_depth, 1, max(model.depth_max, 1)),
        seed=_seed(body),
        stop=_stops(body),
        priority=priority,
        # Extension, as in other local servers: fixed-length outputs for benchmarks.
        ignore_eos=get_bool(body, "ignore_eos"),
        continuation=continuation,
        heal=heal,
    )
    get_str(body, "user")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad("`metadata` must be an object", "metadata")
    token_marks = get_bool(body, "token_marks")
    if token_marks and not stream:
        raise bad("`token_marks` needs `stream: true` (the marks ride on the stream's chunks)", "token_marks")
    return TextParams(request, stream, _include_usage(body, stream), token_marks=token_marks)


def decode_extensions(body: dict) -> tuple[Literal["ar", "mtp"] | None, str | None]:
    """This daemon's request extensions `generation_mode` ("mtp" | "ar") and `profile`
    (engine/profiles.py). Unset, the daemon's profile and its measurement decide."""
    mode = body.get("generation_mode")
    if mode is not None and mode not in ("mtp", "ar"):
        raise bad("`generation_mode` must be 'mtp' or 'ar'", "generation_mode")
    profile = body.get("profile")
    if profile is not None and profile not in PROFILE_NAMES:
        raise bad(f"`profile` must be one of {', '.join(PROFILE_NAMES)}", "profile")
    return mode, profile


def _max_tokens(body: dict, model: ModelInfo, prompt_len: int, prompt_param: str) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    wanted = get_int(body, name, None, 1)
    room = model.context_length - prompt_len
    if room < 1 or (wanted is not None and wanted > room):
        asked = f" + {wanted} tokens to generate" if wanted is not None else ""
        raise bad(f"this model's context length is {model.context_length} tokens; the prompt has "
                  f"{prompt_len}{asked}", name if room >= 1 else prompt_param, "context_length_exceeded")
    return wanted if wanted is not None else min(DEFAULT_MAX_TOKENS, room)


def _sampler(body: dict, model: ModelInfo) -> SamplerSettings:
    top_k = get_int(body, "top_k", None, -1)
    min_p = get_float(body, "min_p", None, 0.0, 0.999999)
    return model.sampler(
        temperature=get_float(body, "temperature", None, 0.0, 2.0),
        top_p=_top_p(body),
        top_k=None if top_k is None else max(top_k, 0),  # -1 is the common spelling of "off"
        min_p=0.0 if min_p is None else min_p,
    )


def _top_p(body: dict) -> float | None:
    top_p = get_float(body, "top_p", None, 0.0, 1.0)
    if top_p == 0:
        raise bad("`top_p` must be greater than 0 (use temperature 0 for greedy decoding)", "top_p")
    return top_p


def _seed(body: dict) -> int | None:
    seed = get_int(body, "seed", None, -(2**63), 2**64 - 1)
    return None if seed is None else seed % 2**64  # negative seeds wrap, as in int64 -> uint64


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("`stop` must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"`stop` may hold at most {MAX_STOPS} strings", "stop")
    return tuple(s for s in stops if s)


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad("`stream_options` must be an object", "stream_options")
    if not stream:
        raise bad("`stream_options` is only allowed when `stream` is true", "stream_options")
    return get_bool(options, "include_usage")


def _refuse_unsupported(body: dict) -> None:
    """Features this daemon does not implement, refused when actually asked for."""
    for name in ("presence_penalty", "frequency_penalty"):
        if get_float(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad(f"`{name}` is not supported", name)
    if body.get("logit_bias"):
        raise bad("`logit_bias` is not supported", "logit_bias")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False, 0) or body.get("top_logprobs"):
        raise bad("`logprobs` is not supported", "logprobs")


# -- embeddings ----------------------------------------------------------------------


def parse_embeddings(body: dict, model: ModelInfo, priority: Priority) -> tuple[EmbedRequest, str]:
    check_model(body, model.id)
    inputs = _embed_inputs(body.get("input"), model)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad("`encoding_format` must be 'float' or 'base64'", "encoding_format")
    dimensions = get_int(body, "dimensions", None, 1)
    if dimensions is not None and dimensions != model.hidden_size:
        raise bad(f"this model's embeddings have {model.hidden_size} dimensions and cannot be "
                  f"shortened; omit `dimensions` or pass {model.hidden_size}", "dimensions")
    get_str(body, "user")
    return EmbedRequest(tuple(tuple(ids) for ids in inputs), priority), encoding


def _embed_inputs(value: Any, model: ModelInfo) -> list[list[int]]:
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad("`input` must be a non-empty string, list of strings, or token arrays", "input")
    if len(value) > MAX_EMBED_INPUTS:
        raise bad(f"`input` may hold at most {MAX_EMBED_INPUTS} items", "input")
    inputs = []
    for item in value:
        ids = model.tokenizer.encode(item) if isinstance(item, str) else _token_ids(item, model, "input")
        if not ids:
            raise bad("`input` items must not be empty", "input")
        if len(ids) > model.context_length:
            raise bad(f"an input has {len(ids)} tokens; this model's context length is "
                      f"{model.context_length}", "input", "context_length_exceeded")
        inputs.append(list(ids))
    return inputs
