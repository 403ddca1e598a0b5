"""Converting a Hugging Face checkpoint with MTP heads into a (quantized) MLX folder
that keeps its heads: what `mtplxd pull` and `mtplxd convert` run.

Community MLX conversions drop the MTP head (mlx-lm's `sanitize` throws it away),
so a stock conversion cannot speculate. This one:

1. loads the checkpoint through the family's own backend, lazily (parameters stay
   memory-mapped, so a model larger than memory streams through);
2. quantizes the trunk with mlx-lm's `quantize_model` (the family's own rules,
   e.g. 8-bit MoE gates) and leaves the head modules in their float dtype: a
   quantized head drafts worse and costs acceptance;
3. writes an ordinary Hugging Face-layout folder: the trunk with mlx-lm's
   `save_model` / `save_config` (so stock mlx-lm loads it, AR only), the heads in
   a sidecar `mtp.safetensors` (engine/head_export.py), the tokenizer files, and
   a record in config.json (CONVERSION_KEY) saying that Qwen's zero-centred norms
   already carry their +1, so the loader never applies it twice.

The output appears atomically (a hidden partial folder renamed at the end), and
the free disk space is checked against an estimate before anything is written.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from engine.backends.base import lazy_loading
from engine.backends.descriptors import InspectReport, head_key_predicate, inspect_checkpoint
from engine.checkpoint import (
    CONVERSION_KEY,
    CheckpointError,
    load_weights,
    read_config,
    read_header,
    text_config,
    weight_files,
)
from engine.head_export import HEADS_FILE, head_tensors
from engine.quantized import quantization

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)  # what MLX's affine quantization accepts
# Files of a checkpoint folder that are not copied: weights in any format (the
# converter writes its own), remote code (never run), the config (rewritten).
_NOT_COPIED_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack",
                        ".onnx", ".py"}
_NOT_COPIED_NAMES = {"config.json", "model.safetensors.index.json"}
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class ConversionError(CheckpointError):
    """A conversion that cannot go ahead; str(e) is one line."""


@dataclass(frozen=True)
class QuantSpec:
    bits: int | None = 4  # None: keep the trunk in float
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits is not None and self.bits not in BITS:
            raise ConversionError(f"bits must be one of {', '.join(map(str, BITS))} or none, got {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ConversionError(f"group size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                                  f"got {self.group_size}")

    def describe(self) -> str:
        return f"{self.bits}-bit (group {self.group_size})" if self.bits else "not quantized"


@dataclass(frozen=True)
class ConversionResult:
    out: Path
    family: str
    mtp_heads: int
    size_bytes: int
    bits_per_weight: float  # of the trunk, as mlx-lm counts it
    quantization: dict[str, int] | None


def convert_checkpoint(src: str | Path, out: str | Path, spec: QuantSpec,
                       source: str | None = None, revision: str | None = None) -> ConversionResult:
    """Convert the checkpoint folder `src` into the new folder `out`.
    `source` / `revision` name where it came from (a repository id), for the record."""
    src = Path(src).expanduser().resolve()
    out = Path(out).expanduser().absolute()
    if out.exists():
        raise ConversionError(f"{out}: already exists; remove it or choose another output folder")
    config, report = check_source(src)
    check_room(out.parent, estimate_output_bytes(src, config, report, spec), "the converted model")
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        bpw = _write(src, partial, config, report, spec, {"source": source or str(src), "revision": revision})
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone already after a successful rename
    bits = {"bits": spec.bits, "group_size": spec.group_size} if spec.bits else None
    return ConversionResult(out, report.family, report.mtp_heads, folder_bytes(out), bpw, bits)


def check_source(src: Path) -> tuple[dict[str, Any], InspectReport]:
    """The source's config and report, if it is a float checkpoint with MTP heads."""
    config = read_config(src)
    report = inspect_checkpoint(src)
    refuse_without_heads(str(src), report, str(src))
    settings = quantization(config)
    if settings is not None:
        raise ConversionError(f"{src}: already quantized ({settings.get('bits')}-bit); "
                              "convert from the original checkpoint")
    return config, report


def refuse_without_heads(what: str, report: InspectReport, model_hint: str = "PATH") -> None:
    """Only checkpoints with MTP heads are worth converting: a stock conversion exists."""
    if report.status == "ar-only":
        raise ConversionError(
            f"{what}: no MTP head to keep ({report.reason}); a converted model could not speculate. "
            f"Train heads first: mtplxd train --heads-only --model {model_hint} --out DIR")
    if report.status != "supported":
        raise ConversionError(f"{what}: unsupported checkpoint: {report.reason}")


# -- disk room ---------------------------------------------------------------------


def free_bytes(path: Path) -> int:
    """Free space on the file system that holds `path` (or would, once created)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_room(where: Path, needed: int, what: str) -> None:
    free = free_bytes(where)
    if free < needed:
        raise ConversionError(f"not enough disk space in {where}: {what} needs about {gigabytes(needed)}, "
                              f"{gigabytes(free)} free")


def gigabytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


def estimate_output_bytes(src: Path, config: dict[str, Any], report: InspectReport, spec: QuantSpec) -> int:
    """An upper-leaning estimate of the converted folder's size, from headers alone."""
    n_layers = int(text_config(config).get("num_hidden_layers") or 0)
    is_head = head_key_predicate(report.supported_descriptor, n_layers)
    total = sum(f.stat().st_size for f in copied_files(src))
    for path in weight_files(src):
        for key, info in read_header(path).items():
            total += tensor_bytes(key, info, None if is_head(key) else spec)
    return total


def coarse_output_bytes(source_weight_bytes: int, spec: QuantSpec) -> int:
    """Before any header is known (a pull that has not downloaded yet): assume 16-bit
    source weights, all quantizable; the heads and norms are a small share."""
    if not spec.bits:
        return source_weight_bytes
    return int(source_weight_bytes * (spec.bits + 32 / spec.group_size) / 16)


def tensor_bytes(key: str, info: dict[str, Any], spec: QuantSpec | None) -> int:
    """Stored size of one source tensor after conversion (`spec` None: kept as is)."""
    shape = [int(n) for n in info["shape"]]
    elements = math.prod(shape)
    # fp8 sources (DeepSeek-V3) are dequantized to bfloat16 by the loader.
    item = max(_DTYPE_BYTES.get(info["dtype"], 4), 2 if info["dtype"].startswith("F8") else 1)
    bits = spec.bits if spec is not None and key.endswith("weight") and len(shape) >= 2 else None
    if not bits or spec is None or shape[-1] % spec.group_size:  # not quantized
        return elements * item
    groups = elements // spec.group_size
    return elements * bits // 8 + 2 * groups * item  # packed weights + scales + biases


def copied_files(src: Path) -> list[Path]:
    """Tokenizer, generation config, model card...: every top-level file but weights,
    code and the config."""
    return sorted(
        f for f in src.iterdir()
        if f.is_file() and not f.name.startswith(".") and f.name not in _NOT_COPIED_NAMES
        and f.suffix not in _NOT_COPIED_SUFFIXES
    )


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


# -- writing -----------------------------------------------------------------------


def _write(src: Path, dst: Path, config: dict[str, Any], report: InspectReport, spec: QuantSpec,
           origin: dict[str, Any]) -> float:
    from mlx_lm.utils import compute_bits_per_weight, save_config, save_model

    backend = _load_lazily(src, config, report)
    out_config = copy.deepcopy(config)
    # The source's own quantization_config (fp8 blocks...) no longer describes what is stored.
    out_config.pop("quantization_config", None)
    if spec.bits:
        out_config["quantization"] = _quantize_trunk(backend.trunk, spec)
    n_layers = int(text_config(config).get("num_hidden_layers") or 0)
    # A backend whose heads span several checkpoint layers (Nemotron-H) names them itself.
    own_names = getattr(backend, "head_tensors", None)
    heads = own_names() if own_names else head_tensors(report.supported_descriptor, backend.heads, n_layers)
    out_config[CONVERSION_KEY] = {
        **origin,
        "mtp_heads": len(backend.heads),
        "heads_file": HEADS_FILE,
        "heads_dtype": str(next(iter(heads.values())).dtype).removeprefix("mlx.core."),
        # Qwen: trunk and head norms are stored with their +1 (mlx-lm's layout); see
        # engine/backends/qwen3_next.py head_needs_shift.
        "norm_shift_applied": report.supported_descriptor.norm_shift,
    }
    dst.mkdir(parents=True)
    save_model(dst, backend.trunk)
    mx.save_safetensors(str(dst / HEADS_FILE), heads, metadata={"format": "mlx"})
    save_config(out_config, dst / "config.json")
    for f in copied_files(src):
        shutil.copyfile(f, dst / f.name)  # follows the Hugging Face cache's symlinks
    return float(compute_bits_per_weight(backend.trunk))


def _load_lazily(src: Path, config: dict[str, Any], report: InspectReport):
    module = importlib.import_module(report.supported_descriptor.backend_module)
    try:
        with lazy_loading():
            return module.load(src, copy.deepcopy(config), load_weights(src))
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # a layout the backend cannot build
        raise ConversionError(f"{src}: could not load the checkpoint: {' '.join(str(e).split())}")


def _quantize_trunk(trunk: nn.Module, spec: QuantSpec) -> dict[str, Any]:
    """Quantize the trunk in place with mlx-lm; returns the config's `quantization`."""
    from mlx_lm.utils import quantize_model

    with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm prints its own [INFO] line
        _, quantized = quantize_model(trunk, {}, spec.group_size, spec.bits,
                                      quant_predicate=_family_rule(trunk))
    return quantized["quantization"]


def _family_rule(trunk: nn.Module) -> Callable[[str, nn.Module], bool | dict]:
    """mlx-lm's per-family choice (e.g. MoE gates in 8-bit with group 64), except where
    its group size does not divide a (tiny) layer: that layer stays float."""
    rule = getattr(trunk, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        choice = rule(path, module) if rule is not None else True
        if isinstance(choice, dict) and module.weight.shape[-1] % choice.get("group_size", 1):
            return False
        return choice

    return predicate
