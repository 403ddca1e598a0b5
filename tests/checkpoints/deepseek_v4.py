"""A tiny DeepSeek-V4 (deepseek_v4, DeepseekV4ForCausalLM) checkpoint in the release's
own layout: `embed.weight`, `layers.{i}.attn.*` / `ffn.*` / `hc_{attn,ffn}_*`, `norm`,
`head`, `hc_head_*`, MTP heads under `mtp.{i}.*` (`enorm`, `hnorm`, `e_proj`, `h_proj`,
`norm`, `hc_head_*` and a block of the trunk's kind); no copy of the embedding or head.

Layers: a window-only layer routed by token hash (`ffn.gate.tid2eid`, no bias), a
ratio-4 layer (overlapping compressor plus lightning indexer, `attn.compressor.*`,
`attn.indexer.*`), a ratio-128 layer (plain compressor); the MTP layers window-only, as
the release's trailing `compress_ratios` entry. Config fields as the released config.json
names them. Dtypes as released where it matters to the layout: `tid2eid` int32; the
hyper-connection tensors, `attn_sink`, compressor `ape` and `gate.bias` float32 (there and
here); the matrices float32 here (bf16 / FP8 / FP4 in the release).

`compress_ratios` is an option: the default [0, 4, 128] needs prompts past 128 tokens
before the ratio-128 layer attends anything.
"""

from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.checkpoints.common import CHARS, RandomWeights, tokenizer_vocab_size, write_config, write_tokenizer

D, HEADS, HEAD_DIM, ROPE_DIM = 32, 4, 16, 8
Q_RANK, O_GROUPS, O_RANK = 16, 2, 8
INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 2, 8, 2
EXPERTS, TOP_K, MOE_FFN = 4, 2, 16
HC, WINDOW, HASH_LAYERS = 4, 8, 1
RATIOS = (0, 4, 128)


def compressor(w: RandomWeights, p: str, ratio: int, dims: int) -> dict:
    width = (2 if ratio == 4 else 1) * dims
    return {
        f"{p}ape": w.like((ratio, width), 0.5),
        f"{p}wkv.weight": w.matrix(width, D),
        f"{p}wgate.weight": w.matrix(width, D),
        f"{p}norm.weight": w.norm(dims),
    }


def attention(w: RandomWeights, p: str, ratio: int) -> dict:
    out = {
        f"{p}wq_a.weight": w.matrix(Q_RANK, D),
        f"{p}q_norm.weight": w.norm(Q_RANK),
        f"{p}wq_b.weight": w.matrix(HEADS * HEAD_DIM, Q_RANK),
        f"{p}wkv.weight": w.matrix(HEAD_DIM, D),
        f"{p}kv_norm.weight": w.norm(HEAD_DIM),
        f"{p}wo_a.weight": w.matrix(O_GROUPS * O_RANK, HEADS * HEAD_DIM // O_GROUPS),
        f"{p}wo_b.weight": w.matrix(D, O_GROUPS * O_RANK),
        f"{p}attn_sink": w.vector(HEADS, 1.0),
    }
    if ratio:
        out.update(compressor(w, f"{p}compressor.", ratio, HEAD_DIM))
    if ratio == 4:
        out.update({
            f"{p}indexer.wq_b.weight": w.matrix(INDEX_HEADS * INDEX_DIM, Q_RANK),
            f"{p}indexer.weights_proj.weight": w.matrix(INDEX_HEADS, D),
            **compressor(w, f"{p}indexer.compressor.", ratio, INDEX_DIM),
        })
    return out


def expert(w: RandomWeights, p: str) -> dict:
    return {f"{p}w1.weight": w.matrix(MOE_FFN, D), f"{p}w2.weight": w.matrix(D, MOE_FFN),
            f"{p}w3.weight": w.matrix(MOE_FFN, D)}


def ffn(w: RandomWeights, p: str, hashed: bool, vocab: int) -> dict:
    out = {f"{p}gate.weight": w.matrix(EXPERTS, D), **expert(w, f"{p}shared_experts.")}
    if hashed:  # each token's experts, fixed
        out[f"{p}gate.tid2eid"] = np.stack([w.rng.permutation(EXPERTS)[:TOP_K] for _ in range(vocab)]).astype(np.int32)
    else:
        out[f"{p}gate.bias"] = w.vector(EXPERTS, 0.1)
    for e in range(EXPERTS):
        out.update(expert(w, f"{p}experts.{e}."))
    return out


def hyper(w: RandomWeights, p: str, part: str, mix: int) -> dict:
    return {
        f"{p}hc_{part}_fn": w.matrix(mix, HC * D),
        f"{p}hc_{part}_base": w.vector(mix, 0.5),
        f"{p}hc_{part}_scale": 1.0 + w.vector(3 if part != "head" else 1, 0.2),
    }


def block(w: RandomWeights, p: str, layer: int, ratio: int, vocab: int) -> dict:
    mix = (2 + HC) * HC
    return {
        **attention(w, f"{p}attn.", ratio),
        **ffn(w, f"{p}ffn.", layer < HASH_LAYERS, vocab),
        f"{p}attn_norm.weight": w.norm(D),
        f"{p}ffn_norm.weight": w.norm(D),
        **hyper(w, p, "attn", mix),
        **hyper(w, p, "ffn", mix),
    }


def mtp_layer(w: RandomWeights, i: int, layer: int, vocab: int) -> dict:
    p = f"mtp.{i}."
    return {
        **block(w, p, layer, 0, vocab),
        f"{p}enorm.weight": w.norm(D),
        f"{p}hnorm.weight": w.norm(D),
        f"{p}e_proj.weight": w.matrix(D, D),
        f"{p}h_proj.weight": w.matrix(D, D),
        f"{p}norm.weight": w.norm(D),
        **hyper(w, p, "head", HC),
    }


def _save(path: Path, tensors: dict) -> None:
    """float32, except the integer tables (tid2eid), as the release stores them."""
    def cast(v: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(v, dtype=np.int32 if v.dtype.kind in "iu" else np.float32)

    save_file({k: cast(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def write_checkpoint(folder: Path, *, mtp_heads: int = 1, sidecar: bool = False, seed: int = 0,
                     n_chars: int | None = None, compress_ratios: tuple[int, ...] = RATIOS) -> Path:
    vocab = tokenizer_vocab_size(n_chars or len(CHARS))
    w = RandomWeights(seed)
    n = len(compress_ratios)
    trunk = {
        "embed.weight": w.like((vocab, D), 1.0),
        "norm.weight": w.norm(D),
        "head.weight": w.matrix(vocab, D) * 4.0,
        **hyper(w, "", "head", HC),
    }
    for layer, ratio in enumerate(compress_ratios):
        trunk.update(block(w, f"layers.{layer}.", layer, ratio, vocab))
    heads = {k: v for i in range(mtp_heads) for k, v in mtp_layer(w, i, n + i, vocab).items()}
    if sidecar:
        _save(folder / "model.safetensors", trunk)
        _save(folder / "mtp.safetensors", heads)
    else:
        _save(folder / "model.safetensors", {**trunk, **heads})
    write_config(folder, config(vocab, mtp_heads, list(compress_ratios)))
    write_tokenizer(folder, n_chars or len(CHARS))
    return folder


def config(vocab: int, mtp_heads: int, ratios: list[int]) -> dict:
    # The released config's fields (deepseek-ai/DeepSeek-V4-Flash), with tiny dimensions:
    # compress_ratios lists the MTP layers too (a trailing 0 each).
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab,
        "hidden_size": D,
        "moe_intermediate_size": MOE_FFN,
        "num_hidden_layers": len(ratios),
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "qk_rope_head_dim": ROPE_DIM,
        "q_lora_rank": Q_RANK,
        "o_groups": O_GROUPS,
        "o_lora_rank": O_RANK,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": TOP_K,
        "first_k_dense_replace": 0,
        "num_hash_layers": HASH_LAYERS,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "sliding_window": WINDOW,
        "compress_ratios": ratios + [0] * mtp_heads,
        "compress_rope_theta": 160000,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        "index_n_heads": INDEX_HEADS,
        "index_head_dim": INDEX_DIM,
        "index_topk": INDEX_TOPK,
        "hc_mult": HC,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "num_nextn_predict_layers": mtp_heads,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
