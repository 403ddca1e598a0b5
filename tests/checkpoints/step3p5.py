"""A tiny Step-3.5 (step3p5) checkpoint: full and sliding-window attention with a
per-head output gate, MoE trunk, next-n MTP heads appended as `model.layers.{N+i}`.

The layout follows the released Step-3.5-Flash checkpoint and the loaders that read
it. Norms are zero-centred (stored around 0; the loader adds 1). Per-layer lists in
config.json (`layer_types`, `rope_theta`, `partial_rotary_factors`,
`swiglu_limits`, `swiglu_limits_shared`) cover the trunk's layers and then
`num_nextn_predict_layers` MTP layers; `moe_layers_enum` names the MoE layers (dense first and last
trunk layers, dense MTP layers); sliding-window layers take their head counts from
`attention_other_setting`. MoE layers store their experts packed, one 3-D tensor per
projection (`moe.gate_proj.weight` [E, I, D]), with `moe.gate.weight`,
`moe.router_bias` and a `share_expert`. Each MTP layer holds a trunk-type block plus
`enorm`, `hnorm`, `eh_proj` [D, 2D] and `transformer.shared_head.norm`, and a copy
of the output head, `transformer.shared_head.output.weight`.
"""

from pathlib import Path

import numpy as np

from tests.checkpoints.common import (
    CHARS,
    RandomWeights,
    save_tensors,
    tokenizer_vocab_size,
    write_config,
    write_tokenizer,
)
from tests.checkpoints.deepseek_v3 import dense_mlp

D, FFN, LAYERS = 32, 64, 5
HEADS, GROUPS, SWA_HEADS, HEAD_DIM = 4, 2, 8, 8
WINDOW = 8
EXPERTS, TOP_K, MOE_FFN, SHARE_FFN = 4, 2, 16, 16
MOE_LAYERS = (1, 2, 3)


def layer_type(layer: int) -> str:
    # As released: a global layer every 4th, from layer 0; the MTP layers follow on.
    return "full_attention" if layer % 4 == 0 else "sliding_attention"


def attention(w: RandomWeights, p: str, layer: int) -> dict:
    heads = SWA_HEADS if layer_type(layer) == "sliding_attention" else HEADS
    return {
        f"{p}self_attn.q_proj.weight": w.matrix(heads * HEAD_DIM, D),
        f"{p}self_attn.k_proj.weight": w.matrix(GROUPS * HEAD_DIM, D),
        f"{p}self_attn.v_proj.weight": w.matrix(GROUPS * HEAD_DIM, D),
        f"{p}self_attn.o_proj.weight": w.matrix(D, heads * HEAD_DIM),
        f"{p}self_attn.g_proj.weight": w.matrix(heads, D),
        f"{p}self_attn.q_norm.weight": w.norm(HEAD_DIM, zero_centred=True),
        f"{p}self_attn.k_norm.weight": w.norm(HEAD_DIM, zero_centred=True),
    }


def moe(w: RandomWeights, p: str) -> dict:
    def packed(rows: int, cols: int) -> np.ndarray:
        return np.stack([w.matrix(rows, cols) for _ in range(EXPERTS)])

    return {
        f"{p}moe.gate.weight": w.matrix(EXPERTS, D),
        f"{p}moe.router_bias": w.vector(EXPERTS, 0.1),
        f"{p}moe.gate_proj.weight": packed(MOE_FFN, D),
        f"{p}moe.up_proj.weight": packed(MOE_FFN, D),
        f"{p}moe.down_proj.weight": packed(D, MOE_FFN),
        **dense_mlp(w, f"{p}share_expert.", D, SHARE_FFN),
    }


def decoder_block(w: RandomWeights, layer: int) -> dict:
    p = f"model.layers.{layer}."
    return {
        **attention(w, p, layer),
        **(moe(w, p) if layer in MOE_LAYERS else dense_mlp(w, f"{p}mlp.", D, FFN)),
        f"{p}input_layernorm.weight": w.norm(D, zero_centred=True),
        f"{p}post_attention_layernorm.weight": w.norm(D, zero_centred=True),
    }


def mtp_layer(w: RandomWeights, layer: int, lm_head: np.ndarray) -> dict:
    p = f"model.layers.{layer}."
    return {
        **decoder_block(w, layer),
        f"{p}enorm.weight": w.norm(D, zero_centred=True),
        f"{p}hnorm.weight": w.norm(D, zero_centred=True),
        f"{p}eh_proj.weight": w.matrix(D, 2 * D),
        f"{p}transformer.shared_head.norm.weight": w.norm(D, zero_centred=True),
        f"{p}transformer.shared_head.output.weight": lm_head,
    }


def write_checkpoint(folder: Path, *, mtp_heads: int = 1, sidecar: bool = False, seed: int = 0,
                     n_chars: int | None = None) -> Path:
    vocab = tokenizer_vocab_size(n_chars or len(CHARS))
    w = RandomWeights(seed)
    trunk = {
        "model.embed_tokens.weight": w.like((vocab, D), 1.0),
        "model.norm.weight": w.norm(D, zero_centred=True),
        "lm_head.weight": w.matrix(vocab, D) * 4.0,
    }
    for layer in range(LAYERS):
        trunk.update(decoder_block(w, layer))
    heads = {k: v for i in range(mtp_heads) for k, v in mtp_layer(w, LAYERS + i, trunk["lm_head.weight"]).items()}
    if sidecar:
        save_tensors(folder / "model.safetensors", trunk)
        save_tensors(folder / "mtp.safetensors", heads)
    else:
        save_tensors(folder / "model.safetensors", {**trunk, **heads})
    write_config(folder, config(vocab, mtp_heads))
    write_tokenizer(folder, n_chars or len(CHARS))
    return folder


def config(vocab: int, mtp_heads: int) -> dict:
    # The per-layer lists cover the MTP layers too, num_nextn_predict_layers of them (transformers
    # splits that tail off and checks what is left against num_hidden_layers).
    layers = range(LAYERS + mtp_heads)
    return {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "vocab_size": vocab,
        "hidden_size": D,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_nextn_predict_layers": mtp_heads,
        "num_attention_heads": HEADS,
        "num_attention_groups": GROUPS,
        "head_dim": HEAD_DIM,
        "att_impl_type": "GQA",
        "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": SWA_HEADS,
                                    "num_attention_groups": GROUPS, "head_dim": HEAD_DIM,
                                    "true_head_dim": HEAD_DIM},
        "use_head_wise_attn_gate": True,
        "layer_types": [layer_type(i) for i in layers],
        "sliding_window": WINDOW,
        "rope_theta": [5000000.0 if layer_type(i) == "full_attention" else 10000.0 for i in layers],
        "partial_rotary_factors": [0.5 if layer_type(i) == "full_attention" else 1.0 for i in layers],
        "yarn_only_types": ["full_attention"],
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "moe_layers_enum": ",".join(map(str, MOE_LAYERS)),
        "moe_num_experts": EXPERTS,
        "moe_top_k": TOP_K,
        "moe_intermediate_size": MOE_FFN,
        "share_expert_dim": SHARE_FFN,
        "moe_router_activation": "sigmoid",
        "moe_router_scaling_factor": 3.0,
        "norm_expert_weight": True,
        "use_moe_router_bias": True,
        "need_fp32_gate": True,
        "swiglu_limits": [7.0 if i == 3 else 0.0 for i in layers],
        "swiglu_limits_shared": [16.0 if i == 3 else 0.0 for i in layers],
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
