"""Byte-level tokenizer of the built-in model: token id = UTF-8 byte (vocabulary 256).

Real checkpoints bring their own tokenizer.json (text.py); one without it takes token ids
only.
"""

from __future__ import annotations

VOCAB_SIZE = 256


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(token_ids: list[int]) -> str:
    return bytes(t for t in token_ids if 0 <= t < VOCAB_SIZE).decode("utf-8", errors="replace")
