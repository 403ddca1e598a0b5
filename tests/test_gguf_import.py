"""engine/gguf_import.py on tiny GGUF files written as llama.cpp's converter writes them
(tests/gguf_fixtures.py), one per architecture.

The reference for each file is a Hugging Face folder holding what the file's bytes mean
(the gguf package's dequantization, in Hugging Face layout); K-quant tensors, which the
import requantizes, hold MLX's requantization of those values at the import's bits. An
import that reads every tensor right, undoes the converter's changes and writes the
right config gives the reference's logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import engine  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

import engine.gguf_import as gguf_import
from engine.engine import Engine
from engine.gguf_import import GGUFError, GGUFPlan, TensorEntry, gguf_config, import_gguf, read_gguf
from tests.engine_helpers import greedy, run
from tests.floats import EPS32, PATHS_ULPS, assert_close, excess
from tests.gguf_fixtures import (
    K_QUANTS, REQUANTIZED, SPECIALS, TYPES, TinyModel, Written, requantized, tiny_model, write_gguf, write_reference,
)

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
BITS, GROUP = 4, 64  # what the import requantizes K-quants to
FLOAT16_ULPS = 2**-11 / EPS32  # half a float16 epsilon (rounding to float16), in float32 epsilons
PROMPT = [5, 77, 140, 9, 230, 31, 64, 200, 17, 101, 250, 3]  # longer than gemma3's window of 6


@dataclass(frozen=True)
class Case:
    model: TinyModel
    gguf: Path
    written: Written


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for seed, arch in enumerate(ARCHS):
        model = tiny_model(arch, seed)
        path = root / f"{arch}.gguf"
        out[arch] = Case(model, path, write_gguf(path, model, TYPES[arch]))
    return out


@pytest.fixture(scope="module")
def engines(cases, tmp_path_factory) -> dict[str, tuple[Engine, Engine]]:
    """arch -> (the imported model, its reference), both as the engine loads them."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for arch, case in cases.items():
        import_gguf(case.gguf, root / f"{arch}-imported", BITS, GROUP)
        reference = write_reference(root / f"{arch}-reference", case.model, _expected(case.written))
        out[arch] = (Engine.load(root / f"{arch}-imported"), Engine.load(reference))
    return out


def _expected(written: Written) -> dict[str, np.ndarray]:
    """The weights an import at BITS / GROUP must give: K-quants go through MLX's affine
    quantization (they have no MLX twin); every other type is kept exactly."""
    return {name: requantized(w, BITS, GROUP) if written.types[name] in REQUANTIZED else w
            for name, w in written.weights.items()}


def _logits(engine_: Engine, prompt: list[int] = PROMPT) -> np.ndarray:
    return np.array(engine_.backend.trunk(mx.array([prompt])))


# -- the numbers -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_import_gives_the_reference_logits_and_greedy_tokens(engines, arch):
    """Same weights, same model class: float32 logits equal up to rounding (the quantized
    layers are unpacked by MLX here and by numpy for the reference), and greedy
    generation picks the same tokens."""
    imported, reference = engines[arch]
    assert_close(_logits(imported), _logits(reference), ulps=PATHS_ULPS, what=f"{arch} logits")
    got, _, _ = run(imported, PROMPT, mode="ar", sampler=greedy(), max_tokens=12)
    want, _, _ = run(reference, PROMPT, mode="ar", sampler=greedy(), max_tokens=12)
    assert got == want and len(got) == 12


def test_llama_without_the_rope_unpermute_does_not_match(cases, engines, tmp_path, monkeypatch):
    """Negative control: Q/K rows left in llama.cpp's order change the logits far past the bound."""
    monkeypatch.setattr(gguf_import, "unpermute_rows", lambda w, n_heads: w)
    import_gguf(cases["llama"].gguf, tmp_path / "llama", BITS, GROUP)
    _, reference = engines["llama"]
    far = excess(_logits(Engine.load(tmp_path / "llama")), _logits(reference), PATHS_ULPS, "llama Q/K permuted")
    assert far > 1


def test_gemma3_without_the_norm_offset_does_not_match(cases, engines, tmp_path, monkeypatch):
    """Negative control: Gemma norms kept as llama.cpp's `1 + w` (mlx-lm adds the 1 again)."""
    monkeypatch.setattr(gguf_import, "_fix_layout", lambda plan, t, path, arrays: arrays)
    import_gguf(cases["gemma3"].gguf, tmp_path / "gemma3", BITS, GROUP)
    _, reference = engines["gemma3"]
    far = excess(_logits(Engine.load(tmp_path / "gemma3")), _logits(reference), PATHS_ULPS, "gemma3 norms + 1")
    assert far > 1


def test_the_files_hold_every_supported_type(cases):
    """The fixtures cover each type the import accepts, and the reader reports them as written."""
    written = set()
    for case in cases.values():
        kinds = set(case.written.types.values())
        assert set(read_gguf(case.gguf).types) == kinds
        written |= kinds
    assert written == set(gguf_import.KEPT_TYPES + gguf_import.REQUANTIZED_TYPES)


@pytest.mark.parametrize("bits", [4, 8])
def test_k_quants_requantized_within_one_step(cases, tmp_path, bits):
    """Each K-quant weight, requantized at `bits` (group 64), is within one quantization
    step of its group ((max - min) / (2^bits - 1)) of the gguf package's dequantization:
    MLX rounds to the nearest of 2^bits levels spanning the group."""
    for arch in ("llama", "qwen2", "qwen3"):  # Q4_K, Q5_K, Q6_K
        case = cases[arch]
        out = import_gguf(case.gguf, tmp_path / arch, bits, GROUP).out
        stored = mx.load(str(out / "model.safetensors"))
        quantization = json.loads((out / "config.json").read_text())["quantization"]
        for name, kind in case.written.types.items():
            if kind not in K_QUANTS:
                continue
            path = name.removesuffix(".weight")
            assert quantization.get(path, quantization)["bits"] == bits, f"{arch} {path}"
            got = np.array(mx.dequantize(stored[name], stored[f"{path}.scales"], stored[f"{path}.biases"],
                                         group_size=GROUP, bits=bits))
            want = case.written.weights[name].reshape(-1, GROUP)
            step = (want.max(axis=1) - want.min(axis=1)) / (2**bits - 1)
            error = np.abs(got.reshape(-1, GROUP) - want).max(axis=1)
            assert (error <= step).all(), f"{arch} {kind} {name}: {(error / step).max():.2f} steps off"


def test_bits_none_unpacks_to_float16(cases, tmp_path):
    """bits=None: no quantization in the config, every quantized type stored as float16
    equal to its dequantization rounded to float16 (within half a float16 epsilon of the
    magnitude); F32, F16 and BF16 keep their dtype."""
    case = cases["qwen2"]  # Q8_0, Q4_0, Q4_1, Q5_K, F32, F16, BF16
    out = import_gguf(case.gguf, tmp_path / "unpacked", None, GROUP).out
    assert "quantization" not in json.loads((out / "config.json").read_text())
    stored = mx.load(str(out / "model.safetensors"))
    assert set(stored) == set(case.written.weights)
    dtypes = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
    for name, kind in case.written.types.items():
        assert stored[name].dtype == dtypes.get(kind, mx.float16), f"{name} ({kind})"
        assert_close(stored[name].astype(mx.float32), case.written.weights[name], ulps=FLOAT16_ULPS,
                     what="float16 unpacking", where=f"{name} ({kind})")


# -- the tokenizer -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_from_metadata(cases, engines, arch):
    """Plain words encode as the trained tokenizer does (every pre-tokenizer splits them
    alike), control tokens stay single, the chat template comes along."""
    imported, _ = engines[arch]
    vocab = cases[arch].model.vocab
    text = "hello world the cat sat on the mat"
    assert imported.tokenizer.encode(text) == vocab.fast.encode(text)
    assert imported.tokenizer.decode(imported.tokenizer.encode(text)) == text
    chat = imported.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                                  add_generation_prompt=True, tokenize=True)
    assert chat[0] == vocab.id("<|im_start|>") and chat.count(vocab.id("<|im_end|>")) == 1
    assert imported.tokenizer.eos_token_id == vocab.id(SPECIALS[2])


# -- what `mtplxd inspect` says ----------------------------------------------------------


def test_describe_names_each_types_fate(cases):
    fates = {"F32": "kept", "F16": "kept", "BF16": "kept", "Q8_0": "kept as MLX 8-bit (group 32)",
             "Q4_0": "kept as MLX 4-bit (group 32)", "Q4_1": "kept as MLX 4-bit (group 32)",
             **{k: "dequantized, requantized to MLX 4-bit (group 64)" for k in REQUANTIZED}}
    lines = {arch: read_gguf(case.gguf).describe(4, 64) for arch, case in cases.items()}
    for arch, case in cases.items():
        for kind in set(case.written.types.values()):
            assert any(line.endswith(f"{kind} tensor(s): {fates[kind]}") for line in lines[arch]), (arch, kind)
        assert any("rope permutation undone" in line for line in lines[arch]) == (arch == "llama")
    unpacked = read_gguf(cases["llama"].gguf).describe(None, 64)
    assert any(line.endswith("Q4_K tensor(s): unpacked to float16") for line in unpacked)


def test_gemma3_27b_scales_queries_by_hidden_over_heads():
    """llama.cpp's rule: 1/sqrt(hidden / heads) for the 27B (62 layers), else 1/sqrt(head_dim)."""
    def scalar(layers: int) -> int:
        metadata = {"general.architecture": "gemma3", "gemma3.block_count": layers,
                    "gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32,
                    "gemma3.attention.key_length": 128, "gemma3.feed_forward_length": 21504}
        embedding = TensorEntry("token_embd.weight", "Q4_K", (262208, 5376))
        plan = GGUFPlan(Path("gemma-3-27b.gguf"), "gemma3", metadata, (embedding,))
        return gguf_config(plan)["query_pre_attn_scalar"]

    assert scalar(62) == 168
    assert scalar(48) == 128


# -- bad input ---------------------------------------------------------------------------


def _cut_in_metadata(data: bytes) -> bytes:
    return data[:data.index(b"tokenizer.ggml.merges") + 40]


BAD_FILES = {
    # name: (how the file is made from the llama model, words the one-line error must hold)
    "truncated in the tensor data": ({"edit": lambda data: data[:-100]}, "truncated or corrupt"),
    "truncated in the metadata": ({"edit": _cut_in_metadata}, "truncated or corrupt"),
    "wrong magic number": ({"edit": lambda data: b"GGML" + data[4:]}, "wrong magic number"),
    "unknown architecture": ({"metadata": {"general.architecture": "mamba"}}, "'mamba' is not supported"),
    "unsupported tensor type": ({"types": {"ffn_up": "Q8_1"}}, "Q8_1 are not supported"),
    "shape against the metadata": ({"metadata": {"llama.feed_forward_length": 128}}, "but the metadata describes"),
    "missing block": ({"drop": ("blk.1.",)}, "the file has blocks 0-0, the metadata says 2"),
}


@pytest.mark.parametrize("bad", sorted(BAD_FILES))
def test_bad_file_is_refused_in_one_line_leaving_nothing(cases, tmp_path, bad):
    how, words = BAD_FILES[bad]
    model = cases["llama"].model
    path = tmp_path / "bad.gguf"
    write_gguf(path, model, {**TYPES["llama"], **how.get("types", {})}, how.get("metadata"), how.get("drop", ()))
    if "edit" in how:
        path.write_bytes(how["edit"](path.read_bytes()))
    parent = tmp_path / "models"
    parent.mkdir()
    with pytest.raises(GGUFError) as e:
        import_gguf(path, parent / "imported", BITS, GROUP)
    message = str(e.value)
    assert words in message and "\n" not in message, message
    assert list(parent.iterdir()) == []

