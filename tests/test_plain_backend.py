"""The plain backend (any mlx-lm architecture without MTP heads) reads its config as the
MTP families do: transformers 5 and mlx-lm save non-finite floats tagged,
{"__float__": "Infinity"}, since JSON has none; the model gets the floats."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx

from engine.backends import plain
from tests.gguf_fixtures import tiny_model

TAGGED_SCALING = {"type": "linear", "factor": 1.0,  # a scale of 1: the rope is unchanged
                  "upper": {"__float__": "Infinity"}, "lower": {"__float__": "-Infinity"}, "unset": {"__float__": "NaN"}}


def backend(config: dict) -> plain.PlainBackend:
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
    tagged_logits, _ = backend({"rope_scaling": TAGGED_SCALING}).forward(tokens, None)
    plain_logits, _ = backend(untagged).forward(tokens, None)
    assert mx.array_equal(tagged_logits, plain_logits).item()
