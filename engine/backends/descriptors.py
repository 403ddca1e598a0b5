"""The compatibility registry: which family a checkpoint is, how many MTP heads
it carries and which backend runs it.

Inspection reads config.json and safetensors headers only (never a tensor) and
imports neither a backend nor mlx-lm: backends are named by dotted path and
imported by whoever runs the model.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Collection, cast

from engine.checkpoint import CheckpointError, read_config, text_config, weight_keys

PLAIN_BACKEND = "engine.backends.plain"


@dataclass(frozen=True)
class SamplerDefaults:
    temperature: float
    top_p: float
    top_k: int = 0  # 0: no top-k filter


@dataclass(frozen=True)
class BackendDescriptor:
    """How to recognise one family's checkpoints and what runs them.

    head_key_patterns: where a head's weights sit; `{i}` is the head index,
    `{n+i}` an index counted after the trunk's `num_hidden_layers` layers.
    head_parts: keys every head must have under its prefix (a part ending in
    "." means "some key under it"). shared_parts: keys shared by all heads,
    beside the layers (under the pattern's text before `layers.{i}.`).
    depth_range: usable draft depths; a depth beyond the head count reuses
    the last head recurrently. norm_shift: zero-centred (Qwen) norms whose +1
    must be applied exactly once, the MTP norms included. own_trunk: the backend
    writes the trunk itself (mlx-lm has no model for it), so what mlx-lm can build
    does not matter, and without heads the family's own backend runs it AR-only.
    block_types_fields: config fields naming the blocks one head is made of
    (Nemotron-H: a list such as ["attention", "moe"] or a pattern string such as
    "*E"); a head then spans that many consecutive layers of the pattern:
    head_parts are then those of its first layer, last_parts those of its last,
    layer_parts those of every one. unsupported: why mtplxd cannot run the family
    yet (its heads are recognised and counted, and inspect says this instead of
    promising MTP or running AR in its place). check: the family's own test of
    a checkpoint's config and tensor names (pure Python: inspection never loads MLX),
    whose answer makes it `unsupported` with that reason.
    """

    family: str
    model_types: tuple[str, ...]
    backend_module: str
    head_count_fields: tuple[str, ...] = ()
    head_key_patterns: tuple[str, ...] = ()
    head_parts: tuple[str, ...] = ()
    shared_parts: tuple[str, ...] = ()
    sampler_defaults: SamplerDefaults = SamplerDefaults(0.7, 0.95)
    depth_range: tuple[int, int] = (1, 4)
    norm_shift: bool = False
    own_trunk: bool = False
    block_types_fields: tuple[str, ...] = ()
    last_parts: tuple[str, ...] = ()
    layer_parts: tuple[str, ...] = ()
    unsupported: str = ""
    # What in a checkpoint of the family the backend cannot run (config values, weight
    # formats), from its text config and tensor names; None: nothing.
    check: Callable[[dict[str, Any], Collection[str]], str | None] | None = None


_BLOCK = ("input_layernorm.weight", "self_attn.", "post_attention_layernorm.weight", "mlp.")
_NEXTN_PARTS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", *_BLOCK)
_QWEN_PATTERNS = ("mtp.layers.{i}.", "model.language_model.mtp.layers.{i}.", "language_model.mtp.layers.{i}.")
_QWEN_SHARED = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")
_NEXTN = "num_nextn_predict_layers"
# Nemotron-H's MTP blocks: the released configs list them (`mtp_layers_block_type`),
# older ones give a pattern string (`mtp_hybrid_override_pattern`, the trunk's
# `hybrid_override_pattern` alphabet); either field may hold either spelling.
_NEMOTRON_BLOCKS = ("mtp_layers_block_type", "mtp_hybrid_override_pattern")
NEMOTRON_DEFAULT_BLOCKS = ("attention", "moe")  # transformers' default for the field
_BLOCK_SYMBOLS = {"*": "attention", "E": "moe", "-": "mlp", "M": "mamba"}
_BLOCK_NAMES = {"attention": "attention", "full_attention": "attention", "moe": "moe", "mlp": "mlp",
                "mamba": "mamba", "linear_attention": "mamba"}
_QWEN_COUNT = "mtp_num_hidden_layers"


def _nextn(family: str, sampler: SamplerDefaults) -> BackendDescriptor:
    return BackendDescriptor(
        family, (family,), f"engine.backends.{family}", (_NEXTN,),
        ("model.layers.{n+i}.",), _NEXTN_PARTS, sampler_defaults=sampler,
    )


def _qwen(family: str, model_types: tuple[str, ...], sampler: SamplerDefaults) -> BackendDescriptor:
    return BackendDescriptor(
        family, model_types, f"engine.backends.{family}", (_QWEN_COUNT,), _QWEN_PATTERNS,
        _BLOCK, _QWEN_SHARED, sampler, norm_shift=True,
    )


def deepseek_v4_unsupported(config: dict[str, Any], keys: Collection[str] = ()) -> str | None:
    """What engine/backends/deepseek_v4.py does not implement in this checkpoint, or None."""
    problems = []
    if config.get("num_key_value_heads", 1) != 1:
        problems.append(f"num_key_value_heads={config['num_key_value_heads']} (one shared KV head is the design)")
    if config.get("n_shared_experts", 1) != 1:
        problems.append(f"n_shared_experts={config['n_shared_experts']} (the reference asserts 1)")
    if config.get("scoring_func", "sqrtsoftplus") not in ("sqrtsoftplus", "sigmoid", "softmax"):
        problems.append(f"scoring_func={config['scoring_func']!r}")
    if config.get("hidden_act", "silu") != "silu" or config.get("tie_word_embeddings"):
        problems.append("a non-silu activation or tied embeddings")
    ratios = config.get("compress_ratios")
    if not isinstance(ratios, list) or any(not isinstance(r, int) or r < 0 for r in ratios):
        problems.append(f"compress_ratios={ratios!r} (a list of one ratio per layer; "
                        "a config with layer_types instead is not read)")
    elif len(ratios) < config.get("num_hidden_layers", 0):
        problems.append(f"{len(ratios)} compress_ratios for {config.get('num_hidden_layers')} layers")
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("type", scaling.get("rope_type")) if isinstance(scaling, dict) else scaling
    if kind not in (None, "yarn", "default"):
        problems.append(f"rope_scaling type {kind!r} (DeepSeek-V4 uses YaRN)")
    scaled = sorted(k for k in keys if k.endswith(".scale"))
    if scaled:
        problems.append(f"FP8 / FP4 weights with per-block scales ({scaled[0]} and {len(scaled) - 1} more): "
                        "convert them to bfloat16 first")
    return "deepseek_v4: not implemented for " + "; ".join(problems) if problems else None


DESCRIPTORS: dict[str, BackendDescriptor] = {
    d.family: d
    for d in (
        BackendDescriptor(
            "mimo", ("mimo",), "engine.backends.mimo", (_NEXTN,), ("model.mtp_layers.{i}.",),
            ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
             "final_layernorm.weight", *_BLOCK),
            sampler_defaults=SamplerDefaults(0.6, 0.95),
        ),
        _nextn("deepseek_v3", SamplerDefaults(0.6, 0.95)),
        _nextn("glm4_moe", SamplerDefaults(0.6, 0.95)),
        _nextn("glm_moe_dsa", SamplerDefaults(1.0, 0.95)),
        BackendDescriptor(
            "mimo_v2_flash", ("mimo_v2_flash",), "engine.backends.mimo_v2_flash", (_NEXTN,),
            ("model.mtp.layers.{i}.",),
            ("enorm.weight", "hnorm.weight", "eh_proj.weight", "input_layernorm.weight", "self_attn.",
             "pre_mlp_layernorm.weight", "mlp.", "final_layernorm.weight"),
            sampler_defaults=SamplerDefaults(0.8, 0.95),
        ),
        BackendDescriptor(
            "step3p5", ("step3p5",), "engine.backends.step3p5", (_NEXTN,), ("model.layers.{n+i}.",),
            ("enorm.weight", "hnorm.weight", "eh_proj.weight", "transformer.shared_head.norm.weight", *_BLOCK),
            sampler_defaults=SamplerDefaults(1.0, 0.95), norm_shift=True,
        ),
        BackendDescriptor(
            "nemotron_h", ("nemotron_h",), "engine.backends.nemotron_h", (_NEXTN,), ("mtp.layers.{i}.",),
            ("enorm.weight", "hnorm.weight", "eh_proj.weight"),
            sampler_defaults=SamplerDefaults(1.0, 1.0), block_types_fields=_NEMOTRON_BLOCKS,
            last_parts=("final_layernorm.weight",), layer_parts=("norm.weight", "mixer."),
        ),
        _qwen("qwen3_next", ("qwen3_next",), SamplerDefaults(0.7, 0.8, 20)),
        _qwen("qwen3_5", ("qwen3_5", "qwen3_5_text"), SamplerDefaults(0.6, 0.95, 20)),
        _qwen("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), SamplerDefaults(0.6, 0.95, 20)),
        BackendDescriptor(
            "hy_v3", ("hy_v3",), "engine.backends.hy_v3", (_NEXTN,), ("model.layers.{n+i}.",),
            ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight", *_BLOCK),
            own_trunk=True,
        ),
        BackendDescriptor(
            "deepseek_v4", ("deepseek_v4",), "engine.backends.deepseek_v4", (_NEXTN,), ("mtp.{i}.",),
            ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight", "hc_head_fn",
             "hc_head_base", "hc_head_scale", "attn_norm.weight", "attn.", "ffn_norm.weight", "ffn.",
             "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale"),
            sampler_defaults=SamplerDefaults(1.0, 1.0), own_trunk=True, check=deepseek_v4_unsupported,
        ),
    )
}
_BY_MODEL_TYPE = {t: d for d in DESCRIPTORS.values() for t in d.model_types}



def head_block_types(config: dict[str, Any], fields: tuple[str, ...] = _NEMOTRON_BLOCKS) -> tuple[str, ...]:
    """The blocks one MTP head is made of, as names ("attention", "moe", "mlp",
    "mamba"), from the first of `fields` the config sets: a list of block names or a
    pattern string of the trunk's symbols (`*` attention, `E` moe, `-` mlp, `M`
    mamba). Neither set: transformers' default, attention then MoE. Raises
    ValueError for a block it does not know."""
    tc = text_config(config)
    value = next((tc[f] for f in fields if tc.get(f)), None)
    if value is None:
        return NEMOTRON_DEFAULT_BLOCKS
    if isinstance(value, str):
        names = [_BLOCK_SYMBOLS.get(symbol) for symbol in value]
    elif isinstance(value, list) and all(isinstance(t, str) for t in value):
        names = [_BLOCK_NAMES.get(t) for t in value]
    else:
        raise ValueError(f"config.json {fields[0]} is neither a list of block types nor a pattern string")
    if None in names:
        raise ValueError(f"config.json names an MTP block type this engine does not know: {value!r}")
    return tuple(str(n) for n in names)


def head_blocks_problem(blocks: tuple[str, ...]) -> str | None:
    """Why heads made of `blocks` cannot run here (None: they can). A head keeps one
    KV cache and no recurrent state: exactly one attention block, no Mamba block."""
    if "mamba" in blocks:
        return f"MTP blocks {list(blocks)} include a Mamba block; only attention, MoE and MLP heads run here"
    if blocks.count("attention") != 1:
        return f"MTP blocks {list(blocks)} need exactly one attention block (a head keeps one KV cache)"
    return None


@dataclass(frozen=True)
class InspectReport:
    family: str
    mtp_heads: int
    depth_max: int
    status: str  # "supported" | "ar-only" | "unsupported"
    reason: str
    head_keys_found: tuple[str, ...] = ()
    descriptor: BackendDescriptor | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("family", "mtp_heads", "depth_max", "status", "reason")}

    @property
    def supported_descriptor(self) -> BackendDescriptor:
        """The family's descriptor, for a report whose status is "supported" (which has one)."""
        return cast(BackendDescriptor, self.descriptor)


def find_descriptor(config: dict[str, Any]) -> BackendDescriptor | None:
    """The MTP family of a config: its model_type, the nested text_config's,
    or the type mlx-lm remaps it to."""
    for model_type in (config.get("model_type"), text_config(config).get("model_type"),
                       mlx_model_type(config)):
        if model_type in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[model_type]
    return None


def inspect_checkpoint(folder: Path) -> InspectReport:
    """Classify a checkpoint folder. Raises CheckpointError for unreadable input."""
    folder = Path(folder)
    config = read_config(folder)
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise CheckpointError(f"{folder / 'config.json'}: no model_type")
    return inspect_keys(config, weight_keys(folder))


def inspect_keys(config: dict[str, Any], keys: Collection[str]) -> InspectReport:
    """Classify a checkpoint from its config and tensor names alone (for instance the
    weight_map of a repository's index, before its weights are downloaded)."""
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise CheckpointError("config.json: no model_type")
    descriptor = find_descriptor(config)
    if descriptor is None:
        return _without_family(config, keys)
    return _with_family(descriptor, config, keys)


# --- what the installed mlx-lm can build (read from its source: importing
# mlx_lm.utils loads MLX and takes seconds) -------------------------------------------


@lru_cache(maxsize=1)
def _mlx_lm_dir() -> Path | None:
    spec = importlib.util.find_spec("mlx_lm")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


@lru_cache(maxsize=1)
def _mlx_lm_remapping() -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """mlx_lm.utils.MODEL_REMAPPING and MODEL_ARCHITECTURE_REMAPPING."""
    tables: dict[str, Any] = {"MODEL_REMAPPING": {}, "MODEL_ARCHITECTURE_REMAPPING": {}}
    folder = _mlx_lm_dir()  # None: no mlx_lm installed
    try:  # ValueError: a table is no longer a literal
        for node in ast.parse((folder / "utils.py").read_text()).body if folder is not None else ():
            name = getattr(node.targets[0], "id", None) if isinstance(node, ast.Assign) else None
            if isinstance(node, ast.Assign) and name in tables:
                tables[name] = ast.literal_eval(node.value)
    except (OSError, SyntaxError, TypeError, ValueError):
        pass
    return tables["MODEL_REMAPPING"], tables["MODEL_ARCHITECTURE_REMAPPING"]


def mlx_model_type(config: dict[str, Any]) -> str:
    """The mlx_lm.models module mlx-lm would use (as mlx_lm.utils._get_classes)."""
    model_type = str(config.get("model_type"))
    remapping, by_architecture = _mlx_lm_remapping()
    architectures = config.get("architectures") or ()
    for architecture in [architectures] if isinstance(architectures, str) else architectures:
        if (model_type, architecture) in by_architecture:
            return by_architecture[(model_type, architecture)]
    return remapping.get(model_type, model_type)


_HAS_MODEL = re.compile(r"^(class\s+Model\b|from\s+\S+\s+import\s+.*\bModel\b)", re.M)


def mlx_lm_can_build(model_type: str) -> bool:
    """Whether mlx_lm.models.<model_type> exists and defines a Model."""
    root = _mlx_lm_dir()
    if root is None or not re.fullmatch(r"[A-Za-z0-9_-]+", model_type):
        return False
    try:
        return bool(_HAS_MODEL.search((root / "models" / f"{model_type}.py").read_text()))
    except (OSError, UnicodeDecodeError):
        return False


# --- families without an MTP backend ------------------------------------------------

_MTP_HINT = re.compile(r"(^|\.)(mtp|mtp_layers)\.|\.(enorm|hnorm|eh_proj)\.")
_MTP_HINT_TEXT = "mtp.*, *.mtp.*, *.mtp_layers.*, *.enorm.*, *.hnorm.*, *.eh_proj.*"


def _without_family(config: dict[str, Any], keys: Collection[str]) -> InspectReport:
    declared = config["model_type"]
    built = mlx_model_type(config)
    if not mlx_lm_can_build(built):
        why = f"model_type {declared!r} is not an MTP family and mlx-lm cannot build it"
        return InspectReport(declared, 0, 0, "unsupported", f"{why} (no mlx_lm.models.{built})")
    hints = sorted(k for k in keys if _MTP_HINT.search(k))[:3]
    if hints:
        reason = f"MTP-like weights (e.g. {hints[0]}) but no MTP backend for {declared!r}"
    else:
        reason = f"no MTP head weights (looked for {_MTP_HINT_TEXT})"
    reason += f"; mlx-lm runs {declared!r} autoregressively"
    plain = BackendDescriptor(declared, (declared,), PLAIN_BACKEND, depth_range=(0, 0))
    return InspectReport(declared, 0, 0, "ar-only", reason, tuple(hints), plain)


# --- MTP families -------------------------------------------------------------------

_SLOT = re.compile(r"\{(n\+)?i\}")


@dataclass
class _Heads:
    pattern: str  # the pattern with {n+i} made concrete, for messages
    prefixes: dict[int, str]  # head index -> key prefix
    parts: dict[int, set[str]]  # head index -> keys under the prefix (relative)
    root: str  # where shared parts sit
    shared: set[str]  # keys under root outside layers (relative)


def _slot(pattern: str) -> re.Match[str]:
    """The layer-number slot of a head key pattern (every pattern has one)."""
    return cast(re.Match[str], _SLOT.search(pattern))


def _scan(pattern: str, n_layers: int, keys: Collection[str], with_shared: bool) -> _Heads:
    slot = _slot(pattern)
    before, after, offset = pattern[: slot.start()], pattern[slot.end():], slot.group(1) is not None
    regex = re.compile(re.escape(before) + r"(\d+)" + re.escape(after))
    shown = _SLOT.sub("{%d+i}" % n_layers if offset else "{i}", pattern)
    root = before.rsplit("layers.", 1)[0] if with_shared else ""
    heads = _Heads(shown, {}, {}, root, set())
    for key in keys:
        m = regex.match(key)
        if m:
            i = int(m.group(1)) - (n_layers if offset else 0)
            if i >= 0:
                heads.prefixes[i] = m.group(0)
                heads.parts.setdefault(i, set()).add(key[m.end():])
        elif root and key.startswith(root):
            heads.shared.add(key[len(root):])
    return heads


def _missing(required: tuple[str, ...], present: set[str]) -> list[str]:
    def has(part: str) -> bool:
        return any(p.startswith(part) for p in present) if part.endswith(".") else part in present

    return [part for part in required if not has(part)]


def _with_family(d: BackendDescriptor, config: dict[str, Any], keys: Collection[str]) -> InspectReport:
    tc = text_config(config)
    n_layers = tc.get("num_hidden_layers")
    if any("{n+i}" in p for p in d.head_key_patterns) and not isinstance(n_layers, int):
        return InspectReport(d.family, 0, 0, "unsupported",
                             "config.json has no integer num_hidden_layers to locate the MTP layers")
    scans = [_scan(p, n_layers or 0, keys, bool(d.shared_parts)) for p in d.head_key_patterns]
    found = next((s for s in scans if s.parts or s.shared), None)
    count = next(((f, tc[f]) for f in d.head_count_fields if isinstance(tc.get(f), int)), None)
    if found is None and not d.own_trunk and not mlx_lm_can_build(mlx_model_type(config)):
        why = f"no MTP head weights and mlx-lm cannot build model_type {config['model_type']!r}"
        return InspectReport(d.family, 0, 0, "unsupported", why)
    why_not = d.check(tc, keys) if d.check else None
    if why_not:
        return InspectReport(d.family, len(found.parts) if found else 0, 0, "unsupported", why_not)
    if found is None and d.unsupported:
        looked = ", ".join(s.pattern + "*" for s in scans)
        return InspectReport(d.family, 0, 0, "unsupported",
                             f"no MTP head weights found (looked for {looked}), and {d.unsupported}")
    if found is None:
        return _ar_only(d, scans, count)
    problem = None
    if d.block_types_fields:
        found, problem = _grouped(d, tc, found)
    problem = problem or _incomplete(d, found)
    examples = tuple(found.prefixes[i] + min(found.parts[i]) for i in sorted(found.parts)[:3])
    examples += tuple(found.root + s for s in sorted(found.shared)[:1])
    if problem:
        return InspectReport(d.family, len(found.parts), 0, "unsupported", problem, examples)
    n_heads = len(found.parts)
    if d.unsupported:
        return InspectReport(d.family, n_heads, 0, "unsupported",
                             f"{n_heads} MTP head(s) at {found.pattern}*, but {d.unsupported}", examples)
    built = mlx_model_type(config)
    if not d.own_trunk and not mlx_lm_can_build(built):
        why = (f"{n_heads} MTP head(s) at {found.pattern}*, but the installed mlx-lm cannot build the "
               f"{config['model_type']!r} trunk (no mlx_lm.models.{built}); a newer mlx-lm may")
        return InspectReport(d.family, n_heads, 0, "unsupported", why, examples)
    depth_max = max(d.depth_range[1], n_heads)
    reason = f"{n_heads} MTP head(s) at {found.pattern}*; drafts up to depth {depth_max}"
    if d.block_types_fields:
        blocks = head_block_types(tc, d.block_types_fields)
        reason = reason.replace("*;", f"* ({len(blocks)} layers each: {', '.join(blocks)});", 1)
    if count and count[1] != n_heads:
        reason += f" (config says {count[0]}={count[1]}; the weights decide)"
    return InspectReport(d.family, n_heads, depth_max, "supported", reason, examples, d)


def _ar_only(d: BackendDescriptor, scans: list[_Heads], count: tuple[str, int] | None) -> InspectReport:
    looked = ", ".join((s.root if d.shared_parts else s.pattern) + "*" for s in scans)
    said = f"config says {count[0]}={count[1]} but " if count and count[1] else ""
    reason = f"{said}no MTP head weights found (looked for {looked}); AR decoding only"
    # mlx-lm runs the trunk AR-only, or the family's own backend where mlx-lm has no model.
    plain = replace(d, backend_module=d.backend_module if d.own_trunk else PLAIN_BACKEND, depth_range=(0, 0))
    return InspectReport(d.family, 0, 0, "ar-only", reason, (), plain)


def _incomplete(d: BackendDescriptor, found: _Heads) -> str | None:
    indices = sorted(found.parts)
    if not indices:
        return f"MTP weights under {found.root}* but no head layer at {found.pattern}*"
    gaps = sorted(set(range(indices[-1])) - set(indices))
    if gaps:
        return f"MTP head {gaps[0]} is missing (found heads {indices} at {found.pattern}*)"
    for i in indices:
        missing = _missing(d.head_parts, found.parts[i])
        if missing:
            names = ", ".join(found.prefixes[i] + m for m in missing)
            return f"MTP head {i} is incomplete: missing {names}"
    missing = _missing(d.shared_parts, found.shared)
    if missing:
        return "MTP head is incomplete: missing " + ", ".join(found.root + m for m in missing)
    return None


def _grouped(d: BackendDescriptor, tc: dict[str, Any], layers: _Heads) -> tuple[_Heads, str | None]:
    """Layers found (one per index) -> heads of len(blocks) consecutive layers each (their
    first layer's prefix and parts), with what is wrong with the layers, if anything."""
    try:
        blocks = head_block_types(tc, d.block_types_fields)
    except ValueError as e:
        return layers, str(e)
    problem = head_blocks_problem(blocks)
    if problem:
        return layers, problem
    span, indices = len(blocks), sorted(layers.parts)
    gaps = sorted(set(range(indices[-1])) - set(indices))
    if gaps:
        return layers, f"MTP layer {gaps[0]} is missing (found layers {indices} at {layers.pattern}*)"
    if len(indices) % span:
        return layers, (f"{len(indices)} MTP layer(s) at {layers.pattern}* do not make whole heads of "
                        f"{span} blocks ({', '.join(blocks)})")
    for j in indices:
        wanted = d.layer_parts + (d.last_parts if j % span == span - 1 else ())
        missing = _missing(wanted, layers.parts[j])
        if missing:
            names = ", ".join(layers.prefixes[j] + m for m in missing)
            return layers, f"MTP layer {j} ({blocks[j % span]} block of head {j // span}) is incomplete: missing {names}"
    heads = _Heads(layers.pattern, {}, {}, layers.root, layers.shared)
    for i in range(len(indices) // span):
        heads.prefixes[i], heads.parts[i] = layers.prefixes[i * span], layers.parts[i * span]
    return heads, None


def head_key_predicate(d: BackendDescriptor, n_layers: int) -> Callable[[str], bool]:
    """Whether a tensor name belongs to an MTP head of family `d` (its layers or,
    for Qwen, the parts shared beside them)."""
    rules = []
    for pattern in d.head_key_patterns:
        slot = _slot(pattern)
        before, after = pattern[: slot.start()], pattern[slot.end():]
        regex = re.compile(re.escape(before) + r"(\d+)" + re.escape(after))
        first = n_layers if slot.group(1) else 0  # appended layers count after the trunk's
        root = before.rsplit("layers.", 1)[0] if d.shared_parts else None
        rules.append((regex, first, root))

    def is_head_key(key: str) -> bool:
        for regex, first, root in rules:
            m = regex.match(key)
            if (m and int(m.group(1)) >= first) or (root and key.startswith(root)):
                return True
        return False

    return is_head_key
