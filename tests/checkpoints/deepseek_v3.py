"""A tiny DeepSeek-V3 checkpoint: MLA + MoE trunk, nextn heads `model.layers.{N+i}`.

Layer 0 is dense (first_k_dense_replace=1), layers 1-2 are MoE with 4 routed
experts (top-2 within 1 of 2 groups) and one shared expert. The nextn layers
carry copies of embed_tokens and the LM head, as the released weights do.
"""

from pathlib import Path

import numpy as np

from tests.checkpoints.common import (
    RandomWeights,
    save_tensors,
    tokenizer_vocab_size,
    write_config,
    write_tokenizer,
)

D, LAYERS, HEADS, FFN = 32, 3, 4, 64
EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, MOE_FFN, SHARED = 4, 2, 2, 1, 16, 1
FIRST_DENSE = 1
Q_LORA, KV_LORA, ROPE_DIM, NOPE_DIM, V_DIM = 16, 16, 8, 8, 8


def mla_attention(w: RandomWeights, p: str) -> dict:
    return {
        f"{p}self_attn.q_a_proj.weight": w.matrix(Q_LORA, D),
        f"{p}self_attn.q_a_layernorm.weight": w.norm(Q_LORA),
        f"{p}self_attn.q_b_proj.weight": w.matrix(HEADS * (NOPE_DIM + ROPE_DIM), Q_LORA),
        f"{p}self_attn.kv_a_proj_with_mqa.weight": w.matrix(KV_LORA + ROPE_DIM, D),
        f"{p}self_attn.kv_a_layernorm.weight": w.norm(KV_LORA),
        f"{p}self_attn.kv_b_proj.weight": w.matrix(HEADS * (NOPE_DIM + V_DIM), KV_LORA),
        f"{p}self_attn.o_proj.weight": w.matrix(D, HEADS * V_DIM),
    }


def dense_mlp(w: RandomWeights, p: str, d: int, ffn: int) -> dict:
    return {
        f"{p}gate_proj.weight": w.matrix(ffn, d),
        f"{p}up_proj.weight": w.matrix(ffn, d),
        f"{p}down_proj.weight": w.matrix(d, ffn),
    }


def moe_mlp(w: RandomWeights, p: str, d: int, experts: int, ffn: int, shared: int) -> dict:
    """Router (`gate` + its bias), per-expert HF keys, shared experts."""
    out = {
        f"{p}mlp.gate.weight": w.matrix(experts, d),
        f"{p}mlp.gate.e_score_correction_bias": w.vector(experts, 0.1),
        **dense_mlp(w, f"{p}mlp.shared_experts.", d, ffn * shared),
    }
    for e in range(experts):
        out.update(dense_mlp(w, f"{p}mlp.experts.{e}.", d, ffn))
    return out


def decoder_block(w: RandomWeights, p: str, layer: int) -> dict:
    if layer < FIRST_DENSE:
        mlp = dense_mlp(w, f"{p}mlp.", D, FFN)
    else:
        mlp = moe_mlp(w, p, D, EXPERTS, MOE_FFN, SHARED)
    return {
        **mla_attention(w, p),
        **mlp,
        f"{p}input_layernorm.weight": w.norm(D),
        f"{p}post_attention_layernorm.weight": w.norm(D),
    }


def nextn_layer(w: RandomWeights, layer: int, d: int, block: dict, shared: dict) -> dict:
    """The fusion and head tensors around `block`, plus the shared copies."""
    p = f"model.layers.{layer}."
    return {
        **block,
        f"{p}enorm.weight": w.norm(d),
        f"{p}hnorm.weight": w.norm(d),
        f"{p}eh_proj.weight": w.matrix(d, 2 * d),
        f"{p}shared_head.norm.weight": w.norm(d),
        f"{p}shared_head.head.weight": shared["lm_head.weight"],
        f"{p}embed_tokens.weight": shared["model.embed_tokens.weight"],
    }


def save(folder: Path, trunk: dict, heads: dict, sidecar: bool) -> None:
    if sidecar:
        save_tensors(folder / "model.safetensors", trunk)
        save_tensors(folder / "mtp.safetensors", heads)
    else:
        save_tensors(folder / "model.safetensors", {**trunk, **heads})


def write_checkpoint(folder: Path, *, mtp_heads: int = 1, sidecar: bool = False, seed: int = 0) -> Path:
    vocab = tokenizer_vocab_size()
    w = RandomWeights(seed)
    trunk = {
        "model.embed_tokens.weight": w.like((vocab, D), 1.0),
        "model.norm.weight": w.norm(D),
        "lm_head.weight": w.matrix(vocab, D) * 4.0,
    }
    for layer in range(LAYERS):
        trunk.update(decoder_block(w, f"model.layers.{layer}.", layer))
    heads: dict[str, np.ndarray] = {}
    for i in range(mtp_heads):
        layer = LAYERS + i
        block = decoder_block(w, f"model.layers.{layer}.", layer)
        heads.update(nextn_layer(w, layer, D, block, trunk))
    save(folder, trunk, heads, sidecar)
    write_config(folder, {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": D,
        "intermediate_size": FFN,
        "moe_intermediate_size": MOE_FFN,
        "num_hidden_layers": LAYERS,
        "num_nextn_predict_layers": mtp_heads,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "n_shared_experts": SHARED,
        "n_routed_experts": EXPERTS,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": KV_LORA,
        "q_lora_rank": Q_LORA,
        "qk_rope_head_dim": ROPE_DIM,
        "qk_nope_head_dim": NOPE_DIM,
        "v_head_dim": V_DIM,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": N_GROUP,
        "topk_group": TOPK_GROUP,
        "num_experts_per_tok": TOP_K,
        "moe_layer_freq": 1,
        "first_k_dense_replace": FIRST_DENSE,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    })
    write_tokenizer(folder)
    return folder
