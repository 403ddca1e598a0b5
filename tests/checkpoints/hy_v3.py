"""A tiny Hy-V3 (hy_v3, HYV3ForCausalLM) checkpoint: GQA with per-head q/k RMSNorm,
a dense first layer, then MoE layers (sigmoid router with a selection-only expert
bias, renormalised and scaled top-k weights, one shared expert); MTP heads appended
as `model.layers.{N+i}`.

The layout follows the released checkpoint's config.json and index: the router is
`mlp.router.gate.weight`, its bias `mlp.expert_bias`, the shared expert
`mlp.shared_mlp.*`, routed experts one tensor per expert and projection
(`mlp.experts.{e}.gate_proj.weight` ...). Each MTP layer holds `enorm`, `hnorm`,
`eh_proj` [D, 2D], a trunk-type block (MoE, as the released layer 80 is) and
`final_layernorm`; no copy of the embedding or the output head.
"""

from pathlib import Path

from tests.checkpoints.common import (
    CHARS,
    RandomWeights,
    save_tensors,
    tokenizer_vocab_size,
    write_config,
    write_tokenizer,
)
from tests.checkpoints.deepseek_v3 import dense_mlp

D, LAYERS, FFN = 32, 3, 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
EXPERTS, TOP_K, MOE_FFN, SHARED = 4, 2, 16, 1
FIRST_DENSE = 1


def attention(w: RandomWeights, p: str) -> dict:
    return {
        f"{p}self_attn.q_proj.weight": w.matrix(HEADS * HEAD_DIM, D),
        f"{p}self_attn.k_proj.weight": w.matrix(KV_HEADS * HEAD_DIM, D),
        f"{p}self_attn.v_proj.weight": w.matrix(KV_HEADS * HEAD_DIM, D),
        f"{p}self_attn.o_proj.weight": w.matrix(D, HEADS * HEAD_DIM),
        f"{p}self_attn.q_norm.weight": w.norm(HEAD_DIM),
        f"{p}self_attn.k_norm.weight": w.norm(HEAD_DIM),
    }


def moe(w: RandomWeights, p: str) -> dict:
    out = {
        f"{p}mlp.router.gate.weight": w.matrix(EXPERTS, D),
        f"{p}mlp.expert_bias": w.vector(EXPERTS, 0.1),
        **dense_mlp(w, f"{p}mlp.shared_mlp.", D, MOE_FFN * SHARED),
    }
    for e in range(EXPERTS):
        out.update(dense_mlp(w, f"{p}mlp.experts.{e}.", D, MOE_FFN))
    return out


def decoder_block(w: RandomWeights, layer: int) -> dict:
    p = f"model.layers.{layer}."
    return {
        **attention(w, p),
        **(dense_mlp(w, f"{p}mlp.", D, FFN) if layer < FIRST_DENSE else moe(w, p)),
        f"{p}input_layernorm.weight": w.norm(D),
        f"{p}post_attention_layernorm.weight": w.norm(D),
    }


def mtp_layer(w: RandomWeights, layer: int) -> dict:
    p = f"model.layers.{layer}."
    return {
        **decoder_block(w, layer),
        f"{p}enorm.weight": w.norm(D),
        f"{p}hnorm.weight": w.norm(D),
        f"{p}eh_proj.weight": w.matrix(D, 2 * D),
        f"{p}final_layernorm.weight": w.norm(D),
    }


def write_checkpoint(folder: Path, *, mtp_heads: int = 1, sidecar: bool = False, seed: int = 0,
                     n_chars: int | None = None) -> Path:
    vocab = tokenizer_vocab_size(n_chars or len(CHARS))
    w = RandomWeights(seed)
    trunk = {
        "model.embed_tokens.weight": w.like((vocab, D), 1.0),
        "model.norm.weight": w.norm(D),
        "lm_head.weight": w.matrix(vocab, D) * 4.0,
    }
    for layer in range(LAYERS):
        trunk.update(decoder_block(w, layer))
    heads = {k: v for i in range(mtp_heads) for k, v in mtp_layer(w, LAYERS + i).items()}
    if sidecar:
        save_tensors(folder / "model.safetensors", trunk)
        save_tensors(folder / "mtp.safetensors", heads)
    else:
        save_tensors(folder / "model.safetensors", {**trunk, **heads})
    write_config(folder, config(vocab, mtp_heads))
    write_tokenizer(folder, n_chars or len(CHARS))
    return folder


def config(vocab: int, mtp_heads: int) -> dict:
    # The released config's fields (tencent/Hy3), with tiny dimensions.
    return {
        "architectures": ["HYV3ForCausalLM"],
        "model_type": "hy_v3",
        "vocab_size": vocab,
        "hidden_size": D,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_nextn_predict_layers": mtp_heads,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "qk_norm": True,
        "first_k_dense_replace": FIRST_DENSE,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "num_shared_experts": SHARED,
        "moe_intermediate_size": MOE_FFN,
        "expert_hidden_dim": MOE_FFN,
        "moe_router_use_sigmoid": True,
        "moe_router_enable_expert_bias": True,
        "route_norm": True,
        "router_scaling_factor": 2.826,
        "enable_moe_fp32_combine": False,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 11158840.0, "rope_type": "default"},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
