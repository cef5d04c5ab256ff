"""Errors of the block allocators, kept free of torch so pure modules can raise them."""

from __future__ import annotations


class KVCacheFullError(RuntimeError):
    """Not enough free blocks for a request; raised instead of overwriting live KV."""
