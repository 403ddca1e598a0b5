"""A tiny Qwen3-Next checkpoint in the released layout (Qwen/Qwen3-Next-80B-A3B-*).

Hybrid trunk: every `full_attention_interval`-th layer is gated attention, the
rest GatedDeltaNet (`linear_attn.*`); every MLP is MoE with per-expert tensors
and a gated shared expert. The MTP head lives under `mtp.*` and the config has
no MTP count field, like the real one. Qwen's RMSNorm weights are stored
zero-centred (the model applies 1 + w); `linear_attn.norm` is a plain one.

The block builders are reused by the Qwen3.5 writers.
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

D, LAYERS, INTERVAL, EPS = 32, 4, 2, 1e-6
HEADS, KV_HEADS, HEAD_DIM, ROTARY = 4, 2, 16, 0.25
K_HEADS, V_HEADS, K_DIM, V_DIM, CONV = 2, 4, 8, 8, 4
EXPERTS, TOP_K, MOE_FFN, SHARED_FFN, FFN = 4, 2, 16, 16, 64
KEY_DIM, VALUE_DIM = K_HEADS * K_DIM, V_HEADS * V_DIM


def attention(w: RandomWeights, p: str) -> dict:
    """Gated attention: q_proj also emits the output gate, hence twice the width."""
    return {
        f"{p}self_attn.q_proj.weight": w.matrix(2 * HEADS * HEAD_DIM, D),
        f"{p}self_attn.k_proj.weight": w.matrix(KV_HEADS * HEAD_DIM, D),
        f"{p}self_attn.v_proj.weight": w.matrix(KV_HEADS * HEAD_DIM, D),
        f"{p}self_attn.o_proj.weight": w.matrix(D, HEADS * HEAD_DIM),
        f"{p}self_attn.q_norm.weight": w.norm(HEAD_DIM, zero_centred=True),
        f"{p}self_attn.k_norm.weight": w.norm(HEAD_DIM, zero_centred=True),
    }


def gdn_common(w: RandomWeights, p: str) -> dict:
    """GatedDeltaNet tensors both generations share; conv1d in torch layout [C, 1, K]."""
    return {
        f"{p}linear_attn.conv1d.weight": w.like((2 * KEY_DIM + VALUE_DIM, 1, CONV), 0.3),
        f"{p}linear_attn.dt_bias": w.like((V_HEADS,), 0.5),
        # Decay rates A in [1, 4]: state neither explodes nor vanishes in a few steps.
        f"{p}linear_attn.A_log": np.log(w.rng.uniform(1.0, 4.0, size=(V_HEADS,))),
        f"{p}linear_attn.norm.weight": w.norm(V_DIM),  # plain RMSNorm: around 1
        f"{p}linear_attn.out_proj.weight": w.matrix(D, VALUE_DIM),
    }


def gated_delta_net(w: RandomWeights, p: str) -> dict:
    """Qwen3-Next's GDN: fused qkvz and ba input projections."""
    return {
        **gdn_common(w, p),
        f"{p}linear_attn.in_proj_qkvz.weight": w.matrix(2 * KEY_DIM + 2 * VALUE_DIM, D),
        f"{p}linear_attn.in_proj_ba.weight": w.matrix(2 * V_HEADS, D),
    }


def shared_expert(w: RandomWeights, p: str) -> dict:
    return {
        f"{p}mlp.gate.weight": w.matrix(EXPERTS, D),
        f"{p}mlp.shared_expert.gate_proj.weight": w.matrix(SHARED_FFN, D),
        f"{p}mlp.shared_expert.up_proj.weight": w.matrix(SHARED_FFN, D),
        f"{p}mlp.shared_expert.down_proj.weight": w.matrix(D, SHARED_FFN),
        f"{p}mlp.shared_expert_gate.weight": w.matrix(1, D),
    }


def moe_per_expert(w: RandomWeights, p: str) -> dict:
    out = shared_expert(w, p)
    for e in range(EXPERTS):
        out[f"{p}mlp.experts.{e}.gate_proj.weight"] = w.matrix(MOE_FFN, D)
        out[f"{p}mlp.experts.{e}.up_proj.weight"] = w.matrix(MOE_FFN, D)
        out[f"{p}mlp.experts.{e}.down_proj.weight"] = w.matrix(D, MOE_FFN)
    return out


def decoder_layer(w: RandomWeights, p: str, linear: bool, mixer, mlp) -> dict:
    return {
        **(mixer(w, p) if linear else attention(w, p)),
        **mlp(w, p),
        f"{p}input_layernorm.weight": w.norm(D, zero_centred=True),
        f"{p}post_attention_layernorm.weight": w.norm(D, zero_centred=True),
    }


def is_linear(layer: int) -> bool:
    return (layer + 1) % INTERVAL != 0


def mtp_head(w: RandomWeights, prefix: str, heads: int, mlp) -> dict:
    """`{prefix}fc`, the pre-fc norms and final norm (shared), plus one layer per head."""
    out = {
        f"{prefix}fc.weight": w.matrix(D, 2 * D),
        f"{prefix}pre_fc_norm_embedding.weight": w.norm(D, zero_centred=True),
        f"{prefix}pre_fc_norm_hidden.weight": w.norm(D, zero_centred=True),
        f"{prefix}norm.weight": w.norm(D, zero_centred=True),
    }
    for i in range(heads):
        out.update(decoder_layer(w, f"{prefix}layers.{i}.", False, None, mlp))
    return out


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
        "model.norm.weight": w.norm(D, zero_centred=True),
        "lm_head.weight": w.matrix(vocab, D) * 4.0,
    }
    for i in range(LAYERS):
        trunk.update(decoder_layer(w, f"model.layers.{i}.", is_linear(i), gated_delta_net, moe_per_expert))
    heads = mtp_head(w, "mtp.", mtp_heads, moe_per_expert)
    save(folder, trunk, heads, sidecar)
    write_config(folder, {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": D,
        "num_hidden_layers": LAYERS,
        "full_attention_interval": INTERVAL,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "partial_rotary_factor": ROTARY,
        "rope_theta": 10000000,
        "rope_scaling": None,
        "attention_bias": False,
        "linear_num_key_heads": K_HEADS,
        "linear_num_value_heads": V_HEADS,
        "linear_key_head_dim": K_DIM,
        "linear_value_head_dim": V_DIM,
        "linear_conv_kernel_dim": CONV,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": MOE_FFN,
        "shared_expert_intermediate_size": SHARED_FFN,
        "intermediate_size": FFN,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "rms_norm_eps": EPS,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    })
    write_tokenizer(folder)
    return folder
