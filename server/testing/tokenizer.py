"""The tokenizer of the fake engines and runners: one token per byte."""

from __future__ import annotations


class ByteTokenizer:
    """token id == byte; decode drops ids above 255 and replaces broken UTF-8 (so a detokenizer
    must hold a split character back)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
