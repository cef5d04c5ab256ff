"""Power-of-two block sizes for the Triton launches: ``tl.arange`` takes only powers of two,
so every kernel pads a dimension up to one, with a floor that keeps ``tl.dot`` tiles legal."""

from __future__ import annotations


def next_pow2(n: int, least: int = 16) -> int:
    """The smallest power of two at or above ``n``, and at least ``least``."""
    return max(least, 1 << (n - 1).bit_length())
