"""A tiny MiMo checkpoint: Qwen2-like trunk + `model.mtp_layers.{i}` heads."""

from pathlib import Path

from tests.checkpoints.common import (
    CHARS,
    RandomWeights,
    save_tensors,
    tokenizer_vocab_size,
    write_config,
    write_tokenizer,
)

D, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64


def decoder_block(w: RandomWeights, prefix: str) -> dict:
    head_dim = D // HEADS
    return {
        f"{prefix}self_attn.q_proj.weight": w.matrix(HEADS * head_dim, D),
        f"{prefix}self_attn.q_proj.bias": w.vector(HEADS * head_dim),
        f"{prefix}self_attn.k_proj.weight": w.matrix(KV_HEADS * head_dim, D),
        f"{prefix}self_attn.k_proj.bias": w.vector(KV_HEADS * head_dim),
        f"{prefix}self_attn.v_proj.weight": w.matrix(KV_HEADS * head_dim, D),
        f"{prefix}self_attn.v_proj.bias": w.vector(KV_HEADS * head_dim),
        f"{prefix}self_attn.o_proj.weight": w.matrix(D, HEADS * head_dim),
        f"{prefix}mlp.gate_proj.weight": w.matrix(FFN, D),
        f"{prefix}mlp.up_proj.weight": w.matrix(FFN, D),
        f"{prefix}mlp.down_proj.weight": w.matrix(D, FFN),
        f"{prefix}input_layernorm.weight": w.norm(D),
        f"{prefix}post_attention_layernorm.weight": w.norm(D),
    }


def mtp_layer(w: RandomWeights, i: int) -> dict:
    prefix = f"model.mtp_layers.{i}."
    return {
        **decoder_block(w, prefix),
        f"{prefix}token_layernorm.weight": w.norm(D),
        f"{prefix}hidden_layernorm.weight": w.norm(D),
        f"{prefix}input_proj.weight": w.matrix(D, 2 * D),
        f"{prefix}final_layernorm.weight": w.norm(D),
    }


def write_checkpoint(
    folder: Path, *, mtp_heads: int = 1, sidecar: bool = False, seed: int = 0, n_chars: int | None = None
) -> Path:
    n_chars = n_chars or len(CHARS)
    vocab = tokenizer_vocab_size(n_chars)
    w = RandomWeights(seed)
    trunk = {
        "model.embed_tokens.weight": w.like((vocab, D), 1.0),
        "model.norm.weight": w.norm(D),
        "lm_head.weight": w.matrix(vocab, D) * 4.0,
    }
    for layer in range(LAYERS):
        trunk.update(decoder_block(w, f"model.layers.{layer}."))
    heads = {}
    for i in range(mtp_heads):
        heads.update(mtp_layer(w, i))
    if sidecar:
        save_tensors(folder / "model.safetensors", trunk)
        save_tensors(folder / "mtp.safetensors", heads)
    else:
        save_tensors(folder / "model.safetensors", {**trunk, **heads})
    write_config(folder, config(vocab, mtp_heads))
    write_tokenizer(folder, n_chars)
    return folder


def config(vocab: int, mtp_heads: int) -> dict:
    return {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "mimo",
        "hidden_size": D,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": mtp_heads,
        "torch_dtype": "float32",
    }
