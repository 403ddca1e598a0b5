"""The real model: SmolLM2-135M-Instruct from its GGUF file (`make real-model`).

- The import's logits equal an independent reference built from the same file: the
  `gguf` package's own dequantization, put into Hugging Face names and row order by the
  code here, run through mlx-lm's Llama model in float32. A reference that keeps
  llama.cpp's Q/K row order is a negative control that must fail.
- The imported tokenizer's ids equal a plain-Python byte-level BPE that follows
  llama.cpp's tokenizer (special tokens whole, the `smollm` pre-tokenizer's splits in
  turn, merges by rank) on texts with special tokens, code, digits and Unicode.
- Answers: a greedy chat answer is right, and MTP with the shipped heads gives AR's
  tokens.

Marked real_model: `make test-real` (CI) runs them; `make test` keeps the tiny fixtures.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests.engine_helpers import assert_greedy_agree
from tests.floats import DOT_ULPS, PATHS_ULPS, assert_close, excess

pytestmark = pytest.mark.real_model

GGUF = Path(__file__).resolve().parent.parent / "build" / "real-model" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
TEXTS = [
    "<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "x = 1234567890 + 3.14159e-10  # digits split one by one\n\tprint(f'{x:>10}')",
    "Grüße, naïve café! 日本語のテキスト 🙂 — “quotes” and 'it's' they'll we've",
    "   leading spaces\n\n\n  and   runs\r\nof\twhitespace   ",
    "<|endoftext|><fim_prefix>not a fim token<|im_end|><|im_end|>",
]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    if not GGUF.is_file():
        pytest.fail(f"{GGUF} is missing: run `make real-model` (make install does)")
    return GGUF


@pytest.fixture(scope="module")
def imported(gguf_file, tmp_path_factory) -> Path:
    from engine.gguf_import import import_gguf

    out = tmp_path_factory.mktemp("real") / "smollm2"
    import_gguf(gguf_file, out, heads=False)
    return out


@pytest.fixture(scope="module")
def engine_(imported):
    from engine.engine import Engine

    return Engine.load(imported)


# -- the reference, from the gguf package --------------------------------------------------

_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _hf_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores each head's rows as (0, half, 1, half+1, ...): even rows are the
    first rotary half, odd rows the second."""
    per_head = w.reshape(heads, -1, w.shape[-1])
    return np.concatenate([per_head[:, 0::2], per_head[:, 1::2]], axis=1).reshape(w.shape)


def reference_model(path: Path, keep_llama_cpp_rows: bool = False):
    import gguf
    from mlx_lm.models import llama

    reader = gguf.GGUFReader(str(path))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    heads, kv_heads = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    weights = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(reversed([int(n) for n in t.shape])))
        stem = t.name.removesuffix(".weight")
        if stem == "token_embd":
            name = "model.embed_tokens"
        elif stem == "output_norm":
            name = "model.norm"
        else:
            _, layer, part = stem.split(".")
            name = f"model.layers.{layer}.{_NAMES[part]}"
            if part in ("attn_q", "attn_k") and not keep_llama_cpp_rows:
                w = _hf_rows(w, heads if part == "attn_q" else kv_heads)
        weights[f"{name}.weight"] = mx.array(w)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=field("llama.embedding_length"),
        num_hidden_layers=field("llama.block_count"), intermediate_size=field("llama.feed_forward_length"),
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        rms_norm_eps=field("llama.attention.layer_norm_rms_epsilon"), vocab_size=weights["model.embed_tokens.weight"].shape[0],
        rope_theta=field("llama.rope.freq_base"), tie_word_embeddings=True,
    )
    model = llama.Model(args)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def test_imported_logits_equal_the_gguf_reference(gguf_file, engine_):
    ids = engine_.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    x = mx.array([ids])
    got = engine_.backend.trunk(x)
    want = reference_model(gguf_file)(x)
    assert_close(got, want, PATHS_ULPS, what="SmolLM2 logits, import vs gguf reference")
    assert (np.array(got.argmax(-1)) == np.array(want.argmax(-1))).all()
    # llama.cpp's own way: its row order with interleaved rope, the same model again.
    llama_cpp = reference_model(gguf_file, keep_llama_cpp_rows=True)
    assert excess(got, llama_cpp(x), PATHS_ULPS, what="! Q/K rows not put back") > 100  # the negative control
    llama_cpp.args.rope_traditional = True
    interleaved = type(llama_cpp)(llama_cpp.args)
    interleaved.update(llama_cpp.parameters())
    assert_close(got, interleaved(x), DOT_ULPS, what="SmolLM2 logits, import vs interleaved rope")


# -- the tokenizer ------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (what byte-level vocabularies spell)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


class ReferenceBPE:
    """llama.cpp's byte-level BPE, in plain Python: control tokens are matched whole first,
    each pre-tokenizer expression splits every piece in turn (matches and the text between
    them both kept), then each piece's bytes merge pair by pair, lowest rank first."""

    def __init__(self, metadata: dict, expressions: tuple[str, ...]):
        import regex

        tokens = metadata["tokenizer.ggml.tokens"]
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(metadata["tokenizer.ggml.merges"])}
        control = [t for t, kind in zip(tokens, metadata["tokenizer.ggml.token_type"]) if kind == 3]
        self.special = regex.compile("|".join(regex.escape(t) for t in sorted(control, key=len, reverse=True))
                                     or r"(?!)")
        self.expressions = [regex.compile(e) for e in expressions]
        self.alphabet = _byte_alphabet()

    def encode(self, text: str) -> list[int]:
        out, start = [], 0
        for m in self.special.finditer(text):
            out += self._ordinary(text[start:m.start()])
            out.append(self.ids[m.group()])
            start = m.end()
        return out + self._ordinary(text[start:])

    def _ordinary(self, text: str) -> list[int]:
        pieces = [text] if text else []
        for expression in self.expressions:
            pieces = [part for piece in pieces for part in self._split(expression, piece)]
        return [self.ids[symbol] for piece in pieces for symbol in self._merge(piece)]

    @staticmethod
    def _split(expression, piece: str) -> list[str]:
        parts, start = [], 0
        for m in expression.finditer(piece):
            if m.start() > start:
                parts.append(piece[start:m.start()])
            parts.append(m.group())
            start = m.end()
        return parts + ([piece[start:]] if start < len(piece) else [])

    def _merge(self, piece: str) -> list[str]:
        symbols = [self.alphabet[b] for b in piece.encode("utf-8")]
        while len(symbols) > 1:
            pairs = [(self.ranks.get(pair, float("inf")), i) for i, pair in enumerate(zip(symbols, symbols[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        return symbols


def test_tokenizer_ids_equal_llama_cpps_bpe(gguf_file, engine_):
    from engine.gguf_import import read_gguf
    from engine.gguf_tokenizer import PRE_TOKENIZER_SPLITS

    plan = read_gguf(gguf_file)
    reference = ReferenceBPE(plan.metadata, PRE_TOKENIZER_SPLITS[plan.metadata["tokenizer.ggml.pre"]])
    for text in TEXTS:
        got = engine_.tokenizer.encode(text, add_special_tokens=False)
        assert got == reference.encode(text), text
        assert engine_.tokenizer.decode(got) == text
    # the chat markers stay single tokens, and digits are one token each
    assert engine_.tokenizer.encode("<|im_start|>", add_special_tokens=False) == [reference.ids["<|im_start|>"]]
    assert len(engine_.tokenizer.encode("2024", add_special_tokens=False)) == 4


def test_tokenizer_controls_a_wrong_split_or_lost_control_tokens_are_caught(gguf_file, engine_):
    """The comparison would notice another family's splits, or chat markers cut in pieces."""
    from engine.gguf_import import read_gguf
    from engine.gguf_tokenizer import PRE_TOKENIZER_SPLITS

    metadata = read_gguf(gguf_file).metadata
    ours = [engine_.tokenizer.encode(text, add_special_tokens=False) for text in TEXTS]
    llama3 = ReferenceBPE(metadata, PRE_TOKENIZER_SPLITS["llama-bpe"])
    assert any(o != llama3.encode(text) for o, text in zip(ours, TEXTS))
    no_control = ReferenceBPE({**metadata, "tokenizer.ggml.token_type": [1] * len(metadata["tokenizer.ggml.tokens"])},
                              PRE_TOKENIZER_SPLITS["smollm"])
    assert ours[0] != no_control.encode(TEXTS[0])


# -- answers -------------------------------------------------------------------------------


def greedy(engine_, messages, mode: str = "ar", depth: int = 2, max_tokens: int = 40) -> list[int]:
    from engine.generation import GenerationRequest
    from engine.sampler_settings import SamplerSettings

    ids = engine_.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    gen = engine_.open(GenerationRequest(prompt=tuple(ids), mode=mode, depth=depth, max_tokens=max_tokens,
                                         sampler=SamplerSettings(temperature=0.0),
                                         stop_token_ids=frozenset(engine_.tokenizer.eos_token_ids)))
    tokens = []
    while not gen.finished:
        tokens += gen.step().tokens
    gen.close()
    return tokens


@pytest.mark.parametrize("question, expected", [
    ("What is 2+2?", "4"),
    ("Write a Python function that returns the n-th Fibonacci number.", "def "),
])
def test_a_chat_answer_is_right(engine_, question, expected):
    answer = engine_.tokenizer.decode(greedy(engine_, [{"role": "user", "content": question}]))
    assert expected in answer, answer


def test_the_default_model_decodes_with_its_shipped_heads(gguf_file, tmp_path):
    """The import attaches the shipped heads; greedy MTP equals greedy AR token for token."""
    from engine.engine import Engine
    from engine.gguf_import import import_gguf

    result = import_gguf(gguf_file, tmp_path / "with-heads")
    assert result.mtp_heads == 2 and result.family == "mimo"
    config = json.loads((tmp_path / "with-heads" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2
    engine_ = Engine.load(result.out)
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    prompt = engine_.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ar = greedy(engine_, messages, "ar", max_tokens=48)
    for depth in (1, 2, 3):
        assert_greedy_agree(engine_.backend, prompt, ar, greedy(engine_, messages, "mtp", depth, max_tokens=48))
