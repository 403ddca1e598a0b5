"""A tiny GLM-5 (glm_moe_dsa) checkpoint: DeepSeek-V3.2-style MLA with a sparse-attention
indexer, MoE trunk, next-n MTP heads appended as `model.layers.{N+i}`.

The layout follows the released GLM-5 checkpoint and the loaders that read it: every
attention layer, the MTP layer's included, carries the indexer
(`self_attn.indexer.wq_b`, `wk`, `k_norm` (a LayerNorm: weight and bias),
`weights_proj`); MLP and MoE keys as DeepSeek-V3's; rope settings under
`rope_parameters`. The MTP layer holds `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` and no copies of the embedding or output head (it shares the
trunk's). `index_topk` is small here so that the sparse selection is exercised on
short prompts (the released model keeps 2048 positions).
"""

from pathlib import Path

import numpy as np

from tests.checkpoints.common import (
    CHARS,
    RandomWeights,
    tokenizer_vocab_size,
    write_config,
    write_tokenizer,
)
from tests.checkpoints.deepseek_v3 import dense_mlp, moe_mlp, save

D, LAYERS, HEADS, FFN = 32, 3, 4, 64
EXPERTS, TOP_K, N_GROUP, TOPK_GROUP, MOE_FFN, SHARED = 4, 2, 1, 1, 16, 1
FIRST_DENSE = 1
Q_LORA, KV_LORA, ROPE_DIM, NOPE_DIM, V_DIM = 16, 16, 8, 8, 8
INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 4, 16, 6


def attention(w: RandomWeights, p: str) -> dict:
    a = f"{p}self_attn."
    return {
        f"{a}q_a_proj.weight": w.matrix(Q_LORA, D),
        f"{a}q_a_layernorm.weight": w.norm(Q_LORA),
        f"{a}q_b_proj.weight": w.matrix(HEADS * (NOPE_DIM + ROPE_DIM), Q_LORA),
        f"{a}kv_a_proj_with_mqa.weight": w.matrix(KV_LORA + ROPE_DIM, D),
        f"{a}kv_a_layernorm.weight": w.norm(KV_LORA),
        f"{a}kv_b_proj.weight": w.matrix(HEADS * (NOPE_DIM + V_DIM), KV_LORA),
        f"{a}o_proj.weight": w.matrix(D, HEADS * V_DIM),
        f"{a}indexer.wq_b.weight": w.matrix(INDEX_HEADS * INDEX_DIM, Q_LORA),
        f"{a}indexer.wk.weight": w.matrix(INDEX_DIM, D),
        f"{a}indexer.k_norm.weight": w.norm(INDEX_DIM),
        f"{a}indexer.k_norm.bias": w.vector(INDEX_DIM, 0.1),
        f"{a}indexer.weights_proj.weight": w.matrix(INDEX_HEADS, D),
    }


def decoder_block(w: RandomWeights, layer: int) -> dict:
    p = f"model.layers.{layer}."
    mlp = dense_mlp(w, f"{p}mlp.", D, FFN) if layer < FIRST_DENSE else moe_mlp(w, p, D, EXPERTS, MOE_FFN, SHARED)
    return {
        **attention(w, p),
        **mlp,
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
        f"{p}shared_head.norm.weight": w.norm(D),
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
    heads: dict[str, np.ndarray] = {}
    for i in range(mtp_heads):
        heads.update(mtp_layer(w, LAYERS + i))
    save(folder, trunk, heads, sidecar)
    write_config(folder, {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
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
        "index_n_heads": INDEX_HEADS,
        "index_head_dim": INDEX_DIM,
        "index_topk": INDEX_TOPK,
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
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    })
    write_tokenizer(folder, n_chars or len(CHARS))
    return folder
