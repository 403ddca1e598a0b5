"""Training new MTP heads for an existing checkpoint that has none.

The trunk is loaded by the normal loader (`Engine.load`) and frozen; new
MiMo-style heads (`engine.backends.mimo.MTPLayer`) learn by self-distillation:
head k at position p is trained towards the trunk's own next-token
distribution at position p+k+1, minimising KL(trunk || head).

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
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.backends.descriptors import inspect_checkpoint, mlx_model_type
from engine.backends.mimo import HEAD_PREFIX
from engine.checkpoint import CheckpointError, read_config, read_header, weight_keys
from engine.prompts import fim_tokens
from engine.training import trainer
from engine.training.corpus import held_out_files, load_corpus, manifest
from engine.training.data import Batches, build_stream
from engine.training.full import eval_windows
from engine.training.model import (
    MTPModel, distill_loss, head_agreement, log_softmax, save_safetensors, write_json,
)
from engine.training.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX

SIDECAR = "mtp.safetensors"
ZERO_BIAS = "model-zero-bias.safetensors"
CONVERTIBLE = ("mimo", "qwen2", "llama")
_DTYPES = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}


@dataclass
class HeadsSettings:
    model: str
    out: str
    corpus: str | None = None
    max_corpus_bytes: int | None = None
    heads: int = 2
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
    threads: int | None = 1  # BLAS threads (see trainer.LoopSettings)
    max_minutes: float | None = None  # a time budget: stop and save when spent
    # A MiMo checkpoint that has heads: distil them further, starting from their weights
    # (joint training leaves heads that agree with the trunk less than distilled ones).
    replace_heads: bool = False


def mimo_config(config: dict, keys: set[str], heads: int) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """The MiMo config for a MiMo / Qwen2 / Llama-style trunk, and the zero
    biases (name -> shape) a Llama-style trunk needs. Raises CheckpointError
    for trunks MiMo's layout cannot express."""
    kind = mlx_model_type(config)
    if kind not in CONVERTIBLE:
        raise CheckpointError(f"model_type {config.get('model_type')!r}: heads-only training supports "
                              f"MiMo, Qwen2 and Llama-style dense trunks")
    if isinstance(config.get("text_config"), dict):
        raise CheckpointError("nested text_config (a multimodal checkpoint) is not supported")
    d, n_heads = config["hidden_size"], config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = d // n_heads
    if config.get("head_dim") not in (None, head_dim):
        raise CheckpointError(f"head_dim {config['head_dim']} != hidden_size / num_attention_heads: "
                              "not expressible in MiMo's layout")
    for flag in ("mlp_bias", "attention_bias"):
        if kind == "llama" and config.get(flag):
            raise CheckpointError(f"{flag}=true: not expressible in MiMo's layout")
    if any(t != "full_attention" for t in config.get("layer_types") or ()) or (
        kind == "llama" and config.get("sliding_window")
    ):
        raise CheckpointError("sliding-window attention layers are not supported")
    new = dict(config)
    new.update(_as_loaded(config, kind))
    new.update({"model_type": "mimo", "architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": heads})
    new.pop("auto_map", None)
    if kind != "mimo":
        new["mtplxd_converted_from"] = config.get("model_type")
    biases = {}
    for i in range(config["num_hidden_layers"]):
        for proj, rows in (("q_proj", n_heads * head_dim), ("k_proj", n_kv * head_dim), ("v_proj", n_kv * head_dim)):
            name = f"model.layers.{i}.self_attn.{proj}.bias"
            if name not in keys:
                biases[name] = (rows,)
    if biases:
        new.pop("attention_bias", None)  # the converted trunk has (zero) q/k/v biases
    return new, biases


# Fields of mlx-lm's MiMo ModelArgs that shape the trunk's computation.
_TRUNK_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                 "rope_theta", "rope_traditional", "rope_scaling", "tie_word_embeddings")


def _as_loaded(config: dict, kind: str) -> dict:
    """The trunk fields as mlx-lm resolves them for the source's own model
    class (its defaults differ between families: rope_theta, tied
    embeddings), written out so the MiMo class computes the same trunk the
    heads were trained against."""
    import importlib

    args = importlib.import_module(f"mlx_lm.models.{kind}").ModelArgs.from_dict(config)
    values = {f: getattr(args, f, None) for f in _TRUNK_FIELDS}
    values["num_key_value_heads"] = values["num_key_value_heads"] or values["num_attention_heads"]
    return {k: v for k, v in values.items() if v is not None}


def prepare_output(src: Path, out: Path, heads: int, replace: bool = False) -> tuple[dict, mx.Dtype]:
    """Check the source, copy its files into `out`, write the MiMo config.
    Returns the new config and the dtype to store the heads in."""
    report = inspect_checkpoint(src)
    if report.mtp_heads > 0 and not (replace and report.family == "mimo"):
        hint = " (--replace-heads distils a MiMo checkpoint's heads further)" if report.family == "mimo" else ""
        raise CheckpointError(f"{src} already has {report.mtp_heads} MTP head(s){hint}")
    config = read_config(src)
    keys = {k: f for k, f in weight_keys(src).items() if not k.startswith(HEAD_PREFIX)}
    new_config, biases = mimo_config(config, set(keys), heads)
    embed = "model.embed_tokens.weight"
    if embed not in keys:
        raise CheckpointError(f"{src}: no {embed}")
    dtype = _DTYPES.get(read_header(keys[embed])[embed]["dtype"], mx.float32)
    if out.resolve() == src.resolve():
        raise ValueError("--out must be a new folder, not the model's own")
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in ("config.json", SIDECAR, ZERO_BIAS):
            _copy_trunk_file(path, out / path.name)
    if biases:
        save_safetensors(out / ZERO_BIAS, {k: mx.zeros(s, dtype) for k, s in biases.items()}, None)
    write_json(out / "config.json", new_config)
    return new_config, dtype


def _copy_trunk_file(src: Path, dst: Path) -> None:
    """Link or copy a file of the source; a weight file that holds old heads is
    rewritten without them (the new ones go to the sidecar)."""
    if src.suffix == ".safetensors" and any(k.startswith(HEAD_PREFIX) for k in read_header(src)):
        trunk = {k: v for k, v in mx.load(str(src)).items() if not k.startswith(HEAD_PREFIX)}
        save_safetensors(dst, trunk, None)
        return
    _link_or_copy(src, dst)


def _link_or_copy(src: Path, dst: Path) -> None:
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


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

    out = Path(settings.out)
    saved = trainer.check_run_state(out, "heads", resume)
    s = settings
    say = _say if s.progress else (lambda *a: None)
    src = Path(s.model).expanduser().resolve()
    state_dir = out / trainer.STATE_DIR

    if resume:
        config = saved["config"]
        dtype = _DTYPES[saved["head_dtype"]]
    else:
        config, dtype = prepare_output(src, out, s.heads, s.replace_heads)
    engine_ = Engine.load(src)  # the original, float32 on CPU
    trunk = engine_.backend.trunk
    trunk.freeze()
    encoder = _encoder(src, engine_)
    has_fim = None not in (encoder.token_to_id(t) for t in (FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE))
    fim_rate = s.fim_rate if s.fim_rate is not None else (0.5 if has_fim else 0.0)
    fim_order = fim_tokens(engine_.tokenizer).order if has_fim else "psm"
    eos = engine_.tokenizer.eos_token_id
    state_dir.mkdir(parents=True, exist_ok=True)
    if resume:
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
    model = MTPModel(config, trunk=trunk, n_heads=s.heads)
    for layer, old in zip(model.mtp_layers, engine_.backend.heads):  # --replace-heads: start from them
        layer.update(old.parameters())
    for layer in model.mtp_layers:
        layer.set_dtype(mx.float32)
    mx.eval(model.parameters())
    weights = (1.0,) * s.heads

    def loss(m: MTPModel, x: mx.array):
        S = x.shape[1] - 1
        h = mx.stop_gradient(m.trunk.model(x[:, :S]))
        target = mx.stop_gradient(log_softmax(m.lm_head(h)))
        return distill_loss(m, x, h, target, weights)

    def write_model() -> None:
        save_safetensors(out / SIDECAR, model.named_tensors(heads_only=True), dtype)

    evaluate = None
    held = held_out_files(s.corpus) if s.eval_windows else []
    windows = eval_windows(build_stream(encoder, [d.text for d in held], s.seq_len, fim_rate, s.seed + 1,
                                        eos_id=eos, fim_order=fim_order), s.seq_len, s.eval_windows) if held else None
    if windows is not None:
        evaluate = lambda: evaluate_heads(model, windows)  # noqa: E731

    say(f"trunk: {src.name} ({config.get('mtplxd_converted_from', 'mimo')}), frozen; training {s.heads} head(s) "
        f"by self-distillation on {len(stream):,} tokens")
    job = trainer.Job(
        module=model,
        loss=loss,
        part_names=[f"head{k + 1}_kl" for k in range(s.heads)],
        batches=batches,
        out=out,
        write_model=write_model,
        describe={"mode": "heads", "settings": asdict(s), "corpus": corpus_info, "config": config,
                  "head_dtype": next(k for k, v in _DTYPES.items() if v == dtype)},
        evaluate=evaluate,
    )
    loop = trainer.LoopSettings(steps=s.steps, lr=s.lr, warmup=s.warmup, save_every=s.save_every,
                                compile=s.compile, progress=s.progress, threads=s.threads,
                                max_minutes=s.max_minutes)
    return trainer.run(job, loop, resume=resume, callback=callback)


def evaluate_heads(model: MTPModel, windows: mx.array, chunk: int = 4) -> dict:
    """Per head: teacher-forced agreement with the trunk's greedy choice."""
    agree = []
    for i in range(0, windows.shape[0], chunk):
        x = windows[i : i + chunk]
        h = model.trunk.model(x[:, :-1])
        agree.append(head_agreement(model, x, h, model.lm_head(h).argmax(axis=-1)))
    return {f"head{k + 1}_agree": float(np.mean(v)) for k, v in enumerate(zip(*agree))}


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
