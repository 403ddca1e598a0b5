"""A tiny MiMo-V2-Flash checkpoint: hybrid sliding-window / global attention, MoE
trunk, several MTP heads under `model.mtp.layers.{i}`.

The layout follows the released checkpoint and the loaders that read it:
`hybrid_layer_pattern` (1 = sliding window) and `moe_layer_freq` (1 = MoE) per
layer; sliding-window layers carry `self_attn.attention_sink_bias` (one logit per
query head) when `add_swa_attention_sink_bias`; keys and queries are
`head_dim` wide, values `v_head_dim`; experts without shared experts
(`n_shared_experts` null). Each MTP layer is a dense block with the sliding-window
attention's shape: `enorm`, `hnorm`, `eh_proj` [D, 2D], `input_layernorm`,
`self_attn.{q,k,v,o}_proj`, `self_attn.attention_sink_bias`,
`pre_mlp_layernorm`, `mlp.{gate,up,down}_proj`, `final_layernorm`. The released
config.json names no MTP count (the weights tell how many), and neither does
this one.
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

D, FFN = 32, 64
PATTERN = [0, 1, 1, 0]  # hybrid_layer_pattern: 0 global, 1 sliding window
MOE = [0, 1, 1, 1]  # moe_layer_freq: the first layer dense, as released
HEADS, KV_HEADS, SWA_HEADS, SWA_KV_HEADS = 4, 2, 4, 2
HEAD_DIM, V_HEAD_DIM = 24, 16  # partial_rotary_factor 0.334 of 24: 8 rotary dims
WINDOW = 8
EXPERTS, TOP_K, MOE_FFN = 4, 2, 16


def attention(w: RandomWeights, p: str, sliding: bool) -> dict:
    heads, kv_heads = (SWA_HEADS, SWA_KV_HEADS) if sliding else (HEADS, KV_HEADS)
    out = {
        f"{p}self_attn.q_proj.weight": w.matrix(heads * HEAD_DIM, D),
        f"{p}self_attn.k_proj.weight": w.matrix(kv_heads * HEAD_DIM, D),
        f"{p}self_attn.v_proj.weight": w.matrix(kv_heads * V_HEAD_DIM, D),
        f"{p}self_attn.o_proj.weight": w.matrix(D, heads * V_HEAD_DIM),
    }
    if sliding:  # add_swa_attention_sink_bias; add_full_attention_sink_bias is false
        out[f"{p}self_attn.attention_sink_bias"] = w.vector(heads, 0.5)
    return out


def moe(w: RandomWeights, p: str) -> dict:
    out = {
        f"{p}mlp.gate.weight": w.matrix(EXPERTS, D),
        f"{p}mlp.gate.e_score_correction_bias": w.vector(EXPERTS, 0.1),
    }
    for e in range(EXPERTS):
        out.update(dense_mlp(w, f"{p}mlp.experts.{e}.", D, MOE_FFN))
    return out


def decoder_block(w: RandomWeights, layer: int) -> dict:
    p = f"model.layers.{layer}."
    return {
        **attention(w, p, PATTERN[layer] == 1),
        **(moe(w, p) if MOE[layer] else dense_mlp(w, f"{p}mlp.", D, FFN)),
        f"{p}input_layernorm.weight": w.norm(D),
        f"{p}post_attention_layernorm.weight": w.norm(D),
    }


def mtp_layer(w: RandomWeights, i: int) -> dict:
    p = f"model.mtp.layers.{i}."
    return {
        f"{p}enorm.weight": w.norm(D),
        f"{p}hnorm.weight": w.norm(D),
        f"{p}eh_proj.weight": w.matrix(D, 2 * D),
        f"{p}input_layernorm.weight": w.norm(D),
        **attention(w, p, sliding=True),
        f"{p}pre_mlp_layernorm.weight": w.norm(D),
        **dense_mlp(w, f"{p}mlp.", D, FFN),
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
    for layer in range(len(PATTERN)):
        trunk.update(decoder_block(w, layer))
    heads = {k: v for i in range(mtp_heads) for k, v in mtp_layer(w, i).items()}
    if sidecar:
        save_tensors(folder / "model.safetensors", trunk)
        save_tensors(folder / "mtp.safetensors", heads)
    else:
        save_tensors(folder / "model.safetensors", {**trunk, **heads})
    write_config(folder, config(vocab))
    write_tokenizer(folder, n_chars or len(CHARS))
    return folder


def config(vocab: int) -> dict:
    return {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "vocab_size": vocab,
        "hidden_size": D,
        "intermediate_size": FFN,
        "moe_intermediate_size": MOE_FFN,
        "num_hidden_layers": len(PATTERN),
        "hybrid_layer_pattern": PATTERN,
        "moe_layer_freq": MOE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
        "swa_num_attention_heads": SWA_HEADS,
        "swa_num_key_value_heads": SWA_KV_HEADS,
        "swa_head_dim": HEAD_DIM,
        "swa_v_head_dim": V_HEAD_DIM,
        "sliding_window": WINDOW,
        "sliding_window_size": WINDOW,
        "add_full_attention_sink_bias": False,
        "add_swa_attention_sink_bias": True,
        "attention_value_scale": 0.707,
        "attention_bias": False,
        "partial_rotary_factor": 0.334,
        "rope_theta": 5000000.0,
        "swa_rope_theta": 10000.0,
        "n_routed_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "n_shared_experts": None,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": None,
        "hidden_act": "silu",
        "layernorm_epsilon": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
