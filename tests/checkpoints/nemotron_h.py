"""A tiny Nemotron-H (nemotron_h) checkpoint: hybrid Mamba2 / attention / MoE trunk
described by a block pattern, MTP heads under `mtp.layers.{i}`.

The layout follows the released NVIDIA-Nemotron-3 checkpoints and the loaders that
read them. config.json describes the trunk's blocks with `hybrid_override_pattern`
(`M` Mamba2, `*` attention, `E` MoE, `-` MLP) and one MTP head's blocks with
`mtp_layers_block_type` (["attention", "moe"], the released spelling) or, with
`block_types="pattern"`, the older `mtp_hybrid_override_pattern` string ("*E").
Trunk tensors live under `backbone.*` (`embeddings`, `layers.{i}.norm`,
`layers.{i}.mixer.*`, `norm_f`) plus `lm_head`. Mamba2 mixers: `in_proj` (gate,
conv input x|B|C, dt), a depthwise `conv1d` in torch layout [C, 1, K] with a bias,
`A_log`, `D`, `dt_bias`, a grouped gated `norm`, `out_proj`. Attention is NoPE
(no rotary). MoE: sigmoid router `gate.weight` with `gate.e_score_correction_bias`,
per-expert non-gated relu^2 experts `experts.{e}.up_proj` / `down_proj` working in a
latent space (`fc1_latent_proj` / `fc2_latent_proj`, as in Nemotron-3 Super), and a
shared expert `shared_experts.up_proj` / `down_proj`.

One MTP head is len(blocks) consecutive layers: head k holds `mtp.layers.{kP}` ..
`mtp.layers.{kP+P-1}`; its first layer also carries `enorm`, `hnorm` and `eh_proj`
[D, 2D], its last `final_layernorm`. Each layer has the trunk's block naming
(`norm`, `mixer.*`). The embedding and output head are the trunk's.
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

D, FFN, EPS = 32, 64, 1e-5
LM_SCALE = 4.0  # output head scale: the tiny model's distributions neither flat nor one-hot
# The heads' final norm scale: their (random) drafts come out much flatter than the trunk's
# distributions, so rejections are frequent and the engine's chi-square test tells a wrong
# residual apart at n=800 (at 1.0 its negative control only reached p ~ 1e-6).
HEAD_SCALE = 0.15
PATTERN = "ME*M-E"  # Mamba2, MoE, attention, Mamba2, MLP, MoE
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
M_HEADS, M_HEAD_DIM, GROUPS, STATE, CONV = 4, 8, 2, 8, 4
EXPERTS, TOP_K, MOE_FFN, SHARED_FFN, LATENT = 4, 2, 16, 16, 16
MTP_BLOCKS = ("attention", "moe")
_SYMBOL = {"attention": "*", "moe": "E", "mlp": "-", "mamba": "M"}
INNER = M_HEADS * M_HEAD_DIM
CONV_DIM = INNER + 2 * GROUPS * STATE


def mamba(w: RandomWeights, p: str) -> dict:
    return {
        f"{p}in_proj.weight": w.matrix(INNER + CONV_DIM + M_HEADS, D),
        f"{p}conv1d.weight": w.like((CONV_DIM, 1, CONV), 0.3),
        f"{p}conv1d.bias": w.vector(CONV_DIM, 0.1),
        # Decay rates A in [1, 4] with dt around softplus(0.5): state neither explodes nor vanishes.
        f"{p}A_log": np.log(w.rng.uniform(1.0, 4.0, size=(M_HEADS,))),
        f"{p}D": 1.0 + w.vector(M_HEADS, 0.1),
        f"{p}dt_bias": w.like((M_HEADS,), 0.5),
        f"{p}norm.weight": w.norm(INNER),
        f"{p}out_proj.weight": w.matrix(D, INNER),
    }


def attention(w: RandomWeights, p: str) -> dict:
    return {
        f"{p}q_proj.weight": w.matrix(HEADS * HEAD_DIM, D),
        f"{p}k_proj.weight": w.matrix(KV_HEADS * HEAD_DIM, D),
        f"{p}v_proj.weight": w.matrix(KV_HEADS * HEAD_DIM, D),
        f"{p}o_proj.weight": w.matrix(D, HEADS * HEAD_DIM),
    }


def mlp(w: RandomWeights, p: str, ffn: int = FFN) -> dict:
    return {f"{p}up_proj.weight": w.matrix(ffn, D), f"{p}down_proj.weight": w.matrix(D, ffn)}


def moe(w: RandomWeights, p: str) -> dict:
    out = {
        f"{p}gate.weight": w.matrix(EXPERTS, D),
        f"{p}gate.e_score_correction_bias": w.vector(EXPERTS, 0.1),
        f"{p}fc1_latent_proj.weight": w.matrix(LATENT, D),
        f"{p}fc2_latent_proj.weight": w.matrix(D, LATENT),
        **mlp(w, f"{p}shared_experts.", SHARED_FFN),
    }
    for e in range(EXPERTS):
        out[f"{p}experts.{e}.up_proj.weight"] = w.matrix(MOE_FFN, LATENT)
        out[f"{p}experts.{e}.down_proj.weight"] = w.matrix(LATENT, MOE_FFN)
    return out


MIXERS = {"M": mamba, "*": attention, "E": moe, "-": mlp}


def block(w: RandomWeights, p: str, symbol: str) -> dict:
    return {f"{p}norm.weight": w.norm(D), **MIXERS[symbol](w, f"{p}mixer.")}


def mtp_layers(w: RandomWeights, heads: int, blocks: tuple[str, ...]) -> dict:
    out: dict = {}
    for k in range(heads):
        for j, kind in enumerate(blocks):
            p = f"mtp.layers.{k * len(blocks) + j}."
            if j == 0:
                out[f"{p}enorm.weight"] = w.norm(D)
                out[f"{p}hnorm.weight"] = w.norm(D)
                out[f"{p}eh_proj.weight"] = w.matrix(D, 2 * D)
            out.update(block(w, p, _SYMBOL[kind]))
            if j == len(blocks) - 1:
                out[f"{p}final_layernorm.weight"] = w.norm(D) * HEAD_SCALE
    return out


def write_checkpoint(folder: Path, *, mtp_heads: int = 1, sidecar: bool = False, seed: int = 0,
                     n_chars: int | None = None, block_types: str = "list") -> Path:
    """`block_types`: "list" writes `mtp_layers_block_type` (released configs), "pattern"
    the older `mtp_hybrid_override_pattern` string."""
    vocab = tokenizer_vocab_size(n_chars or len(CHARS))
    w = RandomWeights(seed)
    trunk = {
        "backbone.embeddings.weight": w.like((vocab, D), 1.0),
        "backbone.norm_f.weight": w.norm(D),
        "lm_head.weight": w.matrix(vocab, D) * LM_SCALE,
    }
    for i, symbol in enumerate(PATTERN):
        trunk.update(block(w, f"backbone.layers.{i}.", symbol))
    heads = mtp_layers(w, mtp_heads, MTP_BLOCKS)
    if sidecar:
        save_tensors(folder / "model.safetensors", trunk)
        save_tensors(folder / "mtp.safetensors", heads)
    else:
        save_tensors(folder / "model.safetensors", {**trunk, **heads})
    write_config(folder, config(vocab, mtp_heads, block_types))
    write_tokenizer(folder, n_chars or len(CHARS))
    return folder


def config(vocab: int, mtp_heads: int, block_types: str = "list") -> dict:
    out = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": vocab,
        "hidden_size": D,
        "intermediate_size": FFN,
        "num_hidden_layers": len(PATTERN),
        "hybrid_override_pattern": PATTERN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mamba_num_heads": M_HEADS,
        "mamba_head_dim": M_HEAD_DIM,
        "n_groups": GROUPS,
        "ssm_state_size": STATE,
        "conv_kernel": CONV,
        "chunk_size": 128,
        "expand": 2,
        "mamba_hidden_act": "silu",
        "mamba_proj_bias": False,
        "use_conv_bias": True,
        "use_bias": False,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "time_step_limit": [0.0, float("inf")],
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 0.0001,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": MOE_FFN,
        "moe_shared_expert_intermediate_size": SHARED_FFN,
        "moe_latent_size": LATENT,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": mtp_heads,
        "layer_norm_epsilon": EPS,
        "norm_eps": EPS,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "rope_theta": 10000,
        "partial_rotary_factor": 1.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if block_types == "pattern":
        out["mtp_hybrid_override_pattern"] = "".join(_SYMBOL[b] for b in MTP_BLOCKS)
    else:
        out["mtp_layers_block_type"] = list(MTP_BLOCKS)
    return out
