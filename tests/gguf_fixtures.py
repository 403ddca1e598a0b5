"""Tiny GGUF files, written the way llama.cpp's converter (convert_hf_to_gguf.py) writes
them, and the Hugging Face folder each one must import to.

    model = tiny_model("llama")                  # random weights, Hugging Face names
    written = write_gguf(path, model, TYPES["llama"])
    write_reference(folder, model, written)      # config.json, model.safetensors, tokenizer

The model is a tiny random mlx-lm model of the architecture. Each tensor goes through
what the converter does to it: a GGUF name, llama's Q/K rope row permutation, Gemma's
`1 + w` norms, then the chosen GGML type. `write_gguf` returns what the stored bytes
mean: the gguf package's dequantization of them, put back in Hugging Face layout. That
is the reference an import must reproduce.

Q8_0, Q4_0, Q4_1 and BF16 are quantized by the gguf package. It cannot quantize K-quants
(Q4_K, Q5_K, Q6_K), so those tensors are random blocks with small fp16 scales: any
bytes are a valid block, and the reference is their dequantization.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from tests.checkpoints.common import CHAT_TEMPLATE

# GGUF architecture -> mlx-lm model_type
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
REQUANTIZED = K_QUANTS + ("Q5_0", "Q5_1")  # what the import requantizes

# The type of each 2-D weight, by GGUF role (norms and biases are F32, as the converter
# keeps every 1-D tensor). Over the four files every supported type appears; K-quants
# go to ffn_down, whose 256 in-features make one K-quant block per row.
TYPES = {
    "llama": {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0",
              "attn_output": "F16", "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q4_K",
              "output": "Q4_1"},
    "qwen2": {"token_embd": "Q4_0", "attn_q": "Q8_0", "attn_k": "Q4_1", "attn_v": "Q4_1",
              "attn_output": "F32", "ffn_gate": "F16", "ffn_up": "BF16", "ffn_down": "Q5_K"},
    "qwen3": {"token_embd": "F16", "attn_q": "Q5_1", "attn_k": "Q4_0", "attn_v": "BF16",
              "attn_output": "Q8_0", "ffn_gate": "Q8_0", "ffn_up": "Q4_1", "ffn_down": "Q6_K",
              "output": "Q8_0"},
    "gemma3": {"token_embd": "BF16", "attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1",
               "attn_output": "Q5_0", "ffn_gate": "Q4_0", "ffn_up": "Q8_0", "ffn_down": "Q4_K"},
}

# Hugging Face module -> GGUF role (llama.cpp's tensor names).
_ROLES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# Gemma 3 has a norm on each side of both sublayers.
_GEMMA_ROLES = {**_ROLES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

# K-quant blocks: byte offsets of their fp16 super-block scales, and the value written
# there (small enough that random 4-6 bit codes give weights of a trained model's size).
_K_SCALES = {"Q4_K": ((0, 1e-4), (2, 1e-4)), "Q5_K": ((0, 1e-4), (2, 1e-4)), "Q6_K": ((208, 1e-4),)}


# -- the tokenizer -----------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = ["the cat sat on the mat", "hello world, hello there", "a model reads the tokens it is given",
           "numbers like 12 and 345 stay digits", "we write tiny files for tests"] * 4


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]  # byte-level spellings, by id
    merges: list[str]  # "a b", best first
    fast: Any  # the same tokenizer as a transformers PreTrainedTokenizerFast

    def id(self, token: str) -> int:
        return self.tokens.index(token)


@lru_cache(maxsize=1)
def tiny_vocab(size: int = 320) -> Vocab:
    """A byte-level BPE (all 256 bytes, a few merges, ChatML control tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[2])
    fast.chat_template = CHAT_TEMPLATE
    return Vocab(tokens, merges, fast)


# -- the model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyModel:
    arch: str  # the GGUF architecture
    config: dict[str, Any]  # its Hugging Face config.json
    weights: dict[str, np.ndarray]  # float32, Hugging Face names and layout
    vocab: Vocab


def hf_config(arch: str, vocab_size: int) -> dict[str, Any]:
    config = {"model_type": MODEL_TYPES[arch], "hidden_size": 64, "num_hidden_layers": 2,
              "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 256,
              "vocab_size": vocab_size, "tie_word_embeddings": arch in ("qwen2", "gemma3"),
              "bos_token_id": 0, "eos_token_id": 2}
    if arch == "llama":  # non-default values, so a config the import gets wrong shows in the logits
        config.update(rms_norm_eps=1e-5, rope_theta=50000.0, attention_bias=False, mlp_bias=False)
    if arch in ("qwen3", "gemma3"):  # head_dim other than hidden / heads, as in real Qwen3 and Gemma 3
        config["head_dim"] = 32
    if arch == "gemma3":  # six layers: the sixth is the first global one (mlx-lm needs a whole period)
        config.update(num_hidden_layers=6, query_pre_attn_scalar=32, sliding_window=6,
                      sliding_window_pattern=6, rope_local_base_freq=10000.0)
    return config


def tiny_model(arch: str, seed: int = 0) -> TinyModel:
    """mlx-lm's model of `arch` with seeded random weights of a trained model's scale."""
    vocab = tiny_vocab()
    config = hf_config(arch, len(vocab.tokens))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in _parameter_shapes(config).items():
        if config["tie_word_embeddings"] and name == "lm_head.weight":
            continue
        if len(shape) == 2:
            w = rng.normal(0.0, shape[1] ** -0.5, size=shape)
        elif name.endswith("norm.weight"):  # Gemma's norms are zero-centred, the others around 1
            w = (0.0 if arch == "gemma3" else 1.0) + rng.normal(0.0, 0.1, size=shape)
        else:  # a bias
            w = rng.normal(0.0, 0.1, size=shape)
        weights[name] = w.astype(np.float32)
    return TinyModel(arch, config, weights, vocab)


def _parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    return {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}


# -- the file ----------------------------------------------------------------------------


def gguf_name(arch: str, hf_name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight"""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    _, _, layer, module = stem.split(".", 3)
    roles = _GEMMA_ROLES if arch == "gemma3" else _ROLES
    return f"blk.{layer}.{roles[module]}.{suffix}"


def rope_row_order(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's permute() of Q/K rows for its rope, as indices: GGUF row i is
    Hugging Face row order[i]. Within each head the rows of the two rotary halves are
    interleaved."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)


def _row_order(model: TinyModel, hf_name: str) -> np.ndarray | None:
    """The permutation the converter applies to this tensor's rows (None: none)."""
    if model.arch != "llama":
        return None
    if ".self_attn.q_proj." in hf_name:
        return rope_row_order(model.weights[hf_name].shape[0], model.config["num_attention_heads"])
    if ".self_attn.k_proj." in hf_name:
        return rope_row_order(model.weights[hf_name].shape[0], model.config["num_key_value_heads"])
    return None


def encode(w: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """The stored form of a GGUF-layout float32 tensor: float data, or raw block bytes."""
    import gguf

    if kind == "F32":
        return w.astype(np.float32)
    if kind == "F16":
        return w.astype(np.float16)
    if kind in K_QUANTS:
        return random_k_blocks(w.shape[0], w.shape[1], kind, rng)
    if kind not in REQUANTIZED + ("Q8_0", "Q4_0", "Q4_1", "BF16"):  # a type the import refuses: any bytes
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        return rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
    return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[kind])


def decode(stored: np.ndarray, kind: str) -> np.ndarray:
    """What the stored form means, as float32 (the gguf package's dequantization)."""
    import gguf

    if kind in ("F32", "F16"):
        return stored.astype(np.float32)
    if kind not in REQUANTIZED + ("Q8_0", "Q4_0", "Q4_1", "BF16"):  # refused by the import: never compared
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        return np.zeros((stored.shape[0], stored.shape[1] // size * block), dtype=np.float32)
    return gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[kind]).astype(np.float32)


def random_k_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (raw bytes, one row of blocks per weight row) whose fp16
    super-block scales are set to small values."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset, value in _K_SCALES[kind]:
        blocks[..., offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


@dataclass(frozen=True)
class Written:
    """What write_gguf stored, in Hugging Face names and layout."""

    weights: dict[str, np.ndarray]  # the dequantized values (the reference)
    types: dict[str, str]  # the GGML type of each tensor


def write_gguf(path: Path, model: TinyModel, types: dict[str, str],
               metadata: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> Written:
    """Write the model as llama.cpp's converter would. `metadata` adds or replaces keys
    (None as a value removes one; `general.architecture` renames the architecture);
    `drop` leaves out tensors whose GGUF name starts with one of its prefixes."""
    import gguf

    metadata = {**gguf_metadata(model), **(metadata or {})}
    writer = gguf.GGUFWriter(str(path), metadata.pop("general.architecture", model.arch))
    for key, value in metadata.items():
        if value is not None:
            _put(writer, key, value)
    rng = np.random.default_rng(1)
    reference, kinds = {}, {}
    for hf, w in model.weights.items():
        name = gguf_name(model.arch, hf)
        if name.startswith(drop):
            continue
        kind = types.get(name.split(".")[-2], "F32") if w.ndim == 2 else "F32"
        stored_values = _to_gguf(model, hf, w)
        stored = encode(stored_values, kind, rng)
        raw = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, stored, raw_dtype=raw)
        reference[hf], kinds[hf] = _from_gguf(model, hf, decode(stored, kind)), kind
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Written(reference, kinds)


def _to_gguf(model: TinyModel, hf_name: str, w: np.ndarray) -> np.ndarray:
    """The converter's changes: Q/K rows permuted (llama), norms stored as 1 + w (Gemma)."""
    order = _row_order(model, hf_name)
    if order is not None:
        return w[order]
    if model.arch == "gemma3" and hf_name.endswith("norm.weight"):
        return (1 + w).astype(np.float32)
    return w


def _from_gguf(model: TinyModel, hf_name: str, w: np.ndarray) -> np.ndarray:
    """The inverse of _to_gguf, on the stored values (exact: a row permutation, and
    float32(1 + w) - 1 for values near 1)."""
    order = _row_order(model, hf_name)
    if order is not None:
        out = np.empty_like(w)
        out[order] = w
        return out
    if model.arch == "gemma3" and hf_name.endswith("norm.weight"):
        return w - np.float32(1)
    return w


def gguf_metadata(model: TinyModel) -> dict[str, Any]:
    """The architecture's and the tokenizer's keys, as the converter writes them."""
    c, a, vocab = model.config, model.arch, model.vocab
    md: dict[str, Any] = {
        "general.name": f"tiny-{a}",
        f"{a}.context_length": c["max_position_embeddings"],
        f"{a}.embedding_length": c["hidden_size"],
        f"{a}.block_count": c["num_hidden_layers"],
        f"{a}.feed_forward_length": c["intermediate_size"],
        f"{a}.attention.head_count": c["num_attention_heads"],
        f"{a}.attention.head_count_kv": c["num_key_value_heads"],
        f"{a}.rope.freq_base": c["rope_theta"],
        f"{a}.attention.layer_norm_rms_epsilon": c["rms_norm_eps"],
    }
    if c["head_dim"] != c["hidden_size"] // c["num_attention_heads"]:
        md[f"{a}.attention.key_length"] = md[f"{a}.attention.value_length"] = c["head_dim"]
    if a == "gemma3":
        md[f"{a}.attention.sliding_window"] = c["sliding_window"]
    md.update({
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": {"llama": "llama-bpe", "gemma3": "default"}.get(a, "qwen2"),
        "tokenizer.ggml.tokens": vocab.tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in vocab.tokens],
        "tokenizer.ggml.merges": vocab.merges,
        "tokenizer.ggml.bos_token_id": vocab.id(SPECIALS[0]),
        "tokenizer.ggml.eos_token_id": vocab.id(SPECIALS[2]),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    })
    return md


def _put(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


# -- the reference folder ----------------------------------------------------------------


def write_reference(folder: Path, model: TinyModel, weights: dict[str, np.ndarray]) -> Path:
    """A Hugging Face model folder with these float32 weights and the model's tokenizer."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(model.config, indent=2))
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    model.vocab.fast.save_pretrained(str(folder))
    return folder


def requantized(w: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """MLX's affine round trip of a float32 matrix (what an import does to K-quants)."""
    import mlx.core as mx

    packed, scales, biases = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
    return np.array(mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits))
