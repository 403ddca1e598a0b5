"""The MLX engine: tokens, caches and probabilities; no protocols.

The BLAS fix must run before anything imports mlx, so it sits here.
"""

from pathlib import Path

from engine.blas import ensure_fast_blas

BLAS = ensure_fast_blas()
EMBEDDED_MODEL = Path(__file__).parent / "assets"  # the default model, in Hugging Face layout
