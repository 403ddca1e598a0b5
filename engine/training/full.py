"""Training a small MiMo-layout model (trunk + MTP heads) from scratch."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.training import trainer
from engine.training.corpus import held_out_files, load_corpus, manifest
from engine.training.data import Batches, build_stream
from engine.training.model import (
    ModelShape, MTPModel, cross_entropy, head_agreement, model_config, parameter_count, save_safetensors, trunk_loss,
    write_json,
)
from engine.training.tokenizer import EOS, load_tokenizer, save_tokenizer, train_tokenizer


@dataclass
class ModelSettings:
    """Everything that defines a from-scratch run (defaults: the shipped model)."""

    out: str
    corpus: str | None = None  # default: the interpreter's standard library
    max_corpus_bytes: int | None = None
    vocab: int = 4096
    hidden: int = 192
    layers: int = 8
    heads: int = 2
    intermediate: int | None = None  # default 2.5 * hidden (480)
    seq_len: int = 256
    batch: int = 8
    steps: int = 1500
    lr: float = 3e-3
    warmup: int | None = None
    head_weight: float = 0.5  # loss weight of each MTP head (the trunk's is 1)
    fim_rate: float = 0.5
    # "spm" or "psm" (engine/training/data.py), kept in tokenizer_config.json. SPM: this small
    # model's editor completions parse 56-59% of the time, against 7-31% trained PSM.
    fim_order: str = "spm"
    seed: int = 0
    save_every: int = 100
    max_positions: int = 4096
    eval_windows: int = 16
    compile: bool = True
    progress: bool = True
    threads: int | None = 1  # BLAS threads (see trainer.LoopSettings)
    max_minutes: float | None = None  # a time budget: stop and save when spent


def train_model(settings: ModelSettings, resume: bool = False, callback=None) -> trainer.TrainResult:
    out = Path(settings.out)
    state_dir = out / trainer.STATE_DIR
    saved = trainer.check_run_state(out, "full", resume)
    s = settings
    say = _say if s.progress else (lambda *a: None)
    out.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(exist_ok=True)

    if resume:
        assert saved is not None  # check_run_state refuses to resume nothing
        tok = load_tokenizer(out)
        stream = np.load(state_dir / "tokens.npy")
        corpus_info = saved["corpus"]
    else:
        docs = load_corpus(s.corpus, s.max_corpus_bytes)
        corpus_info = manifest(docs)
        say(f"corpus: {corpus_info['files']} files, {corpus_info['bytes'] / 1e6:.1f} MB; training the tokenizer")
        tok = train_tokenizer((d.text for d in docs), s.vocab)
        save_tokenizer(tok, out, s.max_positions, s.fim_order)
        stream = build_stream(tok, [d.text for d in docs], s.seq_len, s.fim_rate, s.seed, fim_order=s.fim_order)
        np.save(state_dir / "tokens.npy", stream)
    eos = tok.token_to_id(EOS)
    shape = ModelShape(hidden=s.hidden, layers=s.layers, heads=s.heads, intermediate=s.intermediate,
                       max_positions=s.max_positions)
    config = model_config(tok.get_vocab_size(), shape, eos_token_id=eos)
    counts = parameter_count(config)
    batches = Batches(stream, s.seq_len, s.batch, s.seed)
    say(f"model: {counts['trunk'] / 1e6:.2f}M trunk + {counts['heads'] / 1e6:.2f}M in {s.heads} MTP head(s), "
        f"{2 * sum(counts.values()) / 1e6:.1f} MB in bfloat16; data: {len(stream):,} tokens, "
        f"{s.steps * s.batch * s.seq_len / len(stream):.2f} epochs over {s.steps} steps")

    mx.random.seed(s.seed)
    model = MTPModel(config)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    weights = (s.head_weight,) * s.heads

    def write_model() -> None:
        save_safetensors(out / "model.safetensors", model.named_tensors(), mx.bfloat16)
        write_json(out / "config.json", config)

    evaluate = None
    held = held_out_files(s.corpus) if s.eval_windows else []
    windows = eval_windows(build_stream(tok, [d.text for d in held], s.seq_len, s.fim_rate, s.seed + 1,
                                        fim_order=s.fim_order),
                           s.seq_len, s.eval_windows) if held else None
    if windows is not None:
        evaluate = lambda: evaluate_windows(model, windows)  # noqa: E731

    job = trainer.Job(
        module=model,
        loss=lambda m, x: trunk_loss(m, x, weights),
        part_names=["trunk"] + [f"head{k + 1}" for k in range(s.heads)],
        batches=batches,
        out=out,
        write_model=write_model,
        describe={"mode": "full", "settings": asdict(s), "corpus": corpus_info, "config": config},
        evaluate=evaluate,
    )
    loop = trainer.LoopSettings(steps=s.steps, lr=s.lr, warmup=s.warmup, save_every=s.save_every,
                                compile=s.compile, progress=s.progress, threads=s.threads,
                                max_minutes=s.max_minutes)
    return trainer.run(job, loop, resume=resume, callback=callback)


def eval_windows(stream: np.ndarray, seq_len: int, n: int) -> mx.array | None:
    """Up to n windows spread evenly over a stream (None if it holds none)."""
    total = (len(stream) - 1) // seq_len
    if total < 1 or n < 1:
        return None
    starts = np.linspace(0, total - 1, num=min(n, total)).astype(int) * seq_len
    return mx.array(np.stack([stream[i : i + seq_len + 1] for i in starts]).astype(np.int32))


def evaluate_windows(model: MTPModel, windows: mx.array, chunk: int = 4) -> dict:
    """Held-out trunk loss and, per head, teacher-forced agreement with the trunk's
    greedy choice (a proxy for acceptance at temperature 0)."""
    losses, agree = [], []
    for i in range(0, windows.shape[0], chunk):
        x = windows[i : i + chunk]
        S = x.shape[1] - 1
        h = model.trunk.model(x[:, :S])
        logits = model.lm_head(h)
        losses.append(cross_entropy(logits, x[:, 1:]).item())
        agree.append(head_agreement(model, x, h, logits.argmax(axis=-1)))
    out = {"eval_loss": float(np.mean(losses))}
    for k, values in enumerate(zip(*agree)):
        out[f"head{k + 1}_agree"] = float(np.mean(values))
    return out


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
