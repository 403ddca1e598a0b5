"""The training loop shared by full training and heads-only training.

AdamW with linear warmup and cosine decay, gradient clipping, one compiled
step. Resumable: every `save_every` steps (and at the end, and on Ctrl-C)
the job writes its usable bf16 checkpoint and, under `<out>/train_state/`,
the float32 trainable weights, the optimizer state and `state.json` (step,
data position, settings). `<out>/train_state/log.jsonl` has one line per step.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from engine.blas import set_threads
from engine.training.model import save_safetensors, training_attention, write_json

STATE_DIR = "train_state"


@dataclass
class LoopSettings:
    steps: int
    lr: float
    warmup: int | None = None  # default: min(100, steps // 10)
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    save_every: int = 100
    compile: bool = True
    progress: bool = True
    # BLAS threads while training (None: leave as is). Training a small model is bound by MLX's
    # single-threaded element-wise work, not matmuls: one thread is about as fast as two and does
    # not stall when other processes share the cores (engine/blas.py).
    threads: int | None = 1
    max_minutes: float | None = None  # stop (saving) once this much time has passed
    # when that time began (time.perf_counter()); None: the loop's start. Heads training
    # counts its first stage, the trunk's pass over the corpus, as the command's time: the
    # loop gets what is left, and its learning rate decays over that.
    budget_began: float | None = None


class BatchSource(Protocol):
    """Where a job's batches come from: engine/training/data.py's Batches (token windows)
    or engine/training/trunk_cache.py's WindowBatches (indices of cached windows)."""

    batch: int  # windows a batch
    seq_len: int

    def get(self, position: int) -> np.ndarray:
        """The batch starting at data position `position` (windows consumed so far)."""
        ...


@dataclass
class Job:
    """What differs between training modes."""

    module: nn.Module  # its trainable parameters are what is trained
    loss: Callable  # (module, x) -> (scalar loss, per-part losses [n])
    part_names: list[str]
    batches: BatchSource
    out: Path
    write_model: Callable[[], None]  # the bf16 checkpoint into `out`
    describe: dict[str, Any] = field(default_factory=dict)  # into state.json
    evaluate: Callable[[], dict] | None = None  # held-out metrics at each save


@dataclass
class TrainResult:
    out: Path
    step: int
    steps: int
    tokens_per_s: float
    history: list[dict]  # one entry per step run in this call
    evals: list[dict]


def learning_rate(s: LoopSettings, step: int, elapsed_s: float) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio.

    The decay follows whichever runs out first, the steps or the time budget,
    so a run stopped by --max-minutes still ends with a fully decayed rate
    (a cosine cut off half way leaves a noticeably worse model).
    """
    warmup = s.warmup if s.warmup is not None else min(100, s.steps // 10)
    if step < warmup:
        return s.lr * (step + 1) / warmup
    done = (step - warmup) / max(1, s.steps - warmup)
    if s.max_minutes:
        done = max(done, elapsed_s / (60 * s.max_minutes))
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * cosine)


def read_state(out: Path) -> dict | None:
    path = Path(out) / STATE_DIR / "state.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_run_state(out: Path, mode: str, resume: bool) -> dict | None:
    """The saved state of a `mode` run in `out`; refuses to resume nothing or overwrite a run."""
    saved = read_state(out)
    if resume and (saved is None or saved.get("mode") != mode):
        raise FileNotFoundError(f"nothing to resume in {out} (no {mode} training state)")
    if not resume and saved is not None:
        raise FileExistsError(f"{out} already holds a training run: pass --resume, or choose another --out")
    return saved


class _Interrupts:
    """First Ctrl-C: finish the step, save, stop. Second: stop at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupt: saving a checkpoint after this step (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def run(job: Job, s: LoopSettings, resume: bool = False,
        callback: Callable[[int, dict], None] | None = None) -> TrainResult:
    previous_threads = set_threads(s.threads) if s.threads else None
    try:
        return _run(job, s, resume, callback)
    finally:
        if previous_threads:
            set_threads(previous_threads)


def _run(job: Job, s: LoopSettings, resume: bool,
         callback: Callable[[int, dict], None] | None) -> TrainResult:
    state_dir = job.out / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    module = job.module
    opt = optim.AdamW(learning_rate=s.lr, weight_decay=s.weight_decay)
    opt.init(module.trainable_parameters())
    step = 0
    if resume:
        step = _restore(job, opt, state_dir)
    loss_and_grad = nn.value_and_grad(module, job.loss)

    def train_step(x):
        (loss, parts), grads = loss_and_grad(module, x)
        if s.grad_clip:
            grads, _ = optim.clip_grad_norm(grads, s.grad_clip)
        opt.update(module, grads)
        return loss, parts

    if s.compile:
        state = [module.state, opt.state]
        train_step = partial(mx.compile, inputs=state, outputs=state)(train_step)

    tokens_per_step = job.batches.batch * job.batches.seq_len
    history: list[dict] = []
    evals: list[dict] = []
    bar = _Progress(s.steps, step, s.progress)
    log = (state_dir / "log.jsonl").open("a", buffering=1)  # line-buffered: readable while training
    started, run_tokens = time.perf_counter(), 0
    if s.max_minutes and s.budget_began is not None:
        s = replace(s, max_minutes=max(1e-9, s.max_minutes - (started - s.budget_began) / 60))

    def save() -> None:
        _save(job, opt, state_dir, step, s)
        if job.evaluate is not None:
            metrics = {"step": step, **job.evaluate()}
            evals.append(metrics)
            log.write(json.dumps({"eval": metrics}) + "\n")
            bar.note("eval " + " ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k != "step"))
        log.flush()

    try:
        with _Interrupts() as interrupts, training_attention():
            while step < s.steps:
                t = time.perf_counter()
                opt.learning_rate = learning_rate(s, step, t - started)
                x = mx.array(job.batches.get(step * job.batches.batch))
                loss, parts = train_step(x)
                mx.eval(loss, parts, module.trainable_parameters(), opt.state)
                step += 1
                dt = time.perf_counter() - t
                run_tokens += tokens_per_step
                entry = {"step": step, "loss": loss.item(), "lr": float(opt.learning_rate),
                         **dict(zip(job.part_names, parts.tolist())), "s": round(dt, 4)}
                history.append(entry)
                log.write(json.dumps(entry) + "\n")
                rate = run_tokens / (time.perf_counter() - started)
                bar.update(entry, rate)
                if callback is not None:
                    callback(step, entry)
                if interrupts.requested:
                    raise KeyboardInterrupt
                out_of_time = s.max_minutes is not None and time.perf_counter() - started > 60 * s.max_minutes
                if step % s.save_every == 0 or step == s.steps or out_of_time:
                    save()
                if out_of_time and step < s.steps:
                    bar.note(f"time budget of {s.max_minutes:g} min spent at step {step}/{s.steps}; "
                             f"checkpoint saved (more with --resume)")
                    break
    except KeyboardInterrupt:
        save()
        bar.note(f"interrupted at step {step}; checkpoint saved in {job.out} (continue with --resume)")
        raise
    finally:
        bar.close()
        log.close()
    elapsed = time.perf_counter() - started
    return TrainResult(job.out, step, s.steps, run_tokens / max(elapsed, 1e-9), history, evals)


def _save(job: Job, opt: optim.Optimizer, state_dir: Path, step: int, s: LoopSettings) -> None:
    mx.eval(job.module.trainable_parameters(), opt.state)
    job.write_model()
    save_safetensors(state_dir / "weights.safetensors", dict(tree_flatten(job.module.trainable_parameters())), None)
    save_safetensors(state_dir / "optimizer.safetensors", dict(tree_flatten(opt.state)), None)
    write_json(state_dir / "state.json", {
        "step": step,
        "data_position": step * job.batches.batch,
        "loop": s.__dict__,
        **job.describe,
    })


def _restore(job: Job, opt: optim.Optimizer, state_dir: Path) -> int:
    state = read_state(job.out)
    if state is None:
        raise FileNotFoundError(f"nothing to resume in {job.out} (no {STATE_DIR}/state.json)")
    weights = _load(state_dir / "weights.safetensors")
    job.module.load_weights(list(weights.items()), strict=False)
    expected = {k for k, _ in cast(list[tuple[str, mx.array]], tree_flatten(job.module.trainable_parameters()))}
    if set(weights) != expected:
        raise ValueError(f"{state_dir}: saved weights do not match the model being trained")
    opt.state = tree_unflatten(list(_load(state_dir / "optimizer.safetensors").items()))
    mx.eval(job.module.parameters(), opt.state)
    if state["data_position"] != state["step"] * job.batches.batch:
        raise ValueError(f"{state_dir}: batch size changed since the checkpoint")
    return int(state["step"])


def _load(path: Path) -> dict[str, mx.array]:
    return cast(dict[str, mx.array], mx.load(str(path)))  # a .safetensors file: a dict


class _Progress:
    """tqdm where installed, else a carriage-return line; silent when disabled."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.total, self.enabled, self._bar = total, enabled, None
        self._start, self._initial = time.perf_counter(), initial
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                                 file=sys.stderr)
            except ImportError:
                pass

    def update(self, entry: dict, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        text = f"loss {entry['loss']:.3f} {tokens_per_s:,.0f} tok/s"
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(1)
            return
        done = entry["step"] - self._initial
        left = (time.perf_counter() - self._start) / max(done, 1) * (self.total - entry["step"])
        eta = f"{int(left // 60)}:{int(left % 60):02d}"
        print(f"\rstep {entry['step']}/{self.total} {text} ETA {eta}  ", end="", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print("\n" + text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)
