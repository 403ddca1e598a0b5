"""Tiny checkpoint writers, one module per family, each exposing

    write_checkpoint(folder: Path, *, mtp_heads: int = 1, sidecar: bool = False,
                     seed: int = 0) -> Path

FAMILIES maps a family name to its module name.
"""

import importlib
from pathlib import Path

FAMILIES = {
    "mimo": "mimo",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "glm4_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "mimo_v2_flash": "mimo_v2_flash",
    "step3p5": "step3p5",
    "glm_moe_dsa": "glm_moe_dsa",
    "nemotron_h": "nemotron_h",
    "hy_v3": "hy_v3",
    "deepseek_v4": "deepseek_v4",
}


def write(family: str, folder: Path, **options) -> Path:
    module = importlib.import_module(f"tests.checkpoints.{FAMILIES[family]}")
    folder.mkdir(parents=True, exist_ok=True)
    return module.write_checkpoint(folder, **options)
