"""Training MTP models with MLX; the code lives in engine/training/.

    from engine.train import ModelSettings, train_model
    train_model(ModelSettings(out="model-dir"))             # trunk + heads from scratch

    from engine.train import HeadsSettings, train_heads
    train_heads(HeadsSettings(model="qwen2-dir", out="with-heads"))   # heads only
    train_heads(HeadsSettings(model="qwen3-next-dir", out="better", replace_heads=True))  # its own, further

    resume_training("model-dir")                            # either kind, from its last save

    measure_acceptance(Engine.load(path), prompts, depth=2, n_tokens=64)

Modules: corpus (source files, held-out list), tokenizer (byte-level BPE),
data (FIM, packing, resumable batches), model (mlx-lm's MiMo trunk + the
engine's MTPLayer, losses, saving), trainer (AdamW loop, checkpoints,
progress, Ctrl-C), full, heads, measure.
"""

from engine.training.corpus import HELD_OUT_MODULES, default_corpus_dir, held_out_files, load_corpus
from engine.training.data import Batches, build_stream, fim_ids, fim_split, token_starts
from engine.training.full import ModelSettings, train_model
from engine.training.heads import HeadsSettings, train_heads
from engine.training.measure import measure_acceptance
from engine.training.model import MTPModel, model_config, parameter_count
from engine.training.tokenizer import SPECIAL_TOKENS, save_tokenizer, train_tokenizer
from engine.training.trainer import STATE_DIR, TrainResult, read_state

__all__ = [
    "HELD_OUT_MODULES", "RESUMABLE", "SPECIAL_TOKENS", "STATE_DIR", "Batches", "HeadsSettings", "MTPModel",
    "ModelSettings", "TrainResult", "build_stream", "default_corpus_dir", "fim_ids",
    "fim_split", "held_out_files", "load_corpus", "measure_acceptance", "model_config", "parameter_count",
    "resume_training", "save_tokenizer", "token_starts", "train_heads", "train_model", "train_tokenizer",
]

# What a resumed run may change; everything else comes from the saved state.
RESUMABLE = ("steps", "save_every", "compile", "progress", "eval_windows", "threads", "max_minutes")


def resume_training(out, callback=None, **changes) -> TrainResult:
    """Continue the run saved in `out` (full or heads-only) from its last
    checkpoint: same data order, optimizer state and schedule. `changes` may
    set any of RESUMABLE (None values are ignored), e.g. more `steps`."""
    saved = read_state(out)
    if saved is None:
        raise FileNotFoundError(f"nothing to resume in {out} (no {STATE_DIR}/state.json)")
    bad = sorted(set(changes) - set(RESUMABLE))
    if bad:
        raise ValueError(f"cannot change {', '.join(bad)} when resuming")
    values = {**saved["settings"], **{k: v for k, v in changes.items() if v is not None}, "out": str(out)}
    if saved.get("mode") == "heads":
        return train_heads(HeadsSettings(**values), resume=True, callback=callback)
    return train_model(ModelSettings(**values), resume=True, callback=callback)
