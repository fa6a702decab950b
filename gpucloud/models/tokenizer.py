"""Tokenizers: train a byte-level BPE locally, and load any Hugging Face tokenizer directory.

`train_tokenizer` makes the tokenizer of the models `gpucloud model init` writes: byte-level
BPE (every UTF-8 string round-trips, CJK and emoji included), with special tokens for the
start and end of a text and for chat roles. `load_tokenizer` wraps the `tokenizer.json` of
any HF model directory (ours or a downloaded one) with what serve and train need: encode,
decode, the bos/eos ids and the chat template from `tokenizer_config.json`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from gpucloud.errors import ConfigError

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLES = ("system", "user", "assistant")
# Order fixes the ids: pad 0, bos 1, eos 2 (the ids ModelSpec assumes), then the role markers.
SPECIAL_TOKENS = [PAD, BOS, EOS, *(f"<|{role}|>" for role in ROLES)]

# A turn is `<|role|>\n content <|eos|>`: eos ends every turn, so an engine that stops at eos
# stops at the end of the assistant's answer. bos comes from the template, as in Llama 3.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('chat roles are system, user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int, text: str | Iterable[str]) -> tokenizers.Tokenizer:
    """A byte-level BPE of at most `vocab_size` tokens (special tokens included) trained on
    `text`. Fewer tokens when the text has no more merges to offer.

    Raises ConfigError when `vocab_size` cannot hold the 256 bytes and the special tokens.
    """
    floor = 256 + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ConfigError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least {floor} "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text] if isinstance(text, str) else text, trainer)
    # HF's `tokenizer(text)` adds bos through the post-processor, as Llama's tokenizers do.
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def save_tokenizer(tok: tokenizers.Tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and
    special_tokens_map.json for a tokenizer made by `train_tokenizer`."""
    out = Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,  # else HF's decode would not round-trip
        "additional_special_tokens": SPECIAL_TOKENS[3:],
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special)


class Tokenizer:
    """What serve and train need from any HF tokenizer directory.

    `backend` is the underlying `tokenizers.Tokenizer`. `bos_id`/`eos_id` are None when the
    directory names no such token. `stop_ids` adds generation_config.json's eos ids (chat
    models often end a turn with a token other than eos).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        extra_eos_ids: Iterable[int] = (),
    ):
        self.backend = backend
        self.config = dict(config or {})
        self.special_tokens = {
            key: _token_text(self.config[key])
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if self.config.get(key) is not None
        }
        self.bos_id = self._special_id("bos_token")
        self.eos_id = self._special_id("eos_token")
        self.pad_id = self._special_id("pad_token")
        stops = {self.eos_id, *extra_eos_ids} - {None}
        self.stop_ids: frozenset[int] = frozenset(stops)  # type: ignore[arg-type]
        self.chat_template = _pick_template(self.config.get("chat_template"))

    def _special_id(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be below the model's vocab_size)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids. With `add_bos`,
        bos is put first unless the text already starts with it (as rendered chats do)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Iterable[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The chat rendered as text, as HF's `apply_chat_template(..., tokenize=False)` does.

        Raises ConfigError when the directory has no chat template or the template rejects
        the messages (e.g. an unknown role).
        """
        if self.chat_template is None:
            raise ConfigError("this tokenizer has no chat_template in tokenizer_config.json")
        try:
            return _compile(self.chat_template).render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **kwargs,
            )
        except (jinja2.TemplateError, _TemplateRaised) as e:
            raise ConfigError(f"chat template: {e}") from None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load `model_dir/tokenizer.json` with its tokenizer_config.json (special tokens, chat
    template; a `chat_template.jinja` file wins as in recent transformers) and the eos ids of
    generation_config.json. Raises ConfigError when tokenizer.json is missing or unreadable.
    """
    path = Path(model_dir)
    file = path / "tokenizer.json"
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for a missing or bad file
        raise ConfigError(f"cannot read tokenizer {file}: {e}") from None
    config = {**_read_json(path / "special_tokens_map.json"), **_read_json(file.with_name(
        "tokenizer_config.json"))}  # fmt: skip
    if (path / "chat_template.jinja").is_file():
        config["chat_template"] = (path / "chat_template.jinja").read_text()
    model_config = _read_json(path / "config.json")
    for key in ("bos", "eos"):  # fall back to config.json ids when tokenizer_config has none
        token_id = _first(model_config.get(f"{key}_token_id"))
        if f"{key}_token" not in config and token_id is not None:
            config[f"{key}_token"] = backend.id_to_token(token_id)
    eos = _read_json(path / "generation_config.json").get("eos_token_id")
    extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return Tokenizer(backend, config, extra_eos_ids=extra)


# ---- chat templates: the jinja environment HF uses (sandboxed, trimmed blocks) ------------
class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"chat template does not parse: {e}") from None


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template is a string, or a list of {name, template}."""
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value}
        return named.get("default", next(iter(named.values()), None))
    return value


def _token_text(value: Any) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) and value else value


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None


def _write_json(file: Path, data: Any) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
