"""A tiny Qwen3.5-MoE checkpoint (Qwen/Qwen3.5-35B-A3B layout): see qwen3_5.py."""

from pathlib import Path

from tests.checkpoints.qwen3_5 import write


def write_checkpoint(folder: Path, *, mtp_heads: int = 1, sidecar: bool = False, seed: int = 0) -> Path:
    return write(folder, moe=True, mtp_heads=mtp_heads, sidecar=sidecar, seed=seed)
