import json
from pathlib import Path

import pytest
import tokenizers
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gpucloud.errors import ConfigError
from gpucloud.models.tokenizer import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    SPECIAL_TOKENS,
    Tokenizer,
    load_tokenizer,
    train_tokenizer,
)

CHAT = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "What is 2+2? 请用中文回答 🙂"},
    {"role": "assistant", "content": "四 (4)."},
    {"role": "user", "content": "And 3+3?"},
]
SAMPLES = ["", " ", "Hello, world!", "日本語のテキスト、中文文本，한국어", "emoji 🧪🚀👩‍👩‍👧",
           "tabs\tand\nnewlines\r\n  spaces  ", "\x00\x7f\u200b combining é e\u0301",
           "def f(x):\n    return {'a': [1, 2]}"]  # fmt: skip


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_unicode_text_round_trips(tok: Tokenizer, text: str):
    # A special token's text is read as that token, as HF tokenizers do (hypothesis draws
    # string constants from the code, "<|bos|>" among them): ordinary text must round-trip.
    assume(not any(special in text for special in SPECIAL_TOKENS))
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), min_size=1))
def test_cjk_round_trips_and_bos_comes_first(tok: Tokenizer, text: str):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_same_ids_and_text_as_transformers(tok: Tokenizer, hf_tok, text: str):
    ids = tok.encode(text)
    assert hf_tok(text)["input_ids"] == ids  # HF's post-processor adds bos like ours
    assert hf_tok.decode(ids, skip_special_tokens=True) == text


def test_special_tokens_have_the_ids_the_model_config_names(tok: Tokenizer, tiny_dir: Path):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert (tok.bos_id, tok.eos_id) == (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert tok.pad_id == 0 and tok.stop_ids == {2}
    assert tok.vocab_size == config["vocab_size"] == 2048
    assert [tok.backend.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(6))
    assert tok.decode([1, 2], skip_special_tokens=False) == BOS + EOS
    assert tok.decode(tok.encode(f"x{EOS}")) == "x"


def test_chat_template_renders_as_transformers_does(tok: Tokenizer, hf_tok):
    for add_generation_prompt in (True, False):
        ours = tok.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
        theirs = hf_tok.apply_chat_template(
            CHAT, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
    text = tok.apply_chat_template(CHAT)
    assert text.startswith(BOS) and text.endswith("<|assistant|>\n")
    ids = tok.encode(text)  # the rendered bos is not doubled
    assert ids[:2] == [tok.bos_id, tok.backend.token_to_id("<|system|>")]
    assert ids == hf_tok.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]


def test_chat_template_rejects_unknown_roles(tok: Tokenizer):
    with pytest.raises(ConfigError, match="system, user and assistant, not tool"):
        tok.apply_chat_template([{"role": "tool", "content": "{}"}])


def test_training_respects_vocab_size_and_rejects_too_small():
    tok = train_tokenizer(300, "the quick brown fox jumps over the lazy dog " * 50)
    assert tok.get_vocab_size() <= 300
    with pytest.raises(ConfigError, match="at least 262"):
        train_tokenizer(100, "text")


def test_foreign_hf_tokenizer_dir(tmp_path: Path):
    """Not ours: a WordLevel tokenizer saved by transformers, bos/eos as AddedToken dicts, an
    eos list in generation_config.json and a chat template in chat_template.jinja."""
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2, "hi": 3, "there": 4}, "[UNK]")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="[UNK]"
    ).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["bos_token"] = {"content": "<s>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    (tmp_path / "chat_template.jinja").write_text(
        CHAT_TEMPLATE.replace("<|", "[").replace("|>", "]")
    )

    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (1, 2, {2, 4})
    assert tok.encode("hi there") == [1, 3, 4]
    assert tok.encode("hi there", add_bos=False) == [3, 4]
    assert tok.decode([1, 3, 4]) == "hi there"
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
        == "<s>[user]\nhi</s>[assistant]\n"
    )


def test_missing_tokenizer_or_template_is_a_config_error(tmp_path: Path, tok: Tokenizer):
    with pytest.raises(ConfigError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path)
    bare = Tokenizer(tok.backend)
    with pytest.raises(ConfigError, match="no chat_template"):
        bare.apply_chat_template(CHAT)
    assert bare.bos_id is None and bare.encode("a", add_bos=True) == tok.encode("a", add_bos=False)
