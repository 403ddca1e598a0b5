"""A tiny GLM-4.5 (glm4_moe) checkpoint: GQA + MoE trunk, nextn heads `model.layers.{N+i}`.

Attention as in GLM-4.5: q/k/v biases, no o_proj bias, head_dim independent of
hidden_size, rope on half of each head (partial_rotary_factor 0.5); qk norm on
to exercise those keys. MLP and nextn tensors share DeepSeek-V3's key names.
"""

from pathlib import Path

from tests.checkpoints.common import (
    RandomWeights,
    tokenizer_vocab_size,
    write_config,
    write_tokenizer,
)
from tests.checkpoints.deepseek_v3 import dense_mlp, moe_mlp, nextn_layer, save

D, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 32, 3, 4, 2, 16, 64
EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, MOE_FFN, SHARED = 4, 2, 2, 1, 16, 1
FIRST_DENSE = 1


def attention(w: RandomWeights, p: str) -> dict:
    return {
        f"{p}self_attn.q_proj.weight": w.matrix(HEADS * HEAD_DIM, D),
        f"{p}self_attn.q_proj.bias": w.vector(HEADS * HEAD_DIM),
        f"{p}self_attn.k_proj.weight": w.matrix(KV_HEADS * HEAD_DIM, D),
        f"{p}self_attn.k_proj.bias": w.vector(KV_HEADS * HEAD_DIM),
        f"{p}self_attn.v_proj.weight": w.matrix(KV_HEADS * HEAD_DIM, D),
        f"{p}self_attn.v_proj.bias": w.vector(KV_HEADS * HEAD_DIM),
        f"{p}self_attn.o_proj.weight": w.matrix(D, HEADS * HEAD_DIM),
        f"{p}self_attn.q_norm.weight": w.norm(HEAD_DIM),
        f"{p}self_attn.k_norm.weight": w.norm(HEAD_DIM),
    }


def decoder_block(w: RandomWeights, p: str, layer: int) -> dict:
    if layer < FIRST_DENSE:
        mlp = dense_mlp(w, f"{p}mlp.", D, FFN)
    else:
        mlp = moe_mlp(w, p, D, EXPERTS, MOE_FFN, SHARED)
    return {
        **attention(w, p),
        **mlp,
        f"{p}input_layernorm.weight": w.norm(D),
        f"{p}post_attention_layernorm.weight": w.norm(D),
    }


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
    heads = {}
    for i in range(mtp_heads):
        layer = LAYERS + i
        block = decoder_block(w, f"model.layers.{layer}.", layer)
        heads.update(nextn_layer(w, layer, D, block, trunk))
    save(folder, trunk, heads, sidecar)
    write_config(folder, {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": vocab,
        "hidden_size": D,
        "intermediate_size": FFN,
        "moe_intermediate_size": MOE_FFN,
        "num_hidden_layers": LAYERS,
        "num_nextn_predict_layers": mtp_heads,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": True,
        "n_shared_experts": SHARED,
        "n_routed_experts": EXPERTS,
        "routed_scaling_factor": 2.5,
        "n_group": N_GROUP,
        "topk_group": TOPK_GROUP,
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": True,
        "first_k_dense_replace": FIRST_DENSE,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    })
    write_tokenizer(folder)
    return folder
