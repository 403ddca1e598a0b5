"""Training new MTP heads for an existing checkpoint that has none.

The trunk is loaded by the normal loader (`Engine.load`) and frozen; new
MiMo-style heads (`engine.backends.mimo.MTPLayer`) learn by self-distillation:
head k at position p is trained towards the trunk's own next-token
distribution at position p+k+1, minimising KL(trunk || head). The frozen trunk
runs once over the corpus and its outputs are kept (engine/training/trunk_cache.py:
hidden states and the top-k of each distribution over a draft vocabulary), so an
epoch costs the heads alone: on a real trunk the trunk's forward was most of a step.
New heads start as the trunk's last block (`start_from_last_block`).

Why KL to the full distribution rather than CE to the trunk's argmax: the
verifier accepts a draft with probability min(1, p/q), so the acceptance rate
of one position is sum_x min(p(x), q(x)) = 1 - TV(p, q), and Pinsker bounds TV
by sqrt(KL / 2). Matching the whole distribution serves every temperature
(at temperature 0 the argmax of a good match is the trunk's argmax), keeps q
from becoming over-confident, and gives a gradient on every vocabulary entry
instead of one.

Output: a new folder with the original files unchanged (hard links where the
file system allows, else copies), the heads in a sidecar `mtp.safetensors`
(`model.mtp_layers.{i}.*`) and config.json updated with
`num_nextn_predict_layers`. MiMo's trunk is Qwen2's trunk, so an AR-only
Qwen2 checkpoint becomes a MiMo one by its config alone; a Llama-style trunk
(no attention biases) also gets zero q/k/v biases in `model-zero-bias.safetensors`.

A checkpoint of any other MTP family the engine runs (DeepSeek-V3, GLM-4.5, GLM-5,
Step-3.5, MiMo-V2-Flash, Hunyuan-V3, Nemotron-H, Qwen3-Next, Qwen3.5), with
--replace-heads: its OWN heads are distilled further, by the same loss. They
are the loaded backend's head modules, run through its `head(k, hidden, tokens,
cache)` contract and chained as engine/generation.py chains them (head k reads
head k-1's output and token p+k+1), each over the whole window with a fresh
head cache, as a prefill would. They go back under the family's own key names
into the sidecar (engine/head_export.py, as `mtplxd convert` writes them); the
trunk files are copied byte for byte without the old head tensors, config.json
unchanged, the trunk running every step. MiMo's own heads take the MiMo path
above, starting from their weights.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from engine.backends.base import Backend
from engine.backends.descriptors import InspectReport, head_key_predicate, inspect_checkpoint
from engine.backends.draft_vocab import DRAFT_VOCAB_KEY
from engine.backends.mimo import HEAD_PREFIX, MiMoBackend, MTPLayer, mimo_config
from engine.checkpoint import (
    CheckpointError, read_config, read_header, text_config, weight_keys, write_safetensors_subset,
)
from engine.head_export import HEADS_FILE, head_tensors, stored_head_pattern
from engine.prompts import fim_tokens
from engine.training import trainer
from engine.training.corpus import held_out_files, load_corpus, manifest
from engine.training.data import Batches, build_stream
from engine.training.full import eval_windows
from engine.training.model import (
    distill_loss, head_agreement, log_softmax, save_safetensors, write_json,
)
from engine.training.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX
from engine.training.trunk_cache import (
    CachedHeads, TrunkOutputs, WindowBatches, continuation_prompts, continuation_shape, continued_outputs,
    corpus_windows, draft_vocabulary, line_end_ids, trunk_outputs,
)

SIDECAR = HEADS_FILE  # mtp.safetensors, where the loader and `mtplxd convert` keep heads
ZERO_BIAS = "model-zero-bias.safetensors"
_DTYPES = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}
_INDEX = "model.safetensors.index.json"


@dataclass
class HeadsSettings:
    model: str
    out: str
    corpus: str | None = None
    max_corpus_bytes: int | None = None
    heads: int | None = None  # new heads: 2; --replace-heads on another family: the checkpoint's own count
    seq_len: int = 256
    batch: int = 8
    steps: int = 600
    lr: float = 1e-3
    warmup: int | None = None
    fim_rate: float | None = None  # default: 0.5 where the tokenizer has FIM tokens, else 0
    seed: int = 0
    save_every: int = 100
    eval_windows: int = 16
    compile: bool = True
    progress: bool = True
    # BLAS threads (see trainer.LoopSettings); None: OpenBLAS's own count, every core. A heads
    # step multiplies thousands of rows by the head's weights and the draft vocabulary's: on 2
    # cores SmolLM2's step took 1.9 s on two threads against 2.7 s on one (docs/performance.md).
    threads: int | None = None
    max_minutes: float | None = None  # the command's time budget (the first stage too): stop and save when spent
    # A checkpoint that has heads: distil them further, starting from their weights
    # (joint training leaves heads that agree with the trunk less than distilled ones).
    replace_heads: bool = False
    # New (MiMo-style) heads: run the frozen trunk once over `windows` corpus windows and
    # train on its cached outputs (engine/training/trunk_cache.py): the top_k of each
    # next-token distribution over a draft_vocab-token draft vocabulary.
    # windows None: every window of the corpus.
    windows: int | None = None
    top_k: int = 32
    draft_vocab: int = 8192
    # and `continued` windows of which the trunk writes the second half itself: greedy
    # continuations of corpus text ending at a line break (trunk_cache.continued_outputs)
    continued: int = 0


def prepare_output(src: Path, out: Path, heads: int, replace: bool = False) -> tuple[dict, mx.Dtype]:
    """Check the source, copy its files into `out`, write the MiMo config.
    Returns the new config and the dtype to store the heads in."""
    report = inspect_checkpoint(src)
    if report.mtp_heads > 0 and not (replace and report.family == "mimo"):
        hint = " (--replace-heads distils them further)" if report.status == "supported" else ""
        raise CheckpointError(f"{src} already has {report.mtp_heads} MTP head(s){hint}")
    config = read_config(src)
    keys = {k: f for k, f in weight_keys(src).items() if not k.startswith(HEAD_PREFIX)}
    new_config, biases = mimo_config(config, set(keys), heads)
    embed = "model.embed_tokens.weight"
    if embed not in keys:
        raise CheckpointError(f"{src}: no {embed}")
    # Heads are stored as the trunk's embedding is; bfloat16 beside a quantized trunk (a
    # quantized head drafts worse).
    dtype = _DTYPES.get(read_header(keys[embed])[embed]["dtype"], mx.bfloat16)
    _check_new_folder(src, out)
    copy_without_heads(src, out, lambda k: k.startswith(HEAD_PREFIX), skip=("config.json", ZERO_BIAS))
    if biases:
        save_safetensors(out / ZERO_BIAS, {k: mx.zeros(s, dtype) for k, s in biases.items()}, None)
    write_json(out / "config.json", new_config)
    return new_config, dtype


def distils_family_heads(report: InspectReport, replace: bool) -> bool:
    """Whether this run trains a (non-MiMo) family's own heads rather than MiMo-style ones."""
    return replace and report.mtp_heads > 0 and report.family != "mimo"


def prepare_family_output(src: Path, out: Path, report: InspectReport, heads: int | None) -> tuple[dict, mx.Dtype]:
    """Check that the family's own heads can be trained, copy the source into `out`
    without them. Returns the (unchanged) config and the dtype the source stores heads in."""
    if report.status != "supported":
        raise CheckpointError(f"{src}: cannot train {report.family}'s heads: {report.reason}")
    if heads not in (None, report.mtp_heads):
        raise CheckpointError(f"--heads {heads}: --replace-heads trains the checkpoint's own "
                              f"{report.mtp_heads} {report.family} head(s); it cannot add or drop heads")
    config = read_config(src)
    is_head = head_key_predicate(report.supported_descriptor, _trunk_layers(config))
    dtype = _head_dtype(src, is_head)
    _check_new_folder(src, out)
    copy_without_heads(src, out, is_head)
    return config, dtype


def _head_dtype(src: Path, is_head: Callable[[str], bool]) -> mx.Dtype:
    """The widest float dtype the source stores its heads in (fp8 heads come back bfloat16)."""
    found = {info["dtype"] for path in set(weight_keys(src).values())
             for k, info in read_header(path).items() if is_head(k)}
    return next((_DTYPES[t] for t in ("F32", "BF16", "F16") if t in found), mx.bfloat16)


def _trunk_layers(config: dict) -> int:
    return int(text_config(config).get("num_hidden_layers") or 0)


def _check_new_folder(src: Path, out: Path) -> None:
    if out.resolve() == src.resolve():
        raise ValueError("--out must be a new folder, not the model's own")
    out.mkdir(parents=True, exist_ok=True)


def copy_without_heads(src: Path, out: Path, is_head: Callable[[str], bool], skip: tuple[str, ...] = ()) -> None:
    """Every top-level file of `src` into `out`: weight files without the head tensors
    (a file of heads alone is left out: the new heads go to the sidecar), the index
    without their entries, everything else linked or copied as it is."""
    for path in sorted(src.iterdir()):
        if not path.is_file() or path.name in skip:
            continue
        dst = out / path.name
        if path.suffix == ".safetensors" and any(is_head(k) for k in read_header(path)):
            write_safetensors_subset(path, dst, lambda k: not is_head(k))
        elif path.name == _INDEX:
            index = json.loads(path.read_text())
            index["weight_map"] = {k: f for k, f in index.get("weight_map", {}).items() if not is_head(k)}
            write_json(dst, index)
        else:
            _link_or_copy(path, dst)


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class FamilyHeads(nn.Module):
    """A loaded backend's own MTP heads as one trainable module. The trunk stays outside
    it (frozen); both are reached only through the backend's forward / head contract, so
    the heads train exactly as the generation loop runs them.

    The interface the losses need (as MTPModel's): trunk_forward, heads_forward,
    named_tensors, n_heads.
    """

    def __init__(self, backend: Backend, report: InspectReport, src: Path):
        super().__init__()
        _check_head_caches(backend)
        self.heads = backend.heads  # the backend's own list: training updates what it runs
        self._backend = backend
        _tie_shared_parts(backend.heads, report.supported_descriptor.shared_parts)
        _freeze_integer_arrays(backend.heads)
        self._export = _exporter(backend, report, src)
        self._offsets = _layout_offsets(report, src, self._export())
        for head in self.heads:
            head.set_dtype(mx.float32)

    @property
    def n_heads(self) -> int:
        return len(self.heads)

    def trunk_forward(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(logits, the hidden head 0 reads) over x, a fresh cache: a prefill."""
        return self._backend.forward(x, self._backend.make_cache())

    def heads_forward(self, hidden: mx.array, x: mx.array):
        """Yield (k, head k's logits) over every position it can predict: head k at p
        reads (head k-1's output at p, or the trunk's hidden, token p+k+1)."""
        S = x.shape[1] - 1
        caches = self._backend.make_head_caches()
        for k in range(self.n_heads):
            n = S - k - 1
            if n < 1:
                break
            logits, hidden = self._backend.head(k, hidden[:, :n], x[:, k + 1 : k + 1 + n], caches[k])
            yield k, logits

    def named_tensors(self, heads_only: bool = True) -> dict[str, mx.array]:
        """The heads under the family's own key names, in the source's layout."""
        return {k: v - self._offsets[k] if k in self._offsets else v for k, v in self._export().items()}


def _check_head_caches(backend: Backend) -> None:
    """A window is trained with a fresh cache per head, which KVCache allows (prefill);
    state that a prefill cannot start from nothing would need another loss."""
    for cache in backend.make_head_caches():
        if type(cache) is not KVCache:
            raise CheckpointError(f"{backend.family}: its heads keep {type(cache).__name__} state; heads-only "
                                  f"training runs each head over a whole window with a fresh KVCache")


def _tie_shared_parts(heads: list[nn.Module], shared_parts: tuple[str, ...]) -> None:
    """Qwen's fc / pre-fc norms / final norm are one set of weights for every head (the
    loader gives each head a copy): make heads 1.. use head 0's modules, and train them
    once, through head 0's entry (heads 1.. do not list them as trainable)."""
    names = sorted({part.split(".", 1)[0] for part in shared_parts})
    for head in heads[1:]:
        for name in names:
            setattr(head, name, getattr(heads[0], name))
        head.freeze(recurse=False, keys=names)


def _freeze_integer_arrays(heads: list[nn.Module]) -> None:
    """Integer arrays in a head (a hash-routing table: token -> experts) are lookups, not
    weights: no gradient reaches them, and asking for one fails."""
    for head in heads:
        for _, module in head.named_modules():
            lookups = [k for k, v in module.items() if isinstance(v, mx.array) and not mx.issubdtype(v.dtype, mx.floating)]
            if lookups:
                module.freeze(recurse=False, keys=lookups)


def _exporter(backend: Backend, report: InspectReport, src: Path) -> Callable[[], dict[str, mx.array]]:
    """What names the heads as the loader finds them: the backend itself where its heads
    span several checkpoint layers (Nemotron-H), else the descriptor's pattern the
    source uses."""
    own = getattr(backend, "head_tensors", None)
    if own is not None:
        return own
    config = read_config(src)
    n_layers = _trunk_layers(config)
    descriptor = report.supported_descriptor
    pattern = stored_head_pattern(descriptor, weight_keys(src), n_layers)
    return lambda: head_tensors(descriptor, backend.heads, n_layers, pattern)


def _layout_offsets(report: InspectReport, src: Path, loaded: dict[str, mx.array]) -> dict[str, float]:
    """What the loader added to the head tensors it reads back under the same name: the +1
    of zero-centred norms (Qwen, Step-3.5) wherever mlx-lm gave the trunk's theirs. The
    sidecar subtracts it again: it holds the heads in the source's own layout, beside the
    source's trunk files, so the next load shifts them exactly once."""
    if not report.supported_descriptor.norm_shift:
        return {}
    stored = weight_keys(src)
    files: dict[Path, dict[str, mx.array]] = {}
    offsets = {}
    for name, value in loaded.items():
        if value.ndim != 1 or name not in stored:
            continue
        loaded_file = cast(dict[str, mx.array], mx.load(str(stored[name])))  # a .safetensors file: a dict
        source = files.setdefault(stored[name], loaded_file)[name]
        delta = value.astype(mx.float32) - source.astype(mx.float32)
        offset = round(cast(float, delta.mean().item()))  # a float32 scalar
        if offset not in (0, 1) or not mx.allclose(delta, mx.array(float(offset)), atol=1e-3).item():
            raise CheckpointError(f"{name}: the loader changed this head tensor in a way that cannot be "
                                  "written back in the checkpoint's layout")
        if offset:
            offsets[name] = float(offset)
    return offsets


class _HFEncoder:
    """encode / encode_batch / token_to_id over a transformers tokenizer
    (for checkpoints without tokenizer.json)."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def __init__(self, hf):
        self.hf = hf

    def encode(self, text, add_special_tokens=False):
        return self._Enc(self.hf.encode(text, add_special_tokens=False))

    def encode_batch(self, texts, add_special_tokens=False):
        return [self.encode(t) for t in texts]

    def token_to_id(self, token):
        tid = self.hf.convert_tokens_to_ids(token)
        return None if tid is None or tid == self.hf.unk_token_id else tid


def _encoder(folder: Path, engine_):
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    return _HFEncoder(getattr(engine_.tokenizer, "_tokenizer", engine_.tokenizer))


def train_heads(settings: HeadsSettings, resume: bool = False, callback=None) -> trainer.TrainResult:
    from engine.engine import Engine

    loop = _loop(settings, began=time.perf_counter())  # the time budget counts the first stage too
    out = Path(settings.out)
    saved = trainer.check_run_state(out, "heads", resume)
    s = settings
    say = _say if s.progress else (lambda *a: None)
    src = Path(s.model).expanduser().resolve()
    state_dir = out / trainer.STATE_DIR

    report = inspect_checkpoint(src)
    own = distils_family_heads(report, s.replace_heads)
    if resume:
        assert saved is not None  # check_run_state refuses to resume nothing
        config = saved["config"]
        dtype = _DTYPES[saved["head_dtype"]]
    elif own:
        config, dtype = prepare_family_output(src, out, report, s.heads)
    else:
        config, dtype = prepare_output(src, out, s.heads or 2, s.replace_heads)
    engine_ = Engine.load(src, trainable_heads=True)  # the original, float32 on CPU
    engine_.backend.trunk.freeze()
    encoder = _encoder(src, engine_)
    has_fim = None not in (encoder.token_to_id(t) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE))
    fim_rate = s.fim_rate if s.fim_rate is not None else (0.5 if has_fim else 0.0)
    fim_order = fim_tokens(engine_.tokenizer).order if has_fim else "psm"
    eos = engine_.tokenizer.eos_token_id
    state_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        assert saved is not None
        stream = np.load(state_dir / "tokens.npy")
        corpus_info = saved["corpus"]
    else:
        docs = load_corpus(s.corpus, s.max_corpus_bytes)
        corpus_info = manifest(docs)
        say(f"corpus: {corpus_info['files']} files, {corpus_info['bytes'] / 1e6:.1f} MB")
        stream = build_stream(encoder, [d.text for d in docs], s.seq_len, fim_rate, s.seed, eos_id=eos,
                              fim_order=fim_order)
        np.save(state_dir / "tokens.npy", stream)
    batches = Batches(stream, s.seq_len, s.batch, s.seed)

    mx.random.seed(s.seed)
    if not own:
        corpus = CorpusTokens(stream, held_windows(s, encoder, fim_rate, fim_order, eos), corpus_info)
        job = _cached_job(s, config, dtype, engine_, corpus, resume, say)
        return trainer.run(job, loop, resume=resume, callback=callback)
    model = FamilyHeads(engine_.backend, report, src)
    weights = (1.0,) * model.n_heads

    def loss(m, x: mx.array):
        S = x.shape[1] - 1
        logits, h = m.trunk_forward(x[:, :S])
        target = mx.stop_gradient(log_softmax(logits.astype(mx.float32)))
        return distill_loss(m, x, mx.stop_gradient(h), target, weights)

    def write_model() -> None:
        save_safetensors(out / SIDECAR, model.named_tensors(heads_only=True), dtype)

    evaluate = None
    windows = held_windows(s, encoder, fim_rate, fim_order, eos)
    if windows is not None:
        evaluate = lambda: evaluate_heads(model, windows)  # noqa: E731

    say(f"trunk: {src.name}, frozen; training its own {model.n_heads} {report.family} head(s) by "
        f"self-distillation on {len(stream):,} tokens")
    job = trainer.Job(
        module=model,
        loss=loss,
        part_names=[f"head{k + 1}_kl" for k in range(model.n_heads)],
        batches=batches,
        out=out,
        write_model=write_model,
        describe=_describe(s, corpus_info, config, dtype),
        evaluate=evaluate,
    )
    return trainer.run(job, loop, resume=resume, callback=callback)


def _describe(s: HeadsSettings, corpus_info: dict, config: dict, dtype: mx.Dtype) -> dict:
    """What state.json records of a heads run (a resumed run reads it back)."""
    return {"mode": "heads", "settings": asdict(s), "corpus": corpus_info, "config": config,
            "head_dtype": next(k for k, v in _DTYPES.items() if v == dtype)}


def _loop(s: HeadsSettings, began: float) -> trainer.LoopSettings:
    return trainer.LoopSettings(steps=s.steps, lr=s.lr, warmup=s.warmup, save_every=s.save_every,
                                compile=s.compile, progress=s.progress, threads=s.threads,
                                max_minutes=s.max_minutes, budget_began=began)


def held_windows(s: HeadsSettings, encoder, fim_rate: float, fim_order: str, eos) -> mx.array | None:
    """Windows of the held-out modules, for the evaluations during training."""
    held = held_out_files(s.corpus) if s.eval_windows else []
    if not held:
        return None
    stream = build_stream(encoder, [d.text for d in held], s.seq_len, fim_rate, s.seed + 1, eos_id=eos,
                          fim_order=fim_order)
    return eval_windows(stream, s.seq_len, s.eval_windows)


@dataclass(frozen=True)
class CorpusTokens:
    stream: np.ndarray  # the training corpus, tokenized
    held: mx.array | None  # held-out windows for the evaluations
    info: dict  # the corpus manifest, for state.json


def _cached_job(s: HeadsSettings, config: dict, dtype: mx.Dtype, engine_, corpus: CorpusTokens, resume: bool,
                say) -> trainer.Job:
    """New MiMo-style heads against the trunk's outputs, computed once (trunk_cache.py)."""
    from mlx_lm.models import mimo

    stream, held, corpus_info = corpus.stream, corpus.held, corpus.info

    out = Path(s.out)
    state_dir = out / trainer.STATE_DIR
    trunk = engine_.backend.trunk
    vocab = draft_vocabulary(stream, s.draft_vocab)
    embed = _dense(trunk.model.embed_tokens)
    lm_rows = (embed if getattr(trunk.args, "tie_word_embeddings", True) else _dense(trunk.lm_head))[vocab]
    cache_file = state_dir / "trunk_outputs.safetensors"
    # a decode of every token id the corpus uses: only where windows are continued
    line_ends = line_end_ids(engine_.tokenizer, stream) if s.continued else np.empty(0, np.int64)
    # The trunk continues text on the engine's own decode path, which gives the hidden
    # states; MiMo's trunk is a Qwen2 / Llama-style one, so it runs any trunk heads train on.
    writer = MiMoBackend(trunk, [])
    if resume and cache_file.is_file():
        outputs = TrunkOutputs.load(cache_file)
    else:
        started = time.perf_counter()
        outputs = _corpus_outputs(s, writer, lm_rows, stream, line_ends, say)
        say(f"trunk outputs: {time.perf_counter() - started:.0f} s")
        outputs.save(cache_file)
    held_outputs = trunk_outputs(trunk.model, lm_rows, np.array(held), s.top_k) if held is not None else None
    held_continued = None
    if held is not None and s.continued:
        prompt, new_tokens = continuation_shape(s.seq_len)
        prompts = continuation_prompts(np.array(held).reshape(-1), line_ends, prompt, s.eval_windows, s.seed)
        held_continued = continued_outputs(writer, lm_rows, prompts, new_tokens, s.top_k)
    model = CachedHeads(mimo.ModelArgs.from_dict(config), s.heads or 2, embed, lm_rows)
    for layer, old in zip(model.mtp_layers, engine_.backend.heads):  # --replace-heads: start from them
        layer.update(old.parameters())
        layer.set_dtype(mx.float32)
    for layer in model.mtp_layers[len(engine_.backend.heads):]:
        start_from_last_block(layer, trunk)
    mx.eval(model.parameters())
    say(f"training {model.n_heads} head(s) on {len(outputs)} cached windows")

    def write_model() -> None:
        names = {f"{HEAD_PREFIX}{i}.{k}": v for i, layer in enumerate(model.mtp_layers)
                 for k, v in cast(list[tuple[str, mx.array]], tree_flatten(layer.parameters()))}
        # the heads learnt to score these tokens only: at decode time they read only these
        # rows of the LM head (engine/backends/draft_vocab.py)
        save_safetensors(out / SIDECAR, {**names, DRAFT_VOCAB_KEY: vocab}, dtype)

    evaluate = None
    if held_outputs is not None:
        evaluate = lambda: _held_agreement(model, held_outputs, held_continued)  # noqa: E731
    return trainer.Job(
        module=model,
        loss=lambda m, batch: m.loss(outputs, batch),
        part_names=[f"head{k + 1}_ce" for k in range(model.n_heads)],
        batches=WindowBatches(len(outputs), s.seq_len, s.batch, s.seed),
        out=out,
        write_model=write_model,
        describe=_describe(s, corpus_info, config, dtype),
        evaluate=evaluate,
    )


def _corpus_outputs(s: HeadsSettings, backend, lm_rows: mx.array, stream: np.ndarray, line_ends: np.ndarray,
                    say) -> TrunkOutputs:
    """The trunk's outputs over `s.windows` corpus windows and `s.continued` windows it
    half writes itself."""
    parts = []
    if s.windows != 0:
        windows = corpus_windows(stream, s.seq_len, s.windows, s.seed)
        say(f"trunk: running once over {len(windows)} windows of {s.seq_len} tokens (top {s.top_k} of "
            f"a {lm_rows.shape[0]}-token draft vocabulary kept)")
        parts.append(trunk_outputs(backend.trunk.model, lm_rows, windows, s.top_k, progress=s.progress))
    if s.continued:
        prompt, new_tokens = continuation_shape(s.seq_len)
        prompts = continuation_prompts(stream, line_ends, prompt, s.continued, s.seed)
        say(f"trunk: continuing {len(prompts)} prompts of {prompts.shape[1]} corpus tokens by "
            f"{new_tokens} tokens of its own (greedy)")
        parts.append(continued_outputs(backend, lm_rows, prompts, new_tokens, s.top_k, progress=s.progress))
    if not parts:
        raise ValueError("--windows 0 and no --continued windows: nothing to train on")
    return TrunkOutputs.concatenate(parts)


def _held_agreement(model: CachedHeads, held: TrunkOutputs, continued: TrunkOutputs | None) -> dict[str, float]:
    """Per head: agreement with the trunk on held-out corpus windows, and on the
    trunk's own continuations of held-out code (what the heads will draft)."""
    found = {f"head{k + 1}_agree": a for k, a in enumerate(model.agreement(held, mx.arange(len(held))))}
    if continued is not None:
        agree = model.agreement(continued, mx.arange(len(continued)))
        found.update({f"head{k + 1}_agree_continued": a for k, a in enumerate(agree)})
    return found


def start_from_last_block(layer: MTPLayer, trunk: nn.Module) -> None:
    """A new head starts as the trunk's last block (its norms, attention and MLP; the
    trunk's final norm after it), its fusion adding the two normed inputs. After the same
    1,200 steps SmolLM2's heads agreed with the trunk on its own continuations 0.615 / 0.659
    of the time from here, 0.610 / 0.609 from random weights, and their depth-1 acceptance
    on held-out code rose from 0.642 to 0.668 (docs/performance.md). Parts the head's block
    lacks (Qwen3's q/k norms) are left out."""
    block = trunk.model.layers[-1]
    for part in ("self_attn", "mlp"):
        for name, linear in getattr(layer, part).children().items():
            source = getattr(getattr(block, part), name, None)
            if not isinstance(linear, nn.Linear) or source is None:
                continue
            linear.weight = _dense(source)
            if "bias" in linear:
                linear.bias = source.bias.astype(mx.float32) if "bias" in source else mx.zeros_like(linear.bias)
    for name in ("input_layernorm", "post_attention_layernorm"):
        getattr(layer, name).weight = getattr(block, name).weight.astype(mx.float32)
    layer.final_layernorm.weight = trunk.model.norm.weight.astype(mx.float32)
    layer.input_proj.weight = mx.tile(mx.eye(layer.input_proj.weight.shape[0], dtype=mx.float32), (1, 2))


def _dense(layer: nn.Module) -> mx.array:
    """A (possibly quantized) linear or embedding layer's weight as a float32 matrix."""
    if hasattr(layer, "scales"):
        return mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size,
                             bits=layer.bits).astype(mx.float32)
    return layer.weight.astype(mx.float32)


def evaluate_heads(model: FamilyHeads, windows: mx.array, chunk: int = 4) -> dict:
    """Per head: teacher-forced agreement with the trunk's greedy choice."""
    agree = []
    for i in range(0, windows.shape[0], chunk):
        x = windows[i : i + chunk]
        logits, h = model.trunk_forward(x[:, :-1])
        agree.append(head_agreement(model, x, h, logits.argmax(axis=-1)))
    return {f"head{k + 1}_agree": float(np.mean(v)) for k, v in enumerate(zip(*agree))}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
