"""The plain backend (any mlx-lm architecture without MTP heads) reads its config as the
MTP families do: transformers 5 and mlx-lm save non-finite floats tagged,
{"__float__": "Infinity"}, since JSON has none; the model gets the floats. A Llama or
Qwen2 or Qwen3 trunk decodes on MiMo's backend's path (no heads) with mlx-lm's logits."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine import quantized_rows
from engine.backends import plain
from engine.backends.decode_ops import NativeBlock
from engine.backends.mimo import MiMoBackend
from tests.engine_helpers import assert_last_logits_match
from tests.floats import PATHS_ULPS, assert_close, excess
from tests.gguf_fixtures import TinyModel, tiny_model


TAGGED_SCALING = {"type": "linear", "factor": 1.0,  # a scale of 1: the rope is unchanged
                  "upper": {"__float__": "Infinity"}, "lower": {"__float__": "-Infinity"}, "unset": {"__float__": "NaN"}}


def loaded(model: TinyModel, **change):
    """The plain backend's load of the tiny model, its config changed by `change`."""
    return plain.load(Path("unused"), {**model.config, **change}, {name: mx.array(w) for name, w in model.weights.items()})


def backend(config: dict):
    return loaded(tiny_model("llama"), **config)


def stepped_logits(backend_, tokens: mx.array) -> mx.array:
    """Logits of all positions as the engine computes them: a prompt, then a token at a time
    through the cache."""
    cache, n = backend_.make_cache(), tokens.shape[1]
    prompt, _ = backend_.forward(tokens[:, : n - 2], cache)
    steps = [backend_.forward(tokens[:, i : i + 1], cache)[0] for i in (n - 2, n - 1)]
    return mx.concatenate([prompt, *steps], axis=1)


def test_tagged_non_finite_floats_are_restored():
    config = {"rope_scaling": TAGGED_SCALING}
    scaling = backend(config).trunk.args.rope_scaling
    assert scaling["upper"] == math.inf and scaling["lower"] == -math.inf and math.isnan(scaling["unset"])
    assert config["rope_scaling"]["upper"] == {"__float__": "Infinity"}  # the caller's config is left as read


def test_a_tagged_config_gives_the_same_model():
    untagged = {"rope_scaling": {"type": "linear", "factor": 1.0, "upper": math.inf, "lower": -math.inf,
                                 "unset": math.nan}}
    tokens = mx.array([[1, 5, 9, 3]])
    tagged, plain_ = backend({"rope_scaling": TAGGED_SCALING}), backend(untagged)
    tagged_logits, _ = tagged.forward(tokens, tagged.make_cache())
    plain_logits, _ = plain_.forward(tokens, plain_.make_cache())
    assert mx.array_equal(tagged_logits, plain_logits).item()


def reference_logits(model: TinyModel, tokens: mx.array, **change) -> mx.array:
    """mlx-lm's own model of the architecture (with `change` to its config), all positions."""
    module = importlib.import_module(f"mlx_lm.models.{model.config['model_type']}")
    reference = module.Model(module.ModelArgs.from_dict({**model.config, **change}))
    reference.load_weights([(name, mx.array(w)) for name, w in model.weights.items()], strict=True)
    return reference(tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_llama_style_trunk_decodes_on_mimos_path_with_the_same_logits(arch):
    model = tiny_model(arch)
    on_mimo = loaded(model)
    assert isinstance(on_mimo, MiMoBackend) and on_mimo.n_heads == 0 and on_mimo.family == arch
    tokens = mx.array([[1, 5, 9, 3, 7, 2, 11, 4]])
    want = reference_logits(model, tokens)
    got = stepped_logits(on_mimo, tokens)
    assert_close(got, want, ulps=PATHS_ULPS, what=f"{arch} on MiMo's path")
    # Negative control: the rotary at another base (its frequencies a quarter) is outside the bound.
    other_base = 4 * importlib.import_module(f"mlx_lm.models.{arch}").ModelArgs.from_dict(model.config).rope_theta
    assert excess(got, reference_logits(model, tokens, rope_theta=other_base), PATHS_ULPS,
                  what=f"{arch} against another rotary base") > 1


def test_qwen3s_head_norms_are_applied():
    """Negative control for Qwen3's per-head q/k norms: the same weights without them are outside the bound."""
    on_mimo = loaded(tiny_model("qwen3"))
    tokens = mx.array([[1, 5, 9, 3, 7, 2]])
    want, _ = on_mimo.forward(tokens, on_mimo.make_cache())
    for block in on_mimo.trunk.model.layers:
        del block.self_attn.q_norm, block.self_attn.k_norm
    got, _ = MiMoBackend(on_mimo.trunk, []).forward(tokens, on_mimo.make_cache())
    assert excess(got, want, PATHS_ULPS, what="qwen3 without its head norms") > 1


@pytest.mark.skipif(quantized_rows.native() is None, reason="no decode kernel built (macOS: Metal's own kernels)")
def test_a_packed_qwen3_steps_through_the_block_operations_with_mlx_lms_logits():
    """The native block operations with Qwen3's head norms, in the engine's steps."""
    on_mimo = loaded(tiny_model("qwen3"))
    blocks = on_mimo.trunk.model.layers
    nn.quantize(on_mimo.trunk.model, group_size=32, bits=4, class_predicate=lambda path, m: path.startswith("layers")
                and isinstance(m, nn.Linear))
    assert quantized_rows.keep_packed(on_mimo.trunk) == 7 * len(blocks)
    assert all(NativeBlock.of(block) is not None for block in blocks)
    tokens = mx.array([[1, 5, 9, 3, 7, 2, 11, 4]])
    assert_close(stepped_logits(on_mimo, tokens), on_mimo.trunk(tokens), ulps=PATHS_ULPS,
                 what="packed qwen3, block operations")


@pytest.mark.parametrize("arch, change", [("gemma3", {}), ("llama", {"layer_types": ["sliding_attention",
                                                                                    "full_attention"],
                                                                     "sliding_window": 4})])
def test_other_trunks_stay_on_mlx_lms_model(arch, change):
    model = tiny_model(arch)
    on_mlx_lm = loaded(model, **change)
    assert isinstance(on_mlx_lm, plain.PlainBackend) and on_mlx_lm.family == model.config["model_type"]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_a_prompts_last_chunk_scores_its_last_position_only(arch):
    """On MiMo's path (llama, qwen3) and on mlx-lm's own model (gemma3)."""
    assert_last_logits_match(loaded(tiny_model(arch)), mx.array([[1, 5, 9, 3, 7, 2, 11, 4]]), PATHS_ULPS)
