"""Header-level checkpoints in real Hugging Face layout, for inspection tests.

config.json carries each family's real field names and the safetensors files
its real key names; every tensor is a float32 of shape (1,), since inspection
reads headers only. Not loadable by a backend: see the family writers for that.

    write_layout(family, folder, mtp_heads=1, config_heads=SAME, sidecar=False,
                 shards=1, drop=(), mtp_root="mtp.") -> folder
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

SAME = "same"  # config_heads: write the MTP count field with mtp_heads
N_LAYERS = {"mimo": 2, "deepseek_v3": 2, "glm4_moe": 2, "qwen3_next": 4, "qwen3_5": 4,
            "qwen3_5_moe": 4, "mimo_v2_flash": 2, "step3p5": 2, "glm_moe_dsa": 2, "hy_v3": 2, "deepseek_v4": 2,
            "nemotron_h": 3,
            "qwen2": 2, "llama": 2, "mistral": 2, "frobnicator": 2}
LAYOUTS = tuple(N_LAYERS)
# Families whose heads are recognised but which mtplxd cannot run yet (inspect: unsupported, with why):
# none at present (DeepSeek-V4 was one until engine/backends/deepseek_v4.py).
UNSUPPORTED_FAMILIES: tuple[str, ...] = ()
MTP_FAMILIES = tuple(f for f in LAYOUTS if f not in ("qwen2", "llama", "mistral", "frobnicator", *UNSUPPORTED_FAMILIES))
_BASE = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": 48, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": False}


def _proj(p: str, names: str, suffix: str = "_proj.weight") -> list[str]:
    return [f"{p}{n}{suffix}" for n in names.split()]


def _mha(p: str, bias: bool = False, qk_norm: bool = False) -> list[str]:
    keys = _proj(p + "self_attn.", "q k v o")
    keys += _proj(p + "self_attn.", "q k v", "_proj.bias") if bias else []
    return keys + (_proj(p + "self_attn.", "q k", "_norm.weight") if qk_norm else [])


def _mla(p: str) -> list[str]:
    return [f"{p}self_attn.{n}.weight" for n in (
        "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
        "kv_b_proj", "o_proj")]


def _mlp(p: str) -> list[str]:
    return _proj(p + "mlp.", "gate up down")


def _nextn_moe(p: str) -> list[str]:
    experts = [k for e in range(2) for k in _proj(f"{p}mlp.experts.{e}.", "gate up down")]
    shared = _proj(p + "mlp.shared_experts.", "gate up down")
    return [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"] + experts + shared


def _qwen_moe(p: str, fused: bool) -> list[str]:
    if fused:
        experts = [p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"]
    else:
        experts = [k for e in range(2) for k in _proj(f"{p}mlp.experts.{e}.", "gate up down")]
    shared = _proj(p + "mlp.shared_expert.", "gate up down")
    return [p + "mlp.gate.weight", p + "mlp.shared_expert_gate.weight"] + experts + shared


def _gdn(p: str, qwen3_5: bool) -> list[str]:
    proj = "in_proj_qkv in_proj_z in_proj_b in_proj_a" if qwen3_5 else "in_proj_qkvz in_proj_ba"
    names = proj.split() + ["conv1d", "norm", "out_proj"]
    return [f"{p}linear_attn.{n}.weight" for n in names] + [
        p + "linear_attn.A_log", p + "linear_attn.dt_bias"]


def _block(p: str, attn: list[str], mlp: list[str]) -> list[str]:
    return [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"] + attn + mlp


def _trunk(prefix: str, n: int, layer) -> list[str]:
    keys = [prefix + "embed_tokens.weight", prefix + "norm.weight", "lm_head.weight"]
    return keys + [k for i in range(n) for k in layer(f"{prefix}layers.{i}.", i)]


# --- families: each returns (config, trunk keys, MTP keys) ----------------------------

def _mimo(n: int, heads: int, root: str):
    config = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo",
              "auto_map": {"AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"}}
    trunk = _trunk("model.", n, lambda p, i: _block(p, _mha(p, bias=True), _mlp(p)))
    mtp = [k for i in range(heads) for k in _block(
        f"model.mtp_layers.{i}.", _mha(f"model.mtp_layers.{i}.", bias=True),
        _mlp(f"model.mtp_layers.{i}.")) + [f"model.mtp_layers.{i}.{x}.weight" for x in (
            "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")]]
    return config, trunk, mtp, "num_nextn_predict_layers"


def _nextn(family: str, n: int, heads: int, root: str):
    deepseek = family == "deepseek_v3"
    arch = "DeepseekV3ForCausalLM" if deepseek else "Glm4MoeForCausalLM"
    config = {"architectures": [arch], "model_type": family, "n_routed_experts": 2,
              "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 8,
              "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}
    if deepseek:
        config.update(q_lora_rank=4, kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=2,
                      v_head_dim=4)
    else:
        config.update(use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5, head_dim=4)

    def layer(p: str, i: int) -> list[str]:
        attn = _mla(p) if deepseek else _mha(p, bias=True, qk_norm=True)
        return _block(p, attn, _mlp(p) if i == 0 else _nextn_moe(p))

    trunk = _trunk("model.", n, layer)
    mtp = [k for i in range(n, n + heads) for k in layer(f"model.layers.{i}.", i) + [
        f"model.layers.{i}.{x}.weight" for x in (
            "enorm", "hnorm", "eh_proj", "embed_tokens", "shared_head.norm", "shared_head.head")]]
    return config, trunk, mtp, "num_nextn_predict_layers"


def _mimo_v2_flash(n: int, heads: int, root: str):
    # The released config names no MTP count: the weights tell.
    config = {"architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash",
              "hybrid_layer_pattern": [0] + [1] * (n - 1), "moe_layer_freq": [0] + [1] * (n - 1),
              "n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8,
              "sliding_window_size": 4, "add_swa_attention_sink_bias": True}

    def layer(p: str, i: int) -> list[str]:
        sink = [p + "self_attn.attention_sink_bias"] if i else []
        mlp = [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"] + [
            k for e in range(2) for k in _proj(f"{p}mlp.experts.{e}.", "gate up down")] if i else _mlp(p)
        return _block(p, _mha(p) + sink, mlp)

    trunk = _trunk("model.", n, layer)
    mtp = []
    for i in range(heads):
        p = f"model.mtp.layers.{i}."
        mtp += _mha(p) + [p + "self_attn.attention_sink_bias"] + _mlp(p) + [
            f"{p}{x}.weight" for x in ("enorm", "hnorm", "eh_proj", "input_layernorm", "pre_mlp_layernorm",
                                        "final_layernorm")]
    return config, trunk, mtp, None


def _step3p5(n: int, heads: int, root: str):
    types = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n + max(heads, 1))]
    config = {"architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5", "num_attention_groups": 1,
              "layer_types": types, "moe_layers_enum": ",".join(map(str, range(1, n))), "moe_num_experts": 2,
              "moe_top_k": 1, "moe_intermediate_size": 8, "share_expert_dim": 8}

    def layer(p: str, i: int) -> list[str]:
        attn = _mha(p, qk_norm=True) + [p + "self_attn.g_proj.weight"]
        moe = [p + "moe.gate.weight", p + "moe.router_bias"] + _proj(p + "moe.", "gate up down") + _proj(
            p + "share_expert.", "gate up down")
        return _block(p, attn, moe if 0 < i < n else _mlp(p))

    trunk = _trunk("model.", n, layer)
    mtp = [k for i in range(n, n + heads) for k in layer(f"model.layers.{i}.", i) + [
        f"model.layers.{i}.{x}.weight" for x in (
            "enorm", "hnorm", "eh_proj", "transformer.shared_head.norm", "transformer.shared_head.output")]]
    return config, trunk, mtp, "num_nextn_predict_layers"


def _glm_moe_dsa(n: int, heads: int, root: str):
    config = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "n_routed_experts": 2,
              "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_intermediate_size": 8,
              "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 4, "kv_lora_rank": 4,
              "qk_rope_head_dim": 2, "qk_nope_head_dim": 2, "v_head_dim": 4, "index_n_heads": 2,
              "index_head_dim": 4, "index_topk": 2048, "rope_parameters": {"rope_theta": 10000.0,
                                                                         "rope_type": "default"}}

    def layer(p: str, i: int) -> list[str]:
        indexer = [f"{p}self_attn.indexer.{x}" for x in (
            "wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")]
        return _block(p, _mla(p) + indexer, _mlp(p) if i == 0 else _nextn_moe(p))

    trunk = _trunk("model.", n, layer)
    # No copies of the embedding or output head in GLM-5's MTP layer.
    mtp = [k for i in range(n, n + heads) for k in layer(f"model.layers.{i}.", i) + [
        f"model.layers.{i}.{x}.weight" for x in ("enorm", "hnorm", "eh_proj", "shared_head.norm")]]
    return config, trunk, mtp, "num_nextn_predict_layers"


def _hy_v3(n: int, heads: int, root: str):
    config = {"architectures": ["HYV3ForCausalLM"], "model_type": "hy_v3", "num_experts": 2,
              "num_experts_per_tok": 1, "num_shared_experts": 1, "moe_intermediate_size": 8,
              "expert_hidden_dim": 8, "first_k_dense_replace": 1, "qk_norm": True, "head_dim": 4,
              "route_norm": True, "router_scaling_factor": 2.826,
              "rope_parameters": {"rope_theta": 11158840.0, "rope_type": "default"}}

    def layer(p: str, i: int) -> list[str]:
        moe = [p + "mlp.router.gate.weight", p + "mlp.expert_bias"] + [
            k for e in range(2) for k in _proj(f"{p}mlp.experts.{e}.", "gate up down")] + _proj(
            p + "mlp.shared_mlp.", "gate up down")
        return _block(p, _mha(p, qk_norm=True), _mlp(p) if i == 0 else moe)

    trunk = _trunk("model.", n, layer)
    # No copies of the embedding or output head in Hy-V3's MTP layer.
    mtp = [k for i in range(n, n + heads) for k in layer(f"model.layers.{i}.", i) + [
        f"model.layers.{i}.{x}.weight" for x in ("enorm", "hnorm", "eh_proj", "final_layernorm")]]
    return config, trunk, mtp, "num_nextn_predict_layers"


def _nemotron_mixer(p: str, symbol: str) -> list[str]:
    """One Nemotron-H block (`norm`, `mixer.*`) of type M (Mamba2), * (attention) or E (MoE)."""
    m = p + "mixer."
    if symbol == "M":
        mixer = [m + x for x in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias",
                                 "norm.weight", "out_proj.weight")]
    elif symbol == "*":
        mixer = _proj(m, "q k v o")
    else:
        mixer = [m + "gate.weight", m + "gate.e_score_correction_bias"] + [
            k for e in range(2) for k in _proj(f"{m}experts.{e}.", "up down")] + _proj(m + "shared_experts.", "up down")
    return [p + "norm.weight"] + mixer


def _nemotron_h(n: int, heads: int, root: str):
    pattern = "ME*"[:n]
    config = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
              "hybrid_override_pattern": pattern, "mtp_layers_block_type": ["attention", "moe"],
              "mamba_num_heads": 2, "mamba_head_dim": 4, "n_groups": 1, "ssm_state_size": 4, "conv_kernel": 4,
              "n_routed_experts": 2, "n_shared_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": 8,
              "moe_shared_expert_intermediate_size": 8, "layer_norm_epsilon": 1e-5}
    trunk = ["backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight"]
    trunk += [k for i, s in enumerate(pattern) for k in _nemotron_mixer(f"backbone.layers.{i}.", s)]
    mtp = []
    for k in range(heads):  # a head: an attention layer with the fusion, then an MoE layer with the final norm
        first, last = f"mtp.layers.{2 * k}.", f"mtp.layers.{2 * k + 1}."
        mtp += [first + x for x in ("enorm.weight", "hnorm.weight", "eh_proj.weight")] + _nemotron_mixer(first, "*")
        mtp += _nemotron_mixer(last, "E") + [last + "final_layernorm.weight"]
    return config, trunk, mtp, "num_nextn_predict_layers"


def _deepseek_v4(n: int, heads: int, root: str):
    # DeepSeek's own names (not model.*): embed, layers.{i}.attn / ffn, hc_* hyper-connection
    # tensors, head; MTP layers under mtp.{i}. with separate e_proj / h_proj. As released:
    # window-only first layers, then compressed ones (ratio 4 with an indexer, 128 without),
    # compress_ratios listing the MTP layers too (0), hash routing in the first layers.
    ratios = ([0, 4, 128] * n)[:n] + [0] * heads
    config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "n_routed_experts": 2,
              "n_shared_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": 8, "hc_mult": 4,
              "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "q_lora_rank": 4, "head_dim": 8, "qk_rope_head_dim": 2,
              "o_groups": 2, "o_lora_rank": 4, "index_n_heads": 2, "index_head_dim": 4, "index_topk": 4,
              "sliding_window": 4, "compress_ratios": ratios, "compress_rope_theta": 160000,
              "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                               "beta_fast": 32, "beta_slow": 1},
              "num_hash_layers": 1, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
              "swiglu_limit": 10.0}

    def compressor(p: str) -> list[str]:
        return [p + x for x in ("ape", "wkv.weight", "wgate.weight", "norm.weight")]

    def layer(p: str, i: int) -> list[str]:
        attn = [f"{p}attn.{x}" for x in ("wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight",
                                          "kv_norm.weight", "wo_a.weight", "wo_b.weight", "attn_sink")]
        if ratios[i]:
            attn += compressor(p + "attn.compressor.")
        if ratios[i] == 4:
            attn += [p + "attn.indexer.wq_b.weight", p + "attn.indexer.weights_proj.weight"]
            attn += compressor(p + "attn.indexer.compressor.")
        ffn = [p + "ffn.gate.weight", p + "ffn.gate." + ("tid2eid" if i == 0 else "bias")] + [
            f"{p}ffn.experts.{e}.w{w}.weight" for e in range(2) for w in (1, 2, 3)] + [
            f"{p}ffn.shared_experts.w{w}.weight" for w in (1, 2, 3)]
        hc = [f"{p}hc_{part}_{x}" for part in ("attn", "ffn") for x in ("fn", "base", "scale")]
        return [p + "attn_norm.weight", p + "ffn_norm.weight"] + attn + ffn + hc

    trunk = ["embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"]
    trunk += [k for i in range(n) for k in layer(f"layers.{i}.", i)]
    mtp = [k for i in range(heads) for k in layer(f"mtp.{i}.", n + i) + [
        f"mtp.{i}.{x}" for x in ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight",
                                  "hc_head_fn", "hc_head_base", "hc_head_scale")]]
    return config, trunk, mtp, "num_nextn_predict_layers"


def _qwen(family: str, n: int, heads: int, root: str):
    qwen3_5 = family != "qwen3_next"
    moe = family != "qwen3_5"

    def layer(p: str, i: int) -> list[str]:
        attn = _mha(p, qk_norm=True) if (i + 1) % 4 == 0 else _gdn(p, qwen3_5)
        return _block(p, attn, _qwen_moe(p, fused=qwen3_5) if moe else _mlp(p))

    prefix = "model.language_model." if qwen3_5 else "model."
    trunk = _trunk(prefix, n, layer)
    mtp = [root + x + ".weight" for x in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")]
    mtp += [k for i in range(heads) for k in layer(f"{root}layers.{i}.", 3)]
    mtp = mtp if heads else []
    text = {"model_type": family, "full_attention_interval": 4, "linear_num_value_heads": 2,
            "linear_num_key_heads": 1, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
            "linear_conv_kernel_dim": 4, "head_dim": 4, "partial_rotary_factor": 0.25}
    if moe:
        text.update(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
                    shared_expert_intermediate_size=8, decoder_sparse_step=1)
    if not qwen3_5:
        return {"architectures": ["Qwen3NextForCausalLM"], **text}, trunk, mtp, "mtp_num_hidden_layers"
    text["model_type"] = family + "_text"
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    trunk += [f"model.visual.{k}.weight" for k in ("patch_embed.proj", "blocks.0.attn.qkv", "merger.linear_fc1")]
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    config = {"architectures": [arch], "model_type": family, "text_config": text,
              "vision_config": {"model_type": family, "depth": 1, "hidden_size": 8}}
    return config, trunk, mtp, "mtp_num_hidden_layers"


def _plain(family: str, n: int, heads: int, root: str):
    arch = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(family, "LlamaForCausalLM")
    config = {"architectures": [arch], "model_type": family}
    trunk = _trunk("model.", n, lambda p, i: _block(p, _mha(p, bias=family == "qwen2"), _mlp(p)))
    return config, trunk, [], None


def _family(family: str, n: int, heads: int, root: str):
    if family == "mimo":
        return _mimo(n, heads, root)
    if family in ("deepseek_v3", "glm4_moe"):
        return _nextn(family, n, heads, root)
    if family == "mimo_v2_flash":
        return _mimo_v2_flash(n, heads, root)
    if family == "step3p5":
        return _step3p5(n, heads, root)
    if family == "glm_moe_dsa":
        return _glm_moe_dsa(n, heads, root)
    if family == "hy_v3":
        return _hy_v3(n, heads, root)
    if family == "deepseek_v4":
        return _deepseek_v4(n, heads, root)
    if family == "nemotron_h":
        return _nemotron_h(n, heads, root)
    if family.startswith("qwen3_") and family in MTP_FAMILIES:
        return _qwen(family, n, heads, root)
    return _plain(family, n, heads, root)


# --- writing ----------------------------------------------------------------------------

def _save(path: Path, keys: list[str]) -> None:
    save_file({k: np.zeros(1, dtype=np.float32) for k in keys}, str(path), metadata={"format": "pt"})


def write_layout(family: str, folder: Path, *, mtp_heads: int = 1, config_heads=SAME,
                 sidecar: bool = False, shards: int = 1, drop: tuple[str, ...] = (),
                 mtp_root: str = "mtp.") -> Path:
    """Write a header-level checkpoint of `family` into `folder` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = N_LAYERS[family]
    config, trunk, mtp, count_field = _family(family, n, mtp_heads, mtp_root)
    text = config.get("text_config", config)
    text.update({**_BASE, "num_hidden_layers": n})
    count = mtp_heads if config_heads == SAME else config_heads
    if count_field and count is not None:
        text[count_field] = count
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    keep = lambda keys: [k for k in keys if not any(d in k for d in drop)]  # noqa: E731
    trunk, mtp = keep(trunk), keep(mtp)
    if sidecar and mtp:
        _save(folder / "mtp.safetensors", mtp)
        mtp = []
    if shards == 1:
        _save(folder / "model.safetensors", trunk + mtp)
        return folder
    names = [f"model-{s + 1:05d}-of-{shards:05d}.safetensors" for s in range(shards)]
    parts = [trunk[s::shards] for s in range(shards)]
    parts[-1] += mtp
    for name, keys in zip(names, parts):
        _save(folder / name, keys)
    weight_map = {k: name for name, keys in zip(names, parts) for k in keys}
    index = {"metadata": {"total_size": 4 * len(weight_map)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder
