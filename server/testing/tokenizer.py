"""The tokenizer of the fake engines and runners: one token per byte."""

from __future__ import annotations


class ByteTokenizer:
    """token id == byte; decode drops ids above 255 and replaces broken UTF-8 (so a detokenizer
    must hold a split character back)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's UTF-8 bytes (there are no special tokens to add)."""
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
