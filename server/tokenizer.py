"""Tokenizer over a Hugging Face `tokenizer.json` (via `tokenizers`), plus streaming decode.

Also builds the byte-level tokenizer used by the built-in models and the test checkpoints:
token id == byte value for bytes 0..255 (one token per ARC digit), then special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from sloserve.errors import CheckpointError
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenisation emits)."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_level_tokenizer() -> _HFTokenizer:
    """256 byte tokens (id == byte), then <s>=256, </s>=257, <pad>=258; encode prepends <s>."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, PAD])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 256)]
    )
    return tok


def save_byte_level_tokenizer(folder: Path, model_max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json for the byte-level tokenizer into `folder`."""
    folder = Path(folder)
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": model_max_length,
        "add_bos_token": True,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


class Tokenizer:
    """encode/decode with the checkpoint's own special-token handling."""

    def __init__(
        self, tokenizer: _HFTokenizer, eos_token: str | None = None, bos_token: str | None = None
    ) -> None:
        self._tok = tokenizer
        _drop_useless_word_cache(tokenizer)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (required) and `tokenizer_config.json` (optional) from a folder."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(
                f"{path} is missing: sloserve needs a fast-tokenizer tokenizer.json"
            )
        try:
            tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise CheckpointError(f"{path} cannot be read as a tokenizers file: {exc}") from exc
        config: dict = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
        return cls(tok, _token_text(config.get("eos_token")), _token_text(config.get("bos_token")))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The token's own string in the vocabulary (e.g. 'Ġhello' for byte-level BPE)."""
        return self._tok.id_to_token(token_id)

    def to_json(self) -> str:
        """The whole tokenizer as `tokenizer.json` text (what a grammar library builds its vocabulary from)."""
        return self._tok.to_str()

    def incremental(self, prompt_ids: list[int] | None = None) -> IncrementalDecoder:
        return IncrementalDecoder(self, prompt_ids or [])


def _drop_useless_word_cache(tokenizer: _HFTokenizer) -> None:
    """A BPE model without merges (byte level) gains nothing from its word cache: turn it off.

    NOTE: tokenizers' BPE keeps up to 10,000 distinct short words; with grid prompts each one is
    a new 'word', so the cache only grew RSS (~7 KB per prompt) in the 10,000-request soak.
    Real BPE models keep their cache. `_resize_cache` is guarded: absent, nothing changes.
    """
    model = tokenizer.model
    if isinstance(model, models.BPE) and hasattr(model, "_resize_cache"):
        if not json.loads(tokenizer.to_str())["model"].get("merges"):
            model._resize_cache(0)


def _token_text(value: object) -> str | None:
    """tokenizer_config stores special tokens as strings or as {'content': ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, holding back split UTF-8 sequences.

    Decodes a short window (from `prefix` to the end) so that tokenizers which change a token's
    text depending on its neighbours (leading spaces) still produce the right delta.
    """

    _CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-self._CONTEXT :])
        self._prefix = 0
        self._read = len(self._ids)

    def step(self, new_ids: list[int]) -> str:
        """Append `new_ids`; return the text they completed ('' while a character is unfinished)."""
        self._ids.extend(new_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full_text = self._tokenizer.decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        return delta
