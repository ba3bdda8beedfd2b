"""Tokenizer: byte-level round trips, special tokens, streaming decode of split UTF-8."""

from __future__ import annotations

import pytest
from sloserve.errors import CheckpointError
from sloserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_llama) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama)


def test_one_token_per_byte_with_bos(tok):
    ids = tok.encode("0123456789\n")
    assert ids == [256] + [48 + d for d in range(10)] + [10]
    assert tok.bos_token_id == 256 and tok.eos_token_id == 257
    assert tok.decode(ids) == "0123456789\n"
    assert tok.decode(ids + [257], skip_special_tokens=False).endswith("</s>")


def test_round_trip_of_any_text(tok):
    text = "Ünïcödé ✓ mixed 🙂 text\twith\ttabs"
    assert tok.decode(tok.encode(text)) == text


def test_incremental_decoding_holds_back_partial_characters(tok):
    ids = tok.encode("a🙂b", add_special_tokens=False)
    assert len(ids) == 6  # 'a', 4 bytes of the emoji, 'b'
    dec = tok.incremental(tok.encode("prompt"))
    deltas = [dec.step([i]) for i in ids]
    assert deltas == ["a", "", "", "", "🙂", "b"]
    assert "".join(deltas) == "a🙂b"


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing"):
        Tokenizer.from_pretrained(tmp_path)
