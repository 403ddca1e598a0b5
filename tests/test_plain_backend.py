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
from tests.floats import PATHS_ULPS, assert_close, excess
from tests.gguf_fixtures import TinyModel, tiny_model


TAGGED_SCALING = {"type": "linear", "factor": 1.0,  # a scale of 1: the rope is unchanged
                  "upper": {"__float__": "Infinity"}, "lower": {"__float__": "-Infinity"}, "unset": {"__float__": "NaN"}}


def backend(config: dict):
    model = tiny_model("llama")
    weights = {name: mx.array(w) for name, w in model.weights.items()}
    return plain.load(Path("unused"), {**model.config, **config}, weights)


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
    loaded = plain.load(Path("unused"), model.config, {name: mx.array(w) for name, w in model.weights.items()})
    assert isinstance(loaded, MiMoBackend) and loaded.n_heads == 0 and loaded.family == arch
    tokens = mx.array([[1, 5, 9, 3, 7, 2, 11, 4]])
    want = reference_logits(model, tokens)
    cache = loaded.make_cache()
    prompt, _ = loaded.forward(tokens[:, :6], cache)  # a prompt, then a token at a time through the cache
    steps = [loaded.forward(tokens[:, i : i + 1], cache)[0] for i in (6, 7)]
    got = mx.concatenate([prompt, *steps], axis=1)
    assert_close(got, want, ulps=PATHS_ULPS, what=f"{arch} on MiMo's path")
    # Negative control: the rotary at another base (its frequencies a quarter) is outside the bound.
    other_base = 4 * importlib.import_module(f"mlx_lm.models.{arch}").ModelArgs.from_dict(model.config).rope_theta
    assert excess(got, reference_logits(model, tokens, rope_theta=other_base), PATHS_ULPS,
                  what=f"{arch} against another rotary base") > 1


def test_qwen3s_head_norms_are_applied():
    """Negative control for Qwen3's per-head q/k norms: the same weights without them are outside the bound."""
    model = tiny_model("qwen3")
    loaded = plain.load(Path("unused"), model.config, {name: mx.array(w) for name, w in model.weights.items()})
    tokens = mx.array([[1, 5, 9, 3, 7, 2]])
    want, _ = loaded.forward(tokens, loaded.make_cache())
    for block in loaded.trunk.model.layers:
        del block.self_attn.q_norm, block.self_attn.k_norm
    got, _ = MiMoBackend(loaded.trunk, []).forward(tokens, loaded.make_cache())
    assert excess(got, want, PATHS_ULPS, what="qwen3 without its head norms") > 1


@pytest.mark.skipif(quantized_rows.native() is None, reason="no decode kernel built (macOS: Metal's own kernels)")
def test_a_packed_qwen3_steps_through_the_block_operations_with_mlx_lms_logits():
    """The native block operations with Qwen3's head norms, in the engine's steps."""
    model = tiny_model("qwen3")
    loaded = plain.load(Path("unused"), model.config, {name: mx.array(w) for name, w in model.weights.items()})
    blocks = loaded.trunk.model.layers
    nn.quantize(loaded.trunk.model, group_size=32, bits=4, class_predicate=lambda path, m: path.startswith("layers")
                and isinstance(m, nn.Linear))
    assert quantized_rows.keep_packed(loaded.trunk) == 7 * len(blocks)
    assert all(NativeBlock.of(block) is not None for block in blocks)
    tokens = mx.array([[1, 5, 9, 3, 7, 2, 11, 4]])
    want = loaded.trunk(tokens)
    cache = loaded.make_cache()
    prompt, _ = loaded.forward(tokens[:, :6], cache)
    steps = [loaded.forward(tokens[:, i : i + 1], cache)[0] for i in (6, 7)]
    assert_close(mx.concatenate([prompt, *steps], axis=1), want, ulps=PATHS_ULPS, what="packed qwen3, block operations")


@pytest.mark.parametrize("arch, change", [("gemma3", {}), ("llama", {"layer_types": ["sliding_attention",
                                                                                    "full_attention"],
                                                                     "sliding_window": 4})])
def test_other_trunks_stay_on_mlx_lms_model(arch, change):
    model = tiny_model(arch)
    config = {**model.config, **change}
    loaded = plain.load(Path("unused"), config, {name: mx.array(w) for name, w in model.weights.items()})
    assert isinstance(loaded, plain.PlainBackend) and loaded.family == model.config["model_type"]
