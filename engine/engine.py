"""The public engine surface: load a checkpoint, open generations.

    engine = Engine.load(path)
    gen = engine.open(GenerationRequest(prompt=ids, mode="mtp", depth=2))
    while not gen.finished:
        result = gen.step()
    gen.close()
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from engine.backends.base import Backend, lazy_loading
from engine.distributed import shard
from engine.backends.descriptors import BackendDescriptor, inspect_checkpoint
from engine.checkpoint import CheckpointError, load_weights, read_config, text_config
from engine.generation import Generation, GenerationRequest
from engine.quantized import quantization
from engine.quantized_rows import is_kept, keep_packed, pack_heads
from engine.sessions.state import Restore


@dataclass
class Engine:
    path: Path
    backend: Backend
    descriptor: BackendDescriptor | None
    tokenizer: Any  # an mlx-lm TokenizerWrapper
    context_length: int

    sharding: str = "not sharded (one rank)"  # several ranks: how the model is split (engine/distributed.py)

    @classmethod
    def load(cls, path: str | Path, dtype: mx.Dtype | None = None, group: Any = None,
             trainable_heads: bool = False) -> Engine:
        """`group`: an mx.distributed group of several ranks to split the model over;
        its weights then stay lazy until each rank has taken its slice. `trainable_heads`:
        keep the MTP heads as stored (training reads and updates them); otherwise, beside
        a trunk kept packed for the CPU kernel, they are packed too."""
        folder = Path(path).expanduser().resolve()
        report = inspect_checkpoint(folder)
        if report.status == "unsupported":
            raise CheckpointError(f"{folder}: unsupported checkpoint: {report.reason}")
        weights = load_weights(folder)
        target = dtype or default_dtype()
        if target is not None:
            weights = {k: _cast(v, target) for k, v in weights.items()}
        module_name = report.descriptor.backend_module if report.descriptor else "engine.backends.plain"
        module = importlib.import_module(module_name)
        config = read_config(folder)
        several = group is not None and group.size() > 1
        with lazy_loading() if several else contextlib.nullcontext():
            backend = module.load(folder, config, weights)
        sharding = shard(backend, group) if several else cls.sharding
        if target is not None and quantization(config) is not None:
            if keep_packed(backend.trunk) and backend.packable_heads and not trainable_heads:
                pack_heads(backend.heads)
            _dequantize(backend.trunk)
        context = int(text_config(config).get("max_position_embeddings") or 4096)
        return cls(folder, backend, report.descriptor, load_tokenizer(folder), context, sharding)

    def open(self, request: GenerationRequest, restore: Restore | None = None, record: bool = False) -> Generation:
        """`restore`: start from a session-bank snapshot; `record`: keep what `snapshot()` needs."""
        return Generation(self.backend, request, restore=restore, record=record)

    def embed(self, token_ids: tuple[int, ...]) -> list[float]:
        """Mean-pooled, L2-normalised final hidden states of the trunk."""
        tokens = mx.array([token_ids])
        _, hidden = self.backend.forward(tokens, self.backend.make_cache())
        if hidden is None:  # AR-only backends return logits alone
            hidden = self.backend.trunk.model(tokens)
        pooled = hidden[0].astype(mx.float32).mean(axis=0)
        return cast("list[float]", (pooled / mx.maximum(mx.linalg.norm(pooled), 1e-12)).tolist())


def default_dtype() -> mx.Dtype | None:
    """float32 on CPU, where half-precision matmuls skip BLAS (quantized trunks keep
    their packed weights for engine/quantized_rows.py's kernel, or are unpacked where it
    is not built); as stored on a GPU (Metal, CUDA)."""
    return None if mx.default_device() != mx.cpu else mx.float32


def _dequantize(trunk: Any) -> None:
    """Unpack the quantized layers the decode kernel does not keep (all of them where
    it is not built; other bit widths; MoE experts) into plain layers, in the scales'
    dtype (already the target): off Metal, MLX's own quantized matmul costs K+1
    single-token products for a K+1-row verify forward, and speculation stops paying."""
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import dequantize_model

    unpacked = []
    for name, module in trunk.named_modules():
        if name and hasattr(module, "scales") and not is_kept(module):
            holder = nn.Module()  # mlx-lm unpacks a model's children: give the layer a parent
            holder.layer = module
            unpacked.append((name, dequantize_model(holder).layer))
    if unpacked:
        trunk.update_modules(tree_unflatten(unpacked))
    mx.eval(trunk.parameters())


def _cast(array: mx.array, dtype: mx.Dtype) -> mx.array:
    floating = array.dtype in (mx.float16, mx.bfloat16, mx.float32)
    return array.astype(dtype) if floating and array.dtype != dtype else array


def load_tokenizer(folder: Path) -> Any:
    """The checkpoint's own tokenizer (an mlx-lm TokenizerWrapper: streaming
    detokenizer, EOS ids, chat template), never running remote code or prompting."""
    from mlx_lm.tokenizer_utils import load
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return load(folder, {"trust_remote_code": False})
