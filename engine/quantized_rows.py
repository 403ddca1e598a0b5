"""Quantized weights kept quantized on the CPU: the decode kernel of engine/native.

MLX's CPU `quantized_matmul` is a plain loop whose cost grows with every row, so
the engine used to unpack a quantized trunk to float32 when it loaded on the CPU:
four to eight times the bytes to read for every token. `make install` builds
engine/native/quantized_rows.cpp into an MLX extension whose product unpacks each
group of 32 weights once, in registers, for every row of a decode step (a token,
a verify window, a batch of streams); this module loads it and routes the trunk's
quantized layers through it. Longer inputs (prefill chunks) unpack each matrix for
the duration of one product and let BLAS multiply: there the weights are read once
for hundreds of rows.

The same extension has the softmax engine/sampling.py uses on the CPU (sampling, and
attention in engine/backends/decode_ops.py) and the SwiGLU activation there (MLX's CPU
exp is several times slower), a decode step's attention, the top values top-p seeks
its cut among (MLX's CPU topk partitions the whole vocabulary), and a Llama-style block's
two halves around its attention, and its whole decode step with its KV cache
(decode_ops.NativeBlock): one operation each where MLX took ~20.

A GPU (Metal, CUDA) keeps MLX's own kernels; without the extension (no compiler at install,
another platform) the engine unpacks as before and `describe()` says so.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

NATIVE_DIR = Path(sys.prefix) / "lib" / "mtplxd"
MODULE_NAME = "_mtplxd_quantized_rows"
# Up to this many rows a product runs in the kernel; more rows unpack the matrix for
# BLAS (scripts/quantized_rows_bench.py: at 64 rows of a 576 x 1536 matrix the kernel
# took 2.8 ms, unpacking and BLAS 3.6 ms; MLX's CPU unpacking alone takes ~2 ms).
ROWS_MAX = 64
BITS = (4, 8)
CHUNK = 32  # the kernel reads groups in chunks of 32 values
HEAD_BITS = 8  # MTP heads packed beside a packed trunk (pack_heads)
# Threads a large product runs on, the caller (MLX's worker) included. Two where there are
# two cores: rows beyond the first are compute-bound in the kernel, and with a helper SmolLM2's
# depth-1 MTP went from 71 to 82 tok/s and AR batches of 4 and 8 rows from 137 / 147 to
# 173 / 192 tok/s, while one-row AR kept its speed (72.5 / 72.6): alternated in one process,
# docs/performance.md. More helpers are untested (this machine has two cores).
KERNEL_THREADS = min(2, os.cpu_count() or 1)
# What the engine calls in the module (a build from an older source lacks some).
OPERATIONS = ("quantized_rows", "dequantize", "softmax", "swiglu", "attention", "top_values", "block_in", "block_out",
              "block_step", "rows_laid_out")

log = logging.getLogger(__name__)


def native() -> ModuleType | None:
    """The built extension where the engine's arrays are the CPU's, else None: on a GPU
    (Metal, CUDA) MLX's own kernels run, and the extension's operations, which have only
    a CPU implementation, would fail there when evaluated."""
    if mx.default_device() != mx.cpu:
        return None
    return built()


@lru_cache(maxsize=1)
def built() -> ModuleType | None:
    """The built extension, or None (not built, or built against another MLX)."""
    if mx.metal.is_available():
        return None
    found = sorted(NATIVE_DIR.glob(f"{MODULE_NAME}*.so"))
    if not found:
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(found[0]))
        spec = importlib.util.spec_from_file_location(MODULE_NAME, found[0], loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as error:  # e.g. MLX was upgraded after the build
        log.warning("the quantized decode kernel %s does not load (%s): run `make install`", found[0], error)
        return None
    missing = [name for name in OPERATIONS if not hasattr(module, name)]
    if missing:  # built from an older source: the engine would call what is not there
        log.warning("the native module %s lacks %s: run `make install`", found[0], ", ".join(missing))
        return None
    module.set_threads(KERNEL_THREADS)
    return module


def describe() -> str:
    """How quantized weights run here, in one line (`mtplxd doctor`, the benches)."""
    if mx.default_device() != mx.cpu:
        return f"MLX's own kernels on {mx.default_device()}"
    module = built()
    if module is None:
        return "unpacked to float32 at load (no decode kernel built: run `make install`)"
    return f"kept packed, decode kernel {module.kernel()} on {module.threads()} thread(s) up to {ROWS_MAX} rows"


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
                     group_size: int, bits: int) -> mx.array:
    """x [..., K] @ dequantize(w, scales, biases)^T (MLX's affine layout)."""
    module = native()
    if module is None or biases is None or not takes(bits, group_size) or not (
            x.dtype == scales.dtype == biases.dtype == mx.float32):
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    if x.size // x.shape[-1] > ROWS_MAX:  # a prompt's chunk: unpacked for this one product
        return x @ module.dequantize(w, scales, biases, group_size, bits).T
    return module.quantized_rows(x, w, scales, biases, group_size, bits)


def takes(bits: int, group_size: int) -> bool:
    """Whether the kernel reads this layout."""
    return bits in BITS and group_size % CHUNK == 0


class RowsQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits)
        return y + self["bias"] if "bias" in self else y


class RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits)


def keep_packed(model: nn.Module) -> int:
    """Route every quantized layer of `model` the kernel takes (affine, 4 or 8 bits,
    groups of 32) through it; returns how many (none where it is not built). The
    twins add behaviour only (same parameters, same names), so each layer changes
    class in place rather than being rebuilt: no weight is copied."""
    if native() is None:
        return 0
    twins: dict[type, type] = {nn.QuantizedLinear: RowsQuantizedLinear, nn.QuantizedEmbedding: RowsQuantizedEmbedding}
    count = 0
    for _, module in model.named_modules():
        twin = twins.get(type(module))
        if twin is not None and module.mode == "affine" and takes(module.bits, module.group_size):
            module.__class__ = twin
            count += 1
    return count


def pack_heads(heads: list[nn.Module]) -> int:
    """Pack the MTP heads' linear layers at HEAD_BITS for the kernel, beside a trunk kept
    packed; returns how many. Stored in bfloat16 and cast to float32 on the CPU, SmolLM2's
    two heads read 17 MB a draft; at 8 bits a quarter. The drafts barely move (the same
    acceptance at T=0 on the bench's prompts) and exactness never depends on them: q is
    whatever the head computes. Depth-1 MTP went from 82.7 to 85.8 tok/s at T=0 and 78.0
    to 84.2 at T=0.6 (docs/performance.md)."""
    if native() is None:
        return 0

    def packable(_: str, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) and module.weight.shape[-1] % CHUNK == 0

    count = 0
    for head in heads:
        nn.quantize(head, group_size=CHUNK, bits=HEAD_BITS, class_predicate=packable)
        count += keep_packed(head)
    return count


def is_kept(module: nn.Module) -> bool:
    return isinstance(module, (RowsQuantizedLinear, RowsQuantizedEmbedding))
