"""Chat and fill-in-the-middle prompts from the tokenizer's own templates and tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import engine  # noqa: F401  (BLAS before mlx)
from engine.engine import load_tokenizer
from engine.prompts import (
    FimTokens,
    chat_prompt_ids,
    completion_prompt_ids,
    fim_prompt_ids,
    fim_tokens,
    heal_last_token,
    healed_fim_prompt_ids,
    message_text,
    normalize_messages,
    tokens_starting_with,
)
from tests.checkpoints.common import write_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    """The same tokenizer with its chat template and FIM tokens removed."""
    folder = tmp_path_factory.mktemp("plain")
    write_tokenizer(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    _drop_fim_tokens(folder / "tokenizer.json")
    return load_tokenizer(folder)


def _drop_fim_tokens(path: Path) -> None:
    data = json.loads(path.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if "fim" not in t["content"]]
    vocab = data["model"]["vocab"]
    for name in [n for n in vocab if "fim" in n]:
        del vocab[name]
    path.write_text(json.dumps(data))


def test_chat_uses_the_tokenizers_template(tokenizer):
    ids = chat_prompt_ids(tokenizer, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    text = tokenizer.decode(ids)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_joins_text_parts_and_renames_developer(tokenizer):
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    as_parts = chat_prompt_ids(tokenizer, [{"role": "developer", "content": "x"}, {"role": "user", "content": parts}])
    as_string = chat_prompt_ids(tokenizer, [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])
    assert as_parts == as_string


def test_assistant_turn_without_content_is_empty(tokenizer):
    assert message_text(None) == ""
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}])
    assert "assistant\n<|im_end|>" in tokenizer.decode(ids)


@pytest.mark.parametrize(
    "messages, needle",
    [
        ([], "non-empty"),
        ("hi", "non-empty"),
        (["hi"], "messages[0] must be an object"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "string or a list"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "'image_url'"),
        ([{"role": "user", "content": [{"type": "text"}]}], "string `text`"),
    ],
)
def test_bad_messages_are_value_errors(messages, needle):
    with pytest.raises(ValueError) as info:
        normalize_messages(messages)
    assert needle in str(info.value)


def test_model_without_chat_template_is_a_clear_error(plain_tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt_ids(plain_tokenizer, [{"role": "user", "content": "hi"}])


def test_fim_is_prefix_suffix_middle_with_the_tokenizers_tokens(tokenizer):
    fim = fim_tokens(tokenizer)
    vocab = tokenizer.get_added_vocab()
    assert fim == FimTokens(vocab["<|fim_prefix|>"], vocab["<|fim_suffix|>"], vocab["<|fim_middle|>"])
    ids = fim_prompt_ids(tokenizer, "def f(", "):\n")
    assert tokenizer.decode(ids) == "<|fim_prefix|>def f(<|fim_suffix|>):\n<|fim_middle|>"
    assert ids[0] == fim.prefix and ids[-1] == fim.middle


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    """The same tokenizer, from a checkpoint trained suffix-prefix-middle."""
    folder = tmp_path_factory.mktemp("spm")
    write_tokenizer(folder)
    config_path = folder / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "fim_order": "spm"}))
    return load_tokenizer(folder)


def test_fim_order_comes_from_the_tokenizer_config(tokenizer, spm_tokenizer):
    """SPM: the middle continues the prefix right before it, so healing and the
    prefix's tokens sit last."""
    assert fim_tokens(tokenizer).order == "psm" and fim_tokens(spm_tokenizer).order == "spm"
    ids = fim_prompt_ids(spm_tokenizer, "def f(", "):\n")
    assert spm_tokenizer.decode(ids) == "<|fim_prefix|><|fim_suffix|>):\n<|fim_middle|>def f("
    healed, heal = healed_fim_prompt_ids(spm_tokenizer, "def f(", "):\n")
    assert healed == ids[: len(ids) - 1] and spm_tokenizer.decode([ids[-1]]) == heal.text == "("
    psm, _ = healed_fim_prompt_ids(tokenizer, "def f(", "):\n")
    assert sorted(psm) == sorted(healed) and psm != healed


def test_fim_text_that_looks_like_a_special_token_stays_text(tokenizer):
    """Pieces are encoded apart, so the only FIM ids are the three we place."""
    fim = fim_tokens(tokenizer)
    ids = fim_prompt_ids(tokenizer, "a", "b")
    assert [i for i in ids if i in (fim.prefix, fim.suffix, fim.middle)] == [fim.prefix, fim.suffix, fim.middle]
    assert fim_prompt_ids(tokenizer, "", "") == [fim.prefix, fim.suffix, fim.middle]


def test_tokenizer_without_fim_tokens_is_a_clear_error(plain_tokenizer):
    with pytest.raises(ValueError, match="fill-in-the-middle"):
        fim_prompt_ids(plain_tokenizer, "a", "b")


class _CodeLlamaLike:
    """Code Llama keeps <PRE>/<SUF>/<MID> in the main vocabulary and adds a BOS."""

    bos_token_id = 1
    _vocab = {"<s>": 1, "<PRE>": 10, "<SUF>": 11, "<MID>": 12, "a": 20, "b": 21}

    def get_added_vocab(self):
        return {}

    def get_vocab(self):
        return dict(self._vocab)

    def encode(self, text, add_special_tokens=True):
        ids = [self._vocab[c] for c in text]
        return [self.bos_token_id, *ids] if add_special_tokens else ids


def test_code_llama_style_fim_with_bos():
    assert fim_prompt_ids(_CodeLlamaLike(), "a", "b") == [1, 10, 20, 11, 21, 12]


def test_completion_prompt_is_plain_text(tokenizer):
    assert tokenizer.decode(completion_prompt_ids(tokenizer, "x = 1")) == "x = 1"


# -- token healing ------------------------------------------------------------------

EMBEDDED = Path(engine.__file__).parent / "assets"


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """The embedded model's byte-level BPE, where healing matters."""
    return load_tokenizer(EMBEDDED)


def test_healing_drops_the_last_token_and_allows_every_token_that_extends_it(bpe_tokenizer):
    tok = bpe_tokenizer
    special = set(tok.all_special_ids)
    texts = {i: tok.decode([i]) for i in range(len(tok.vocab)) if i not in special}
    for prompt, dropped in (("x = 1\ndef ", " "), ("    pri", " pri"), ("if x:\n", None)):
        ids = list(tok.encode(prompt, add_special_tokens=False))
        rest, heal = heal_last_token(tok, ids)
        assert rest == ids[:-1] and tok.decode(rest) + heal.text == prompt
        if dropped is not None:
            assert heal.text == dropped
        assert heal.first_tokens == {i for i, t in texts.items() if t.startswith(heal.text)}
    assert {texts[i] for i in tokens_starting_with(tok, "pri")} == {"pri", "print"}


def test_nothing_to_heal(bpe_tokenizer):
    tok = bpe_tokenizer
    assert heal_last_token(tok, []) == ([], None)
    accented = list(tok.encode('name = "é', add_special_tokens=False))  # é: two byte tokens here
    assert tok.decode(accented[-1:]) == "\ufffd"
    assert heal_last_token(tok, accented) == (accented, None)  # a piece of a character stays
    fim = fim_tokens(tok)
    assert heal_last_token(tok, [5, fim.middle]) == ([5, fim.middle], None)  # a special token stays


def test_fim_prompt_with_its_prefix_healed(bpe_tokenizer):
    tok = bpe_tokenizer
    prefix_ids = list(tok.encode("class A:\n    def ", add_special_tokens=False))
    suffix_ids = list(tok.encode("\n", add_special_tokens=False))
    fim = fim_tokens(tok)
    assert fim_prompt_ids(tok, "class A:\n    def ", "\n") == fim.layout(prefix_ids, suffix_ids)
    healed, heal = healed_fim_prompt_ids(tok, "class A:\n    def ", "\n")
    assert healed == fim.layout(prefix_ids[:-1], suffix_ids) and heal.text == " "
    assert tok.decode(prefix_ids[:-1]) + heal.text == "class A:\n    def "
    assert healed_fim_prompt_ids(tok, "", "x")[1] is None  # no prefix: nothing to heal


def test_workspace_warmup_is_what_fim_prompts_begin_with(tokenizer, spm_tokenizer):
    from mtplxd.workspaces import warmup_prompt_ids

    text = "import os\n\ndef main():\n"
    for tok in (tokenizer, spm_tokenizer):
        warm = warmup_prompt_ids(tok, text)
        at_the_end = fim_prompt_ids(tok, text + "    return 1\n", "")  # a cursor with nothing after it
        assert at_the_end[: len(warm)] == warm and len(warm) >= len(tok.encode(text))
