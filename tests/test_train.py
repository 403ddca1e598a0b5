"""mtplxd's own training code (engine/training): tokenizer, FIM data, the
from-scratch MiMo-layout model, resume and Ctrl-C, and heads-only training
for a checkpoint without MTP heads. Tiny sizes: the whole file runs in well
under a minute on two CPU cores."""

from __future__ import annotations

import json
import random
from pathlib import Path

import engine  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine.backends.draft_vocab import DRAFT_VOCAB_KEY
from engine.backends.descriptors import inspect_checkpoint
from engine.backends.mimo import MiMoBackend, MTPLayer
from engine.engine import Engine, load_tokenizer
from engine.generation import GenerationRequest
from engine.sampling import SamplerSettings
from engine.train import (
    SPECIAL_TOKENS, STATE_DIR, Batches, HeadsSettings, ModelSettings, build_stream, fim_ids, fim_split, token_starts,
    load_corpus, measure_acceptance, resume_training, save_tokenizer, train_heads, train_model,
    train_tokenizer,
)
from tests.checkpoints import write
from tests.engine_helpers import assert_greedy_agree
from tests.floats import DOT_ULPS, FEW_OPS_ULPS, LONG_PATHS_ULPS, assert_close, excess

TINY = dict(vocab=300, hidden=32, layers=2, heads=2, seq_len=32, batch=4, lr=3e-3, save_every=1000,
            eval_windows=0, compile=False, progress=False)


def repetitive_source(seed: int) -> str:
    """Python-like text over the tiny test tokenizer's characters, highly predictable."""
    rng = random.Random(seed)
    out = []
    for _ in range(30):
        n = rng.randint(0, 9)
        out.append(f"def add_{n}(x):\n    return x + {n}\n\n")
    return "".join(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(4):
        (folder / f"mod{i}.py").write_text(repetitive_source(i))
    (folder / "tests").mkdir()
    (folder / "tests" / "test_skipped.py").write_text("SKIPPED = 1\n")
    (folder / "textwrap.py").write_text("HELD_OUT = 1\n")  # a held-out module name
    return folder


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """One tiny from-scratch run shared by the checks below."""
    out = tmp_path_factory.mktemp("full") / "model"
    result = train_model(ModelSettings(out=str(out), corpus=str(corpus), steps=60, **TINY))
    return out, result


def test_corpus_skips_tests_and_held_out_modules(corpus):
    paths = [d.path for d in load_corpus(corpus)]
    assert sorted(paths) == [f"mod{i}.py" for i in range(4)]
    assert paths == [d.path for d in load_corpus(corpus)]  # deterministic order
    assert len(load_corpus(corpus, max_bytes=1)) == 1


def test_tokenizer_round_trip_with_single_id_special_tokens(corpus, tmp_path):
    texts = [d.text for d in load_corpus(corpus)]
    tok = train_tokenizer(texts, vocab_size=300)
    assert tok.get_vocab_size() <= 300
    text = "def f(x):\n    return x  # ünïcode ✓\n"
    assert tok.decode(tok.encode(text).ids) == text
    marked = "<|fim_prefix|>def<|fim_suffix|>x<|fim_middle|> f(<|endoftext|>"
    ids = tok.encode(marked).ids
    for special in SPECIAL_TOKENS[:4]:
        assert ids.count(tok.token_to_id(special)) == 1
    # The saved files load through mlx-lm (as the engine does) without remote code.
    save_tokenizer(tok, tmp_path)
    wrapper = load_tokenizer(tmp_path)
    assert wrapper.eos_token_ids == {tok.token_to_id("<|endoftext|>")}
    assert wrapper.encode("<|fim_middle|>") == [tok.token_to_id("<|fim_middle|>")]
    chat = wrapper.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                       tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_fim_transform_is_prefix_suffix_middle(corpus):
    tok = train_tokenizer([d.text for d in load_corpus(corpus)], vocab_size=300)
    special = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    text = repetitive_source(7)
    prefix, middle, suffix = fim_split(text, random.Random(3))
    assert prefix + middle + suffix == text and middle
    # Editor-shaped cuts: the cursor at a token start, the middle mostly the rest of its line.
    cursors = token_starts(tok.encode(text), text)
    assert cursors[-1] == len(text) and set(cursors) < set(range(len(text) + 1))
    rng = random.Random(0)
    splits = [fim_split(text, rng, cursors) for _ in range(400)]
    assert all(p + m + s == text and len(p) in cursors for p, m, s in splits)
    rest_of_line = sum("\n" not in m and s[:1] in ("\n", "") for _, m, s in splits) / len(splits)
    several_lines = sum(m.count("\n") >= 1 and s[:1] in ("\n", "") for _, m, s in splits) / len(splits)
    assert 0.4 < rest_of_line < 0.65 and 0.15 < several_lines < 0.35
    ids = fim_ids(tok, prefix, middle, suffix)
    enc = lambda s: tok.encode(s).ids  # noqa: E731
    assert ids == ([special["<|fim_prefix|>"]] + enc(prefix) + [special["<|fim_suffix|>"]] + enc(suffix)
                   + [special["<|fim_middle|>"]] + enc(middle) + [special["<|endoftext|>"]])
    assert fim_ids(tok, prefix, middle, suffix, order="spm") == (
        [special["<|fim_prefix|>"], special["<|fim_suffix|>"]] + enc(suffix) + [special["<|fim_middle|>"]]
        + enc(prefix) + enc(middle) + [special["<|endoftext|>"]])
    # In the packed stream about half of the pieces are FIM samples, each in PSM order.
    texts = [repetitive_source(i) for i in range(40)]
    stream = build_stream(tok, texts, seq_len=32, fim_rate=0.5, seed=0).tolist()
    starts = [i for i, t in enumerate(stream) if t == special["<|fim_prefix|>"]]
    ends = stream.count(special["<|endoftext|>"])
    n_plain_docs = ends - len(starts)
    assert len(starts) > 20 and n_plain_docs > 0
    for i in starts:
        rest = stream[i:]
        s, m, e = (rest.index(special[n]) for n in ("<|fim_suffix|>", "<|fim_middle|>", "<|endoftext|>"))
        assert 0 < s < m < e
    # Deterministic for a seed; windows are resumable by position.
    assert build_stream(tok, texts, 32, 0.5, seed=0).tolist() == stream
    batches = Batches(np.asarray(stream), 32, 4, seed=1)
    assert batches.get(8).shape == (4, 33)
    assert (batches.get(8) == Batches(np.asarray(stream), 32, 4, seed=1).get(8)).all()


def test_fast_losses_match_mlx():
    from engine.training.model import cross_entropy, log_softmax

    logits = mx.random.normal((2, 5, 300), key=mx.random.key(0)) * 4
    targets = mx.random.randint(0, 300, (2, 5), key=mx.random.key(1))
    import mlx.nn as nn

    ours = lambda z: cross_entropy(z, targets)  # noqa: E731
    theirs = lambda z: nn.losses.cross_entropy(z, targets).mean()  # noqa: E731
    # means and log-sum-exps over 300 logits: one reordered float32 sum each
    assert_close(ours(logits), theirs(logits), DOT_ULPS, "loss")
    assert_close(mx.grad(ours)(logits), mx.grad(theirs)(logits), DOT_ULPS, "gradient")
    assert_close(log_softmax(logits), logits - mx.logsumexp(logits, axis=-1, keepdims=True), DOT_ULPS,
                 "log-softmax")



@pytest.mark.parametrize("native_softmax", [True, False])
def test_topk_cross_entropy_is_the_log_softmax_one(native_softmax, monkeypatch):
    from engine.training import model

    if not native_softmax:  # MLX's own ops, as on a GPU or without the built module
        monkeypatch.setattr("engine.sampling.native", lambda: None)
    logits = mx.random.normal((2, 5, 300), key=mx.random.key(0)) * 4
    top = mx.argpartition(mx.random.normal((2, 5, 300), key=mx.random.key(1)), -8, axis=-1)[..., -8:]
    p = mx.softmax(mx.random.normal((2, 5, 8), key=mx.random.key(2)), axis=-1) * 0.9  # mass left out
    weights = mx.random.normal((2, 5), key=mx.random.key(3))

    def reference(z, ids):
        logq = z - mx.logsumexp(z, axis=-1, keepdims=True)
        return -(p * mx.take_along_axis(logq, ids, axis=-1)).sum(axis=-1)

    ours = lambda z: (model.topk_cross_entropy(z, top, p) * weights).sum()  # noqa: E731
    theirs = lambda z: (reference(z, top) * weights).sum()  # noqa: E731
    # log-sum-exps over 300 logits and sums of 8 products: a few reordered float32 sums
    assert_close(model.topk_cross_entropy(logits, top, p), reference(logits, top), DOT_ULPS, "loss")
    assert_close(mx.grad(ours)(logits), mx.grad(theirs)(logits), DOT_ULPS, "gradient")
    # control: the mass on other ids is another loss, far outside the bound
    assert excess(model.topk_cross_entropy(logits, top, p), reference(logits, (top + 1) % 300), DOT_ULPS) > 1


def test_training_attention_matches_the_fused_kernel_values_and_gradients():
    from engine.training.model import unfused_attention

    q = mx.random.normal((2, 4, 9, 8), key=mx.random.key(2))
    k, v = (mx.random.normal((2, 2, 9, 8), key=mx.random.key(i)) for i in (3, 4))  # grouped KV heads
    fused = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask="causal")  # noqa: E731
    ours = lambda q, k, v: unfused_attention(q, k, v, None, 0.35, "causal")  # noqa: E731
    assert_close(ours(q, k, v), fused(q, k, v), DOT_ULPS, "attention")
    weights = mx.random.normal((2, 4, 9, 8), key=mx.random.key(5))
    grads = [mx.grad(lambda *a: (f(*a) * weights).sum(), argnums=(0, 1, 2))(q, k, v) for f in (ours, fused)]
    for a, b in zip(*grads):
        assert_close(a, b, DOT_ULPS, "gradients")
    with pytest.raises(ValueError):
        unfused_attention(q, k, v, None, 0.35, mx.zeros((9, 9)))  # only causal masks in training


def test_learning_rate_decays_fully_by_the_time_budget_or_the_last_step():
    from engine.training.trainer import LoopSettings, learning_rate

    by_steps = LoopSettings(steps=100, lr=1e-3, warmup=10)
    assert learning_rate(by_steps, 0, 0.0) == pytest.approx(1e-4)  # warmup from lr / warmup
    assert learning_rate(by_steps, 10, 0.0) == pytest.approx(1e-3)  # peak
    assert learning_rate(by_steps, 100, 0.0) == pytest.approx(1e-4)  # lr * min_lr_ratio at the end
    by_time = LoopSettings(steps=10_000, lr=1e-3, warmup=10, max_minutes=1.0)
    assert learning_rate(by_time, 20, 30.0) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half the budget: half way
    assert learning_rate(by_time, 20, 60.0) == pytest.approx(1e-4)  # the budget spent: fully decayed
    assert learning_rate(by_time, 20, 1.0) > learning_rate(by_time, 20, 50.0)

def test_loss_decreases_and_checkpoint_runs_mtp(trained):
    out, result = trained
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 60
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:5])
    for part in ("trunk", "head1", "head2"):
        assert result.history[-1][part] < result.history[0][part]
    report = inspect_checkpoint(out)
    assert (report.family, report.status, report.mtp_heads) == ("mimo", "supported", 2)
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and config["model_type"] == "mimo"
    header_dtypes = {v.dtype for v in mx.load(str(out / "model.safetensors")).values()}
    assert header_dtypes == {mx.bfloat16}
    eng = Engine.load(out)
    prompt = tuple(eng.tokenizer.encode("def add_3(x):\n"))
    gen = eng.open(GenerationRequest(prompt=prompt, sampler=SamplerSettings(temperature=0.0), mode="mtp",
                                     depth=2, max_tokens=24))
    cycles = []
    while not gen.finished:
        cycles.append(gen.step())
    assert len(gen.tokens) - len(prompt) == 24
    assert any(r.drafted == 2 for r in cycles)
    # The heads learned the repetitive corpus: most greedy drafts are accepted.
    acceptance = measure_acceptance(eng, ["def add_3(x):\n"], depth=2, n_tokens=32)
    print(f"acceptance per depth at temperature 0: {acceptance}")
    assert acceptance[0] > 0.5


def test_interrupt_leaves_a_checkpoint_and_resume_continues(corpus, tmp_path):
    settings = dict(corpus=str(corpus), steps=8, **{**TINY, "save_every": 3})
    straight = train_model(ModelSettings(out=str(tmp_path / "a"), **settings))

    def stop_at_5(step, entry):
        if step == 5:
            raise KeyboardInterrupt

    out = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        train_model(ModelSettings(out=str(out), **settings), callback=stop_at_5)
    state = json.loads((out / STATE_DIR / "state.json").read_text())
    assert state["step"] == 5 and state["data_position"] == 5 * TINY["batch"]
    assert inspect_checkpoint(out).status == "supported"
    Engine.load(out)  # usable as it stands

    resumed = resume_training(out)
    assert [h["step"] for h in resumed.history] == [6, 7, 8]
    expected = {h["step"]: h["loss"] for h in straight.history}
    # A resumed run repeats the same steps; only kernels' thread splits may reorder sums.
    for h in resumed.history:
        assert_close(h["loss"], expected[h["step"]], LONG_PATHS_ULPS, "loss")
    a = mx.load(str(tmp_path / "a" / STATE_DIR / "weights.safetensors"))
    b = mx.load(str(out / STATE_DIR / "weights.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert_close(a[key], b[key], LONG_PATHS_ULPS, "weights", where=key)


def test_time_budget_stops_with_a_checkpoint(corpus, tmp_path):
    out = tmp_path / "budget"
    result = train_model(ModelSettings(out=str(out), corpus=str(corpus), steps=50, max_minutes=0, **TINY))
    assert result.step == 1
    assert json.loads((out / STATE_DIR / "state.json").read_text())["step"] == 1
    assert inspect_checkpoint(out).status == "supported"


def test_spm_order_is_saved_and_kept_by_heads_training(corpus, tmp_path):
    from engine.prompts import fim_tokens

    out = tmp_path / "spm"
    train_model(ModelSettings(out=str(out), corpus=str(corpus), steps=50, max_minutes=0, fim_order="spm", **TINY))
    heads = tmp_path / "spm-heads"
    train_heads(HeadsSettings(model=str(out), out=str(heads), corpus=str(corpus), steps=1, replace_heads=True,
                              **HEADS_TINY))
    for folder in (out, heads):
        assert fim_tokens(Engine.load(folder).tokenizer).order == "spm"
        stream = np.load(folder / STATE_DIR / "tokens.npy").tolist()
        fim = fim_tokens(Engine.load(folder).tokenizer)
        starts = [i for i, t in enumerate(stream[:-1]) if t == fim.prefix]
        assert starts and all(stream[i + 1] == fim.suffix for i in starts)


def _greedy(eng: Engine, prompt: str | tuple[int, ...], n: int, mode: str = "ar") -> list[int]:
    ids = tuple(eng.tokenizer.encode(prompt)) if isinstance(prompt, str) else prompt
    gen = eng.open(GenerationRequest(prompt=ids, sampler=SamplerSettings(temperature=0.0), mode=mode,
                                     depth=2, max_tokens=n))
    while not gen.finished:
        gen.step()
    return gen.tokens[len(ids):]


def _assert_mtp_is_ar(eng: Engine, prompt: str, n: int) -> None:
    ids = list(eng.tokenizer.encode(prompt))
    assert_greedy_agree(eng.backend, ids, _greedy(eng, prompt, n, "ar"), _greedy(eng, prompt, n, "mtp"))


HEADS_TINY = dict(heads=2, seq_len=32, batch=4, lr=3e-3, save_every=1000, eval_windows=0, compile=False,
                  progress=False)
PROMPTS = ["def add_1(x):\n    return x + 1\n\n", "def add_7(x):\n", "def add_", "    return x + 4\n"]


def test_heads_only_on_a_mimo_trunk(corpus, tmp_path):
    src = write("mimo", tmp_path / "src", mtp_heads=0)
    assert inspect_checkpoint(src).status == "ar-only"
    out = tmp_path / "out"
    result = train_heads(HeadsSettings(model=str(src), out=str(out), corpus=str(corpus), steps=80, **HEADS_TINY))
    assert result.history[-1]["loss"] < 0.5 * result.history[0]["loss"]  # from the trunk's last block
    report = inspect_checkpoint(out)
    assert (report.family, report.status, report.mtp_heads) == ("mimo", "supported", 2)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    sidecar = load_file(str(out / "mtp.safetensors"))
    assert set(sidecar) == {
        k for k in load_file(str(write("mimo", tmp_path / "ref", mtp_heads=2) / "model.safetensors"))
        if k.startswith("model.mtp_layers.")
    } | {DRAFT_VOCAB_KEY}
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2

    eng = Engine.load(out)
    # the heads score the tokens they were trained on: the corpus's, a subset of the vocabulary
    draft_ids = sidecar[DRAFT_VOCAB_KEY].tolist()
    assert eng.backend.draft_vocab is not None and eng.backend.draft_vocab.ids.tolist() == draft_ids
    assert 0 < len(draft_ids) <= eng.backend.trunk.args.vocab_size and draft_ids == sorted(set(draft_ids))
    _assert_mtp_is_ar(eng, PROMPTS[1], 16)
    trained = measure_acceptance(eng, PROMPTS, depth=2, n_tokens=32)
    mx.random.seed(1)
    eng.backend.heads = [MTPLayer(eng.backend.trunk.args) for _ in eng.backend.heads]
    untrained = measure_acceptance(eng, PROMPTS, depth=2, n_tokens=32)
    print(f"acceptance per depth at temperature 0: trained {trained}, untrained {untrained}")
    assert trained[0] > untrained[0] + 0.05, (trained, untrained)


def test_heads_only_converts_qwen2_and_llama_trunks(corpus, tmp_path):
    src = write("mimo", tmp_path / "mimo", mtp_heads=0)
    config = json.loads((src / "config.json").read_text())
    del config["num_nextn_predict_layers"]

    qwen2 = tmp_path / "qwen2"
    qwen2.mkdir()
    for f in src.iterdir():
        (qwen2 / f.name).write_bytes(f.read_bytes())
    # Without rope_theta mlx-lm's Qwen2 uses 1e6 where its MiMo uses 1e4: the
    # converted config must spell out what the source was run with.
    qwen2_config = {k: v for k, v in config.items() if k != "rope_theta"}
    (qwen2 / "config.json").write_text(json.dumps({**qwen2_config, "model_type": "qwen2",
                                                   "architectures": ["Qwen2ForCausalLM"]}))
    llama = tmp_path / "llama"
    llama.mkdir()
    for f in src.iterdir():
        (llama / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith("_proj.bias")}, str(llama / "model.safetensors"))
    (llama / "config.json").write_text(json.dumps({**config, "model_type": "llama", "attention_bias": False,
                                                   "architectures": ["LlamaForCausalLM"]}))

    for trunk in (qwen2, llama):
        assert inspect_checkpoint(trunk).status == "ar-only"
        out = tmp_path / f"{trunk.name}-mtp"
        train_heads(HeadsSettings(model=str(trunk), out=str(out), corpus=str(corpus), steps=3, **HEADS_TINY))
        report = inspect_checkpoint(out)
        assert (report.family, report.status, report.mtp_heads) == ("mimo", "supported", 2), trunk.name
        assert (out / "model.safetensors").read_bytes() == (trunk / "model.safetensors").read_bytes()
        new_config = json.loads((out / "config.json").read_text())
        assert new_config["mtplxd_converted_from"] == trunk.name
        assert new_config["rope_theta"] == (1e6 if trunk is qwen2 else 1e4)
        # The converted trunk computes what the original computed. (Token ids:
        # transformers picks its own Qwen2 tokenizer class for model_type qwen2.)
        converted = Engine.load(out)
        ids = tuple(converted.tokenizer.encode(PROMPTS[0]))
        assert _greedy(converted, ids, 12) == _greedy(Engine.load(trunk), ids, 12)
    assert (tmp_path / "llama-mtp" / "model-zero-bias.safetensors").is_file()
    assert not (tmp_path / "qwen2-mtp" / "model-zero-bias.safetensors").exists()


def test_heads_only_refuses_a_checkpoint_with_heads(corpus, tmp_path):
    src = write("mimo", tmp_path / "src", mtp_heads=1)
    from engine.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="already has 1 MTP head.*--replace-heads"):
        train_heads(HeadsSettings(model=str(src), out=str(tmp_path / "out"), corpus=str(corpus), steps=1,
                                  **HEADS_TINY))


def test_replace_heads_distils_a_mimo_checkpoints_own_heads(corpus, tmp_path):
    src = write("mimo", tmp_path / "src", mtp_heads=2)
    out = tmp_path / "out"
    train_heads(HeadsSettings(model=str(src), out=str(out), corpus=str(corpus), steps=2, replace_heads=True,
                              **{**HEADS_TINY, "lr": 1e-9}))
    report = inspect_checkpoint(out)
    assert (report.family, report.status, report.mtp_heads) == ("mimo", "supported", 2)
    trunk = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith("model.mtp_layers.") for k in trunk)  # old heads gone from the trunk file
    original = load_file(str(src / "model.safetensors"))
    assert all(np.array_equal(v, original[k]) for k, v in trunk.items())
    heads = load_file(str(out / "mtp.safetensors"))
    old_heads = {k: v for k, v in original.items() if k.startswith("model.mtp_layers.")}
    # the distilled heads learnt against the corpus's draft vocabulary, which they ship with
    assert set(heads) == set(old_heads) | {DRAFT_VOCAB_KEY}
    del heads[DRAFT_VOCAB_KEY]
    # It started from the old heads: two Adam steps at a learning rate of 1e-9 move a weight
    # by about 2e-9, a few float32 epsilons of these weights' magnitude.
    for k, v in heads.items():
        assert_close(v.astype(np.float32), old_heads[k].astype(np.float32), FEW_OPS_ULPS, "heads", where=k)
    eng = Engine.load(out)
    _assert_mtp_is_ar(eng, PROMPTS[1], 12)


def test_continued_windows_are_the_trunks_own_greedy_text(tmp_path):
    from engine.training.trunk_cache import line_end_ids
    from engine.training.trunk_cache import continuation_prompts, continued_outputs, trunk_outputs

    eng = Engine.load(write("mimo", tmp_path / "src", mtp_heads=0))
    stream = np.array(eng.tokenizer.encode(repetitive_source(0)), dtype=np.int32)
    line_ends = line_end_ids(eng.tokenizer, stream)
    assert len(line_ends) and all(eng.tokenizer.decode([int(i)]).endswith("\n") for i in line_ends)
    prompts = continuation_prompts(stream, line_ends, 12, 3, seed=0)
    assert prompts.shape == (3, 12) and all(np.isin(prompts[:, -1], line_ends))
    vocab = eng.backend.trunk.args.vocab_size
    lm_rows = eng.backend.trunk.model.embed_tokens.weight.astype(mx.float32)  # every row: ids are token ids
    writer = MiMoBackend(eng.backend.trunk, [])  # as train_heads runs it: the engine's decode path
    out = continued_outputs(writer, lm_rows, prompts, new_tokens=10, top_k=vocab, batch=2)  # 2 + 1 rows
    assert out.tokens.shape == (3, 22) and out.hidden.shape[:2] == (3, 21)
    assert np.array_equal(np.array(out.tokens[:, :12]), prompts)
    for prompt, window in zip(prompts.tolist(), np.array(out.tokens).tolist()):
        assert_greedy_agree(eng.backend, prompt, _greedy(eng, tuple(prompt), 10), window[12:])
    # What generation kept is what one forward over the finished window computes. Both were
    # stored as float16, which rounds 2^13 float32 epsilons apart at most.
    again = trunk_outputs(eng.backend.trunk.model, lm_rows, np.array(out.tokens), top_k=vocab)
    f16 = 2 ** 13 + LONG_PATHS_ULPS
    got, want = np.array(out.hidden, dtype=np.float32), np.array(again.hidden, dtype=np.float32)
    assert_close(got, want, f16, "continued hidden")
    assert excess(got[:, 1:], want[:, :-1], f16, "continued hidden, shifted one position") > 1
    assert_close(np.array(out.top_logp, dtype=np.float32), np.array(again.top_logp, dtype=np.float32), f16,
                 "continued log-probabilities")


def test_cached_heads_loss_is_the_log_softmax_one(tmp_path):
    from mlx_lm.models import mimo

    from engine.training.trunk_cache import CachedHeads, TrunkOutputs

    trunk = Engine.load(write("mimo", tmp_path / "src", mtp_heads=0)).backend.trunk
    vocab, D, S, K = trunk.args.vocab_size, trunk.args.hidden_size, 12, 4
    embed = trunk.model.embed_tokens.weight.astype(mx.float32)
    mx.random.seed(0)
    heads = CachedHeads(mimo.ModelArgs.from_dict(vars(trunk.args)), 2, embed, embed)
    keys = mx.random.split(mx.random.key(4), 4)
    tokens = mx.random.randint(0, vocab, (3, S + 1), key=keys[0]).astype(mx.int32)
    hidden = mx.random.normal((3, S, D), key=keys[1]).astype(mx.float16)
    top_ids = mx.argpartition(mx.random.normal((3, S, vocab), key=keys[2]), -K, axis=-1)[..., -K:].astype(mx.int32)
    top_logp = mx.log(mx.softmax(mx.random.normal((3, S, K), key=keys[3]), axis=-1) * 0.8).astype(mx.float16)
    outputs = TrunkOutputs(tokens, hidden, top_ids, top_logp, mx.full(3, 7, mx.int32))

    def by_hand(targets):
        p = mx.exp(top_logp.astype(mx.float32))
        losses = []
        for k, skip, logits in heads.heads_logits(hidden.astype(mx.float32), tokens):
            n = logits.shape[1]
            logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = mx.take_along_axis(logq, targets[:, k + 1:k + 1 + n], axis=-1)
            losses.append(-(p[:, k + 1:k + 1 + n] * picked).sum(-1).mean())
        return mx.stack(losses)

    _, per_head = heads.loss(outputs, mx.arange(3))
    assert_close(per_head, by_hand(top_ids), DOT_ULPS, "per-head loss")
    assert excess(per_head, by_hand((top_ids + 1) % vocab), DOT_ULPS) > 1  # control: other targets
    # the agreement counts the trunk's own tokens (from `first` on) only
    agree = heads.agreement(outputs, mx.arange(3))
    for k, skip, logits in heads.heads_logits(hidden.astype(mx.float32), tokens, 7):
        assert skip == 7 - k - 2 and logits.shape[1] == S - k - 1 - skip
        greedy = mx.take_along_axis(top_ids, top_logp.argmax(axis=-1)[..., None], axis=-1)[..., 0]
        want = (logits.argmax(axis=-1) == greedy[:, 7 - 1:7 - 1 + logits.shape[1]]).astype(mx.float32).mean()
        assert agree[k] == pytest.approx(want.item())


def test_heads_time_budget_counts_the_trunks_first_pass(corpus, tmp_path):
    src = write("mimo", tmp_path / "src", mtp_heads=0)
    settings = HeadsSettings(model=str(src), out=str(tmp_path / "out"), corpus=str(corpus), windows=0, continued=8,
                             steps=50, max_minutes=1e-5, **{**HEADS_TINY, "warmup": 0})
    result = train_heads(settings)
    # 0.6 ms went to loading and the trunk's continuations: one step, at the decayed rate
    assert result.step == 1
    assert result.history[0]["lr"] == pytest.approx(settings.lr * 0.1)


def test_new_heads_start_as_the_trunks_last_block(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from engine.training.heads import start_from_last_block

    trunk = Engine.load(write("mimo", tmp_path / "src", mtp_heads=0)).backend.trunk
    args = trunk.args
    plain = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=args.hidden_size, num_hidden_layers=2,
                                        intermediate_size=args.intermediate_size,
                                        num_attention_heads=args.num_attention_heads,
                                        num_key_value_heads=args.num_key_value_heads, rms_norm_eps=args.rms_norm_eps,
                                        vocab_size=args.vocab_size, tie_word_embeddings=True))
    for source in (trunk, plain):  # MiMo's attention has q/k/v biases, Llama's none
        mx.random.seed(0)
        layer = MTPLayer(args)
        start_from_last_block(layer, source)
        want = dict(tree_flatten(source.model.layers[-1].parameters()))
        got = dict(tree_flatten(layer.parameters()))
        for name, value in got.items():
            if name in want:
                assert mx.array_equal(value, want[name].astype(mx.float32)), name
            elif name.endswith("_proj.bias"):
                assert not mx.any(value).item(), name  # the source has none
        assert mx.array_equal(layer.final_layernorm.weight, source.model.norm.weight.astype(mx.float32))
        # the fusion adds its two normed inputs
        h, e = mx.random.normal((1, 3, args.hidden_size)), mx.random.normal((1, 3, args.hidden_size))
        assert_close(layer.fuse(h, e), layer.hidden_layernorm(h) + layer.token_layernorm(e), FEW_OPS_ULPS, "fusion")
    fresh = MTPLayer(args)  # control: a new layer's own weights are not the trunk's
    assert not mx.array_equal(fresh.mlp.up_proj.weight, layer.mlp.up_proj.weight)


def test_heads_trained_on_continued_windows(corpus, tmp_path):
    src = write("mimo", tmp_path / "src", mtp_heads=0)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="nothing to train on"):
        train_heads(HeadsSettings(model=str(src), out=str(tmp_path / "none"), corpus=str(corpus), windows=0,
                                  steps=1, **HEADS_TINY))
    result = train_heads(HeadsSettings(model=str(src), out=str(out), corpus=str(corpus), windows=0, continued=24,
                                       steps=80, **HEADS_TINY))
    assert result.history[-1]["loss"] < 0.5 * result.history[0]["loss"]  # from the trunk's last block
    eng = Engine.load(out)
    _assert_mtp_is_ar(eng, PROMPTS[1], 16)
    trained = measure_acceptance(eng, PROMPTS, depth=2, n_tokens=32)
    mx.random.seed(1)
    eng.backend.heads = [MTPLayer(eng.backend.trunk.args) for _ in eng.backend.heads]
    untrained = measure_acceptance(eng, PROMPTS, depth=2, n_tokens=32)
    assert trained[0] > untrained[0] + 0.05, (trained, untrained)


def test_cli_train_and_resume(corpus, tmp_path, capsys):
    from mtplxd.cli import main

    out = tmp_path / "cli"
    args = ["train", "--out", str(out), "--corpus", str(corpus), "--vocab", "300", "--hidden", "32",
            "--layers", "2", "--heads", "1", "--seq-len", "32", "--batch", "2", "--steps", "3", "--no-compile"]
    assert main(args) == 0
    assert inspect_checkpoint(out).mtp_heads == 1
    assert main(args) == 1  # an existing run is never overwritten
    assert "--resume" in capsys.readouterr().err
    assert main(["train", "--out", str(out), "--resume", "--steps", "5", "--no-compile"]) == 0
    assert json.loads((out / STATE_DIR / "state.json").read_text())["step"] == 5
