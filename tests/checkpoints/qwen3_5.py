"""A tiny Qwen3.5 checkpoint in the released vision-language layout (Qwen/Qwen3.5-*).

config.json nests the language model under `text_config` (with
`mtp_num_hidden_layers`, `layer_types`, `rope_parameters`); trunk tensors sit
under `model.language_model.*` beside a vision tower `model.visual.*`; the
MTP head under `mtp.*`. The dense model ties its embeddings (no
`lm_head.weight`, like the small releases); the MoE one (qwen3_5_moe.py)
stores its experts fused, `experts.gate_up_proj` [E, 2I, D] and
`experts.down_proj` [E, D, I], in the trunk and in the head alike.
"""

from pathlib import Path

from tests.checkpoints.common import RandomWeights, tokenizer_vocab_size, write_config, write_tokenizer
from tests.checkpoints.qwen3_next import (
    CONV, D, EPS, EXPERTS, FFN, HEAD_DIM, HEADS, INTERVAL, K_DIM, K_HEADS, KEY_DIM, KV_HEADS,
    LAYERS, MOE_FFN, ROTARY, SHARED_FFN, TOP_K, V_DIM, V_HEADS, VALUE_DIM,
    decoder_layer, gdn_common, is_linear, mtp_head, save, shared_expert,
)

TEXT = "model.language_model."


def gated_delta_net(w: RandomWeights, p: str) -> dict:
    """Qwen3.5's GDN: separate qkv, z, b and a input projections."""
    return {
        **gdn_common(w, p),
        f"{p}linear_attn.in_proj_qkv.weight": w.matrix(2 * KEY_DIM + VALUE_DIM, D),
        f"{p}linear_attn.in_proj_z.weight": w.matrix(VALUE_DIM, D),
        f"{p}linear_attn.in_proj_b.weight": w.matrix(V_HEADS, D),
        f"{p}linear_attn.in_proj_a.weight": w.matrix(V_HEADS, D),
    }


def dense_mlp(w: RandomWeights, p: str) -> dict:
    return {
        f"{p}mlp.gate_proj.weight": w.matrix(FFN, D),
        f"{p}mlp.up_proj.weight": w.matrix(FFN, D),
        f"{p}mlp.down_proj.weight": w.matrix(D, FFN),
    }


def moe_fused(w: RandomWeights, p: str) -> dict:
    return {
        **shared_expert(w, p),
        f"{p}mlp.experts.gate_up_proj": w.like((EXPERTS, 2 * MOE_FFN, D), D**-0.5),
        f"{p}mlp.experts.down_proj": w.like((EXPERTS, D, MOE_FFN), MOE_FFN**-0.5),
    }


def vision_tower(w: RandomWeights) -> dict:
    """A token vision tower: only there to be skipped."""
    return {
        "model.visual.patch_embed.proj.weight": w.like((8, 3, 2, 2, 2)),
        "model.visual.blocks.0.norm1.weight": w.norm(8),
        "model.visual.merger.linear_fc2.weight": w.matrix(D, 8),
    }


def text_config(moe: bool, vocab: int, mtp_heads: int) -> dict:
    config = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "hidden_size": D,
        "num_hidden_layers": LAYERS,
        "full_attention_interval": INTERVAL,
        "layer_types": ["linear_attention" if is_linear(i) else "full_attention" for i in range(LAYERS)],
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "attn_output_gate": True,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": ROTARY,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
        "linear_num_key_heads": K_HEADS,
        "linear_num_value_heads": V_HEADS,
        "linear_key_head_dim": K_DIM,
        "linear_value_head_dim": V_DIM,
        "linear_conv_kernel_dim": CONV,
        "hidden_act": "silu",
        "rms_norm_eps": EPS,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": not moe,
        "mtp_num_hidden_layers": mtp_heads,
        "mtp_use_dedicated_embeddings": False,
        "dtype": "float32",
    }
    if moe:
        config.update({
            "num_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": MOE_FFN,
            "shared_expert_intermediate_size": SHARED_FFN,
        })
    else:
        config["intermediate_size"] = FFN
    return config


def write(folder: Path, *, moe: bool, mtp_heads: int, sidecar: bool, seed: int) -> Path:
    vocab = tokenizer_vocab_size()
    w = RandomWeights(seed)
    mlp = moe_fused if moe else dense_mlp
    # Tied embeddings double as the LM head: a smaller scale keeps the logits from saturating.
    trunk = {
        f"{TEXT}embed_tokens.weight": w.like((vocab, D), 1.0 if moe else 0.5),
        f"{TEXT}norm.weight": w.norm(D, zero_centred=True),
        **vision_tower(w),
    }
    if moe:
        trunk["lm_head.weight"] = w.matrix(vocab, D) * 4.0
    for i in range(LAYERS):
        trunk.update(decoder_layer(w, f"{TEXT}layers.{i}.", is_linear(i), gated_delta_net, mlp))
    save(folder, trunk, mtp_head(w, "mtp.", mtp_heads, mlp), sidecar)
    write_config(folder, {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text_config(moe, vocab, mtp_heads),
        "vision_config": {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "depth": 1, "hidden_size": 8,
                          "out_hidden_size": D},
        "tie_word_embeddings": not moe,
    })
    write_tokenizer(folder)
    return folder


def write_checkpoint(folder: Path, *, mtp_heads: int = 1, sidecar: bool = False, seed: int = 0) -> Path:
    return write(folder, moe=False, mtp_heads=mtp_heads, sidecar=sidecar, seed=seed)
