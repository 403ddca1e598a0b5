"""Loading checkpoints whose trunk was quantized by mlx-lm (`mtplxd pull`/`convert`).

mlx-lm writes `"quantization": {"group_size": G, "bits": B, ...}` into config.json,
plus one entry per layer whose settings differ from those defaults, and stores
every quantized layer as `<path>.weight` (packed uint32), `<path>.scales` and
`<path>.biases`. To load such weights the model's layers must first be swapped
for their quantized twins. As mlx-lm's own loader does, a layer is swapped
exactly when the checkpoint holds `<path>.scales`; so the MTP heads, which are
built as separate modules and stored unquantized, stay in float.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import infer_quant_config


def quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's mlx-lm quantization settings, or None for a float checkpoint."""
    settings = config.get("quantization")
    return settings if isinstance(settings, dict) else None


def quantize_like_checkpoint(model: nn.Module, config: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """Swap in quantized layers wherever `weights` (already sanitized) are packed."""
    settings = quantization(config)
    if settings is None:
        return

    def predicate(path: str, module: nn.Module) -> bool | dict:
        per_layer = settings.get(path)
        if isinstance(per_layer, dict):  # a layer mlx-lm quantized with its own settings
            return per_layer
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(
        model,
        group_size=settings["group_size"],
        bits=settings["bits"],
        mode=settings.get("mode", "affine"),
        class_predicate=predicate,
    )
