"""Importing a GGUF file (llama.cpp's format, what Ollama and LM Studio users hold)
into a model folder the engine loads like any other.

    plan = read_gguf(path)             header, metadata and tensor table; refuses bad files
    import_gguf(path, out, spec)       config.json, tokenizer files, model.safetensors

What a GGUF stores differently from a Hugging Face checkpoint, and what is done here:
- Names: `token_embd`, `blk.N.attn_q`, ... become `model.embed_tokens`,
  `model.layers.N.self_attn.q_proj`, ... (GGUF_NAMES).
- Quantized blocks: Q8_0, Q4_0 and Q4_1 are affine with groups of 32, the same
  arithmetic as MLX's quantization: their bytes are repacked as MLX triples (packed
  weight, scales, biases), the numbers kept as they are. K-quants (Q4_K, Q5_K, Q6_K) have
  no MLX twin: the `gguf` package dequantizes them and MLX requantizes them at the
  chosen bits. Any other type is refused by name.
- Rope: llama.cpp's converter permutes the rows of Llama-family Q and K weights for its
  interleaved rope; the rows are put back (per head, the two rotary halves) so the
  model runs with the usual rope. Qwen and Gemma files are not permuted.
- Gemma's norms: llama.cpp stores `1 + w`; mlx-lm's Gemma adds the 1 itself.
- The tokenizer and chat template live in the metadata (engine/gguf_tokenizer.py).

The folder appears atomically (a hidden partial folder renamed at the end), as
`mtplxd convert` writes its own.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.checkpoint import GGUFError

MAGIC = b"GGUF"
KEPT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")  # stored as they are (MLX reads the Q types)
# Dequantized, then MLX affine at the chosen bits. Q5_0 / Q5_1 are here because llama.cpp's
# K-quant files (Q4_K_M, ...) store the tensors whose width 256 does not divide in them.
REQUANTIZED_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")
NATIVE_GROUP = 32  # the block size of Q8_0 / Q4_0 / Q4_1
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
_PERMUTED_QK = ("llama",)  # llama.cpp's converter interleaves these families' rope rows
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has a norm on each side of both sublayers.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class TensorEntry:
    name: str  # the GGUF name, e.g. blk.0.attn_q.weight
    type: str  # GGML type name, e.g. Q4_1
    shape: tuple[int, ...]  # row-major (outer first), as MLX and Hugging Face see it


@dataclass(frozen=True)
class GGUFPlan:
    """What a GGUF holds and what importing it does, read from its header alone."""

    path: Path
    architecture: str
    metadata: dict[str, Any]
    tensors: tuple[TensorEntry, ...]
    config: dict[str, Any] = field(default_factory=dict)
    reader: Any = field(default=None, repr=False, compare=False)  # the gguf package's, memory-mapped

    @property
    def types(self) -> Counter:
        return Counter(t.type for t in self.tensors)

    def describe(self, bits: int | None, group_size: int) -> list[str]:
        """One line per decision, for `mtplxd inspect`."""
        lines = [f"{n} {kind} tensor(s): {_fate(kind, bits, group_size)}" for kind, n in sorted(self.types.items())]
        model = self.metadata.get("tokenizer.ggml.model")
        template = "with" if self.metadata.get("tokenizer.chat_template") else "without"
        lines.append(f"tokenizer: {model} ({self.metadata.get('tokenizer.ggml.pre', 'default')} pre-tokenizer), "
                     f"{template} chat template")
        if self.architecture in _PERMUTED_QK:
            lines.append("Q/K rows: llama.cpp's rope permutation undone")
        return lines


def _fate(kind: str, bits: int | None, group_size: int) -> str:
    if bits is None:
        return "unpacked to float16" if kind not in ("F32", "F16", "BF16") else "kept"
    if kind in REQUANTIZED_TYPES:
        return f"dequantized, requantized to MLX {bits}-bit (group {group_size})"
    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        return f"kept as MLX {8 if kind == 'Q8_0' else 4}-bit (group {NATIVE_GROUP})"
    return "kept"


# -- reading ---------------------------------------------------------------------------


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def read_gguf(path: str | Path) -> GGUFPlan:
    """Header, metadata and tensor table, checked: a bad file raises GGUFError."""
    import gguf

    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with path.open("rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (wrong magic number)")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError) as e:  # the reader's own errors on a damaged file
        raise GGUFError(f"{path}: truncated or corrupt GGUF file ({' '.join(str(e).split())})")
    metadata = {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = tuple(
        TensorEntry(t.name, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape.tolist())))
        for t in reader.tensors
    )
    architecture = str(metadata.get("general.architecture", ""))
    if architecture not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {architecture or '(none)'!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    refused = sorted({t.type for t in tensors} - set(KEPT_TYPES) - set(REQUANTIZED_TYPES))
    if refused:
        raise GGUFError(f"{path}: tensor type(s) {', '.join(refused)} are not supported "
                        f"(supported: {', '.join(KEPT_TYPES + REQUANTIZED_TYPES)})")
    plan = GGUFPlan(path, architecture, metadata, tensors, reader=reader)
    config = gguf_config(plan)
    _check_shapes(plan, config)
    return replace(plan, config=config)


def meta(plan: GGUFPlan, key: str, default: Any = None) -> Any:
    """`<architecture>.<key>` from the metadata."""
    return plan.metadata.get(f"{plan.architecture}.{key}", default)


# -- config ------------------------------------------------------------------------------


def gguf_config(plan: GGUFPlan) -> dict[str, Any]:
    """The Hugging Face config.json of the model the file holds."""
    names = {t.name for t in plan.tensors}
    embed = next((t for t in plan.tensors if t.name == "token_embd.weight"), None)
    if embed is None or len(embed.shape) != 2:
        raise GGUFError(f"{plan.path}: no token_embd.weight tensor")
    heads = _required(plan, "attention.head_count")
    hidden = _required(plan, "embedding_length")
    head_dim = int(meta(plan, "attention.key_length") or hidden // heads)
    config: dict[str, Any] = {
        "architectures": [],
        "model_type": plan.architecture,
        "hidden_size": hidden,
        "intermediate_size": _required(plan, "feed_forward_length"),
        "num_hidden_layers": _required(plan, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta(plan, "attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta(plan, "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta(plan, "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta(plan, "context_length", 4096)),
        "vocab_size": embed.shape[0],
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": plan.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": plan.metadata.get("tokenizer.ggml.eos_token_id"),
    }
    if plan.architecture == "llama":
        config.update(architectures=["LlamaForCausalLM"], attention_bias="blk.0.attn_q.bias" in names,
                      mlp_bias=False)
    elif plan.architecture == "qwen2":
        config.update(architectures=["Qwen2ForCausalLM"])
    elif plan.architecture == "qwen3":
        config.update(architectures=["Qwen3ForCausalLM"])
    elif plan.architecture == "gemma3":
        config.update(_gemma3_fields(plan, head_dim))
    scaling = _rope_scaling(plan)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _required(plan: GGUFPlan, key: str) -> int:
    value = meta(plan, key)
    if value is None:
        raise GGUFError(f"{plan.path}: metadata {plan.architecture}.{key} is missing")
    return int(value)


def _gemma3_fields(plan: GGUFPlan, head_dim: int) -> dict[str, Any]:
    # llama.cpp fixes Gemma 3's pattern (five sliding-window layers, then one global) and
    # its local rope base; the file stores the window and the global base. It scales
    # queries by 1/sqrt(head_dim), except for the 27B (known by its 62 layers): by
    # 1/sqrt(hidden / heads), as Google's config does (168, where head_dim is 128).
    scalar = head_dim
    if _required(plan, "block_count") == 62:
        scalar = _required(plan, "embedding_length") // _required(plan, "attention.head_count")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "sliding_window": int(meta(plan, "attention.sliding_window", 512)),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": scalar,
        "tie_word_embeddings": True,
    }


def _rope_scaling(plan: GGUFPlan) -> dict[str, Any] | None:
    kind = meta(plan, "rope.scaling.type")
    factor = meta(plan, "rope.scaling.factor")
    if kind in (None, "none") or not factor:
        if any(t.name == "rope_freqs.weight" for t in plan.tensors):
            return {"rope_type": "llama3", **LLAMA3_ROPE}  # checked against the tensor at import
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise GGUFError(f"{plan.path}: rope scaling {kind!r} is not supported")


# Llama 3.1-3.3's published rope scaling; the file stores only its result (rope_freqs),
# which import_gguf compares against these values before using them.
LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def _check_shapes(plan: GGUFPlan, config: dict[str, Any]) -> None:
    """Every block tensor's shape against what the metadata says the model is."""
    d, ffn = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    expected = {"attn_q": (q_rows, d), "attn_k": (kv_rows, d), "attn_v": (kv_rows, d),
                "attn_output": (d, q_rows), "ffn_gate": (ffn, d), "ffn_up": (ffn, d), "ffn_down": (d, ffn),
                "attn_norm": (d,), "ffn_norm": (d,)}
    layers = set()
    for t in plan.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[-1] == "weight":
            layers.add(int(parts[1]))
            want = expected.get(parts[2])
        elif t.name in ("token_embd.weight", "output.weight"):
            want = (config["vocab_size"], d)
        else:
            continue
        if want is not None and t.shape != want:
            raise GGUFError(f"{plan.path}: tensor {t.name} has shape {list(t.shape)}, but the metadata "
                            f"describes {list(want)}")
    if layers != set(range(config["num_hidden_layers"])):
        raise GGUFError(f"{plan.path}: the file has blocks {_span(layers)}, the metadata says "
                        f"{config['num_hidden_layers']}")


def _span(layers: set[int]) -> str:
    return f"0-{max(layers)}" if layers == set(range(max(layers) + 1)) else f"{sorted(layers)}" if layers else "none"


# -- weights -------------------------------------------------------------------------


def hf_name(architecture: str, gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (`.weight` / `.bias` suffix kept);
    None for tensors that are not weights of the model (rope_freqs)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if parts[0] != "blk" or len(parts) != 3:
        return None
    table = _GEMMA_LAYER_NAMES if architecture == "gemma3" else _LAYER_NAMES
    if parts[2] not in table:
        raise GGUFError(f"tensor {gguf_name}: not a part of a {architecture} block that mtplxd knows")
    return f"model.layers.{parts[1]}.{table[parts[2]]}.{suffix}"


def unpermute_rows(w, n_heads: int):
    """Undo llama.cpp's rope permutation of Q or K rows (any trailing shape: a weight,
    its quantization scales and biases, a bias vector): within each head, llama.cpp
    interleaved the two rotary halves row by row."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(plan: GGUFPlan, bits: int | None, group_size: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The model's tensors under Hugging Face names, and the config's `quantization`
    (None: nothing is quantized)."""
    reader_data = _raw_tensors(plan)
    out: dict[str, Any] = {}
    layer_bits: dict[str, dict[str, int]] = {}
    for t in plan.tensors:
        name = hf_name(plan.architecture, t.name)
        if name is None:
            _check_rope_freqs(plan, t, reader_data)
            continue
        path = name.removesuffix(".weight").removesuffix(".bias")
        arrays = _tensor_arrays(t, reader_data, bits, group_size)
        arrays = _fix_layout(plan, t, path, arrays)
        if len(arrays) == 3:
            packed, scales, _ = arrays
            layer_bits[path] = {"group_size": t.shape[-1] // scales.shape[-1],
                                "bits": packed.shape[-1] * 32 // t.shape[-1]}
            out[f"{path}.weight"], out[f"{path}.scales"], out[f"{path}.biases"] = arrays
        else:
            out[name] = arrays[0]
    return out, _quantization_config(layer_bits)


def _raw_tensors(plan: GGUFPlan) -> dict[str, Any]:
    """The gguf package's view of the tensors (memory-mapped). Not mx.load: it refuses
    a whole file when one tensor has a type it cannot convert (Q5_K)."""
    return {t.name: t for t in plan.reader.tensors}


def _tensor_arrays(t: TensorEntry, raw: dict, bits: int | None, group_size: int) -> tuple:
    """(weight,) or (packed, scales, biases) for one tensor."""
    import mlx.core as mx
    import gguf
    import numpy as np

    if t.type in ("Q8_0", "Q4_0", "Q4_1"):
        triple = native_triple(t.type, raw[t.name].data, t.shape)
        if bits is None:  # unpacked
            packed, scales, biases = (a.astype(mx.float32) if a.dtype != mx.uint32 else a for a in triple)
            w = mx.dequantize(packed, scales=scales, biases=biases, group_size=NATIVE_GROUP,
                              bits=8 if t.type == "Q8_0" else 4)
            return (w.astype(mx.float16),)
        return triple
    if t.type in ("F32", "F16"):
        return (mx.array(np.asarray(raw[t.name].data).reshape(t.shape)),)
    values = gguf.quants.dequantize(raw[t.name].data, gguf.GGMLQuantizationType[t.type])
    w = mx.array(np.ascontiguousarray(values, dtype=np.float32).reshape(t.shape))
    if t.type == "BF16":
        return (w.astype(mx.bfloat16),)
    if bits is None or w.ndim != 2 or w.shape[-1] % group_size:
        return (w.astype(mx.float16),)
    return tuple(mx.quantize(w, group_size=group_size, bits=bits))


# Bytes per block of 32 weights: an fp16 scale (d), Q4_1's fp16 minimum (m), the codes.
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def native_triple(kind: str, data, shape: tuple[int, ...]) -> tuple:
    """MLX's (packed, scales, biases) of Q8_0 / Q4_0 / Q4_1 blocks, the same numbers:
    Q8_0 is d * q (q int8), Q4_0 d * (q - 8), Q4_1 d * q + m (q 4-bit codes)."""
    import mlx.core as mx
    import numpy as np

    blocks = np.asarray(data, dtype=np.uint8).reshape(*shape[:-1], -1, _BLOCK_BYTES[kind])
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    if kind == "Q8_0":  # MLX codes are unsigned: q + 128, the bias -128 d (exact in fp16)
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return _packed(codes, shape), mx.array(scales), mx.array(scales * np.float16(-128))
    # A Q4 block's byte j holds weight j (low nibble) and weight j + 16 (high nibble);
    # MLX packs consecutive weights, low nibble first.
    nibbles = blocks[..., -16:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    pairs = codes[..., 0::2] | (codes[..., 1::2] << 4)
    biases = (np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if kind == "Q4_1"
              else scales * np.float16(-8))
    return _packed(pairs, shape), mx.array(scales), mx.array(biases)


def _packed(codes, shape: tuple[int, ...]):
    """Code bytes (..., blocks, bytes per block) as MLX's uint32 words, one row per weight row."""
    import mlx.core as mx
    import numpy as np

    return mx.array(np.ascontiguousarray(codes).reshape(*shape[:-1], -1).view(np.uint32))


def _fix_layout(plan: GGUFPlan, t: TensorEntry, path: str, arrays: tuple) -> tuple:
    """llama.cpp's layout -> the Hugging Face one: Q/K rows, Gemma's norm offset."""
    import mlx.core as mx

    if plan.architecture in _PERMUTED_QK and path.endswith(("self_attn.q_proj", "self_attn.k_proj")):
        heads = plan.config["num_attention_heads" if path.endswith("q_proj") else "num_key_value_heads"]
        return tuple(unpermute_rows(a, heads) for a in arrays)
    if plan.architecture == "gemma3" and path.endswith("norm"):
        (w,) = arrays
        return ((w.astype(mx.float32) - 1).astype(w.dtype),)
    return arrays


def _check_rope_freqs(plan: GGUFPlan, t: TensorEntry, raw: dict) -> None:
    """Llama 3.x: the stored per-frequency factors must be those LLAMA3_ROPE yields."""
    import gguf
    import numpy as np

    if t.name != "rope_freqs.weight":
        raise GGUFError(f"{plan.path}: tensor {t.name} is not part of a {plan.architecture} model")
    stored = gguf.quants.dequantize(raw[t.name].data, gguf.GGMLQuantizationType[t.type]).reshape(-1)
    expected = llama3_rope_factors(plan.config["head_dim"], plan.config["rope_theta"], LLAMA3_ROPE)
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-3):
        raise GGUFError(f"{plan.path}: rope_freqs does not match Llama 3's rope scaling "
                        f"{LLAMA3_ROPE}; this rope scaling is not supported")


def llama3_rope_factors(head_dim: int, base: float, rope: dict[str, float]):
    """The divisor of each rope frequency under Llama 3's scaling (what llama.cpp stores)."""
    import numpy as np

    freqs = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    low = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
        rope["high_freq_factor"] - rope["low_freq_factor"])
    factors = 1 / ((1 - smooth) / rope["factor"] + smooth)
    factors = np.where(wavelen < high, 1.0, np.where(wavelen > low, rope["factor"], factors))
    return factors.astype(np.float32)


def _quantization_config(layer_bits: dict[str, dict[str, int]]) -> dict[str, Any] | None:
    """mlx-lm's `quantization`: the most common settings as the default, every layer that
    differs under its own path."""
    if not layer_bits:
        return None
    common = Counter(tuple(sorted(v.items())) for v in layer_bits.values()).most_common(1)[0][0]
    default = dict(common)
    config: dict[str, Any] = {"group_size": default["group_size"], "bits": default["bits"], "mode": "affine"}
    config.update({path: v for path, v in sorted(layer_bits.items()) if v != default})
    return config


# -- the folder ------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFImport:
    out: Path
    family: str
    quantization: dict[str, Any] | None
    size_bytes: int
    mtp_heads: int  # shipped heads attached (engine/shipped_heads.py), else 0
    heads_digest: str | None  # which ones


def import_gguf(path: str | Path | GGUFPlan, out: str | Path, bits: int | None = 4, group_size: int = 64,
                source: str | None = None, heads: bool = True) -> GGUFImport:
    """Write the model folder `out` (which must not exist) from the GGUF file `path` (or
    its plan, already read).
    `bits` / `group_size`: what K-quant tensors are requantized to; bits None unpacks
    every quantized tensor to float16. `heads`: attach the MTP heads mtplxd ships for
    this model, if it has some."""
    import mlx.core as mx

    from engine.conversion import check_room, folder_bytes
    from engine.gguf_tokenizer import tokenizer_files
    from engine.shipped_heads import attach_heads, shipped_heads

    plan = path if isinstance(path, GGUFPlan) else read_gguf(path)
    out = Path(out).expanduser().absolute()
    if out.exists():
        raise GGUFError(f"{out}: already exists; remove it or choose another name")
    check_room(out.parent, _estimate_bytes(plan, bits), "the imported model")
    tokenizer_json, tokenizer_config = tokenizer_files(plan)
    weights, quantization = gguf_weights(plan, bits, group_size)
    config = dict(plan.config)
    if quantization:
        config["quantization"] = quantization
    config["mtplxd_gguf"] = {"source": source or str(plan.path), "name": plan.metadata.get("general.name"),
                             "file_type": _file_type(plan)}
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        partial.mkdir(parents=True)
        mx.save_safetensors(str(partial / "model.safetensors"), weights, metadata={"format": "mlx"})
        (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (partial / "tokenizer.json").write_text(tokenizer_json)
        (partial / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        shipped = shipped_heads(plan.metadata) if heads else None
        if shipped is not None:
            config = attach_heads(partial, shipped)
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return GGUFImport(out, config["model_type"], quantization, folder_bytes(out), shipped.count if shipped else 0,
                      shipped.digest if shipped else None)


def _file_type(plan: GGUFPlan) -> str:
    kinds = plan.types
    weights = Counter({k: n for k, n in kinds.items() if k != "F32"}) or kinds
    return weights.most_common(1)[0][0]


def _estimate_bytes(plan: GGUFPlan, bits: int | None) -> int:
    size = 0
    for t in plan.tensors:
        n = math.prod(t.shape)
        if t.type in _DTYPE_BYTES:
            size += n * _DTYPE_BYTES[t.type]
        elif bits is None:
            size += 2 * n
        else:
            size += n * (8 if t.type in ("Q8_0", "Q6_K") else 5) // 8 + n // 8  # data + scales and biases
    return size + (16 << 20)  # the tokenizer
