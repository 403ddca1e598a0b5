"""Qwen3.5 / 3.6 MoE: served by engine/backends/qwen3_5.py, which picks the MoE
model class from `num_experts` in the text config. This module exists so the
loader can import `engine.backends.qwen3_5_moe.load` by family name."""

from engine.backends.qwen3_5 import load

__all__ = ["load"]
