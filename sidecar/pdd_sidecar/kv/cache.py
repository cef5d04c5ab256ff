"""Paged latent KV cache, one per rank, and the DCP chunk arithmetic shared with the transfer layer.

Layout (contract): ``kv[num_blocks, num_layers, block_size, kv_lora_rank + qk_rope_head_dim]``
in the model's dtype, or with ``kv_cache_dtype="fp8"`` ``uint8[num_blocks, num_layers,
block_size, token_bytes]``: each token in kv/fp8_layout.py's FlashMLA layout (656 bytes for
V2/V3 against 1,152 in bf16). Readers get the model's dtype back either way. Block-major, so
one block of every layer is one contiguous region and a run of consecutive block ids is one
contiguous region too: a request allocated as one run moves as one NIXL descriptor.

Chunk ``g`` of a request is tokens ``[g*bs, (g+1)*bs)``. With ``dcp > 1`` rank ``r`` holds chunks
``g % dcp == r`` in local block ``g // dcp`` of the request's block table, which every rank of the
instance shares (all ranks allocate identically). With ``dcp == 1`` every rank holds every chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdd_sidecar.kv.errors import KVCacheFullError as KVCacheFullError
from pdd_sidecar.kv.fp8_layout import (
    check_kv_cache_dtype,
    dequantize_latents,
    quantize_latents,
    token_bytes,
)

# --- pure chunk / position arithmetic -------------------------------------------------------


def num_chunks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chunk_of_token(t: int, block_size: int) -> int:
    return t // block_size


def chunk_owner(g: int, dcp: int) -> int:
    """The rank that holds chunk ``g`` when KV is sharded (with dcp == 1 every rank does)."""
    return g % dcp


def holds_chunk(rank: int, g: int, dcp: int) -> bool:
    return dcp == 1 or g % dcp == rank


def local_block_index(g: int, dcp: int) -> int:
    """Index into the request's (shared) block table where the holder of chunk ``g`` keeps it."""
    return g // dcp


def chunk_of_local_block(k: int, rank: int, dcp: int) -> int:
    return k * dcp + (rank if dcp > 1 else 0)


def num_table_blocks(num_tokens: int, block_size: int, dcp: int) -> int:
    """Length of the shared block table for ``num_tokens`` tokens (what each rank allocates)."""
    return -(-num_chunks(num_tokens, block_size) // dcp)


def num_local_blocks(num_tokens: int, block_size: int, dcp: int, rank: int) -> int:
    """Blocks of the table that rank ``rank`` actually fills for ``num_tokens`` tokens."""
    n = num_chunks(num_tokens, block_size)
    if dcp == 1:
        return n
    return max(0, -(-(n - rank) // dcp))


def local_chunks(num_tokens: int, block_size: int, dcp: int, rank: int) -> list[int]:
    return [
        chunk_of_local_block(k, rank, dcp)
        for k in range(num_local_blocks(num_tokens, block_size, dcp, rank))
    ]


def local_token_count(num_tokens: int, block_size: int, dcp: int, rank: int) -> int:
    """Tokens of the first ``num_tokens`` that rank ``rank`` holds; they fill its local blocks in
    order, so only the last local block can be partial."""
    k = num_local_blocks(num_tokens, block_size, dcp, rank)
    if k == 0:
        return 0
    last = chunk_of_local_block(k - 1, rank, dcp)
    return (k - 1) * block_size + min(block_size, num_tokens - last * block_size)


def local_positions(num_local: int, block_size: int, dcp: int, rank: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Sequence positions of the first ``num_local`` tokens a rank holds, in storage order."""
    j = torch.arange(num_local, device=device)
    if dcp == 1:
        return j
    return (j // block_size * dcp + rank) * block_size + j % block_size


def token_slot(t: int, block_size: int, dcp: int) -> tuple[int, int, int]:
    """``(owner rank, local block index, offset in block)`` of token ``t``; with dcp == 1 the
    owner is 0 but every rank stores the token at the same slot."""
    g = t // block_size
    return g % dcp, g // dcp, t % block_size


def contiguous_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``(first id, count)`` runs of consecutive ids, in table order: one transfer each."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


# --- the cache ------------------------------------------------------------------------------


class PagedKVCache:
    """``dtype``: the model's, what reads return. ``kv_cache_dtype``: ``auto`` keeps latents
    in ``dtype``; ``fp8`` keeps each token as ``token_bytes`` of kv/fp8_layout.py, whose first
    ``kv_lora_rank`` values (the no-RoPE part) are e4m3 with a scale per 128 and the rest (RoPE)
    bf16. Whatever moves blocks (hand-off, host tier, copies) moves ``kv``'s bytes as they are."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        latent_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_cache_dtype: str = "auto",
        kv_lora_rank: int | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.latent_dim = latent_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_lora_rank = kv_lora_rank or 0
        if self.fp8:
            if not 0 < self.kv_lora_rank < latent_dim:
                raise ValueError(f"kv_cache_dtype 'fp8' needs kv_lora_rank in (0, {latent_dim}),"
                                 f" got {kv_lora_rank}")
            self.token_width = token_bytes(self.kv_lora_rank, latent_dim - self.kv_lora_rank)
        else:
            self.token_width = latent_dim
        self.kv = torch.zeros(
            num_blocks, num_layers, block_size, self.token_width,
            dtype=torch.uint8 if self.fp8 else dtype, device=self.device,
        )
        self._free = [True] * num_blocks
        self._num_free = num_blocks

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.block_size * self.token_width * self.kv.element_size()

    def stored(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as a read of them would return them: rounded through FP8 for an FP8
        cache (so a fresh prompt attends over the same latents a later chunk, a decode step
        or a hand-off peer reads), unchanged otherwise."""
        if not self.fp8:
            return values
        return dequantize_latents(quantize_latents(values, self.kv_lora_rank),
                                  self.kv_lora_rank, values.dtype)

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """``[N, latent]`` values as the cache's rows: FP8 tokens, or the model's dtype."""
        if self.fp8:
            return quantize_latents(values, self.kv_lora_rank)
        return values.to(self.dtype)

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """The cache's ``[N, token_width]`` rows as ``[N, latent]`` of the model's dtype."""
        if self.fp8:
            return dequantize_latents(rows, self.kv_lora_rank, self.dtype)
        return rows

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int) -> list[int]:
        """Lowest run of ``n`` consecutive free blocks (one transfer), else the lowest free ids.
        Deterministic, so every rank of an instance gets the same table."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self._num_free:
            raise KVCacheFullError(
                f"KV cache full: requested {n} blocks of {self.block_size} tokens, "
                f"{self._num_free} free of {self.num_blocks}"
            )
        if n == 0:
            return []
        run_start, run_len = 0, 0
        for i, free in enumerate(self._free):
            if free:
                if run_len == 0:
                    run_start = i
                run_len += 1
                if run_len == n:
                    ids = list(range(run_start, run_start + n))
                    break
            else:
                run_len = 0
        else:
            ids = [i for i, free in enumerate(self._free) if free][:n]
        for i in ids:
            self._free[i] = False
        self._num_free -= n
        return ids

    def free(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if not (0 <= i < self.num_blocks) or self._free[i]]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"freeing blocks that are not allocated: {sorted(set(bad))}")
        for i in ids:
            self._free[i] = True
        self._num_free += len(ids)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Block ``dst`` becomes a copy of block ``src`` (every layer) for each pair, in the
        current stream's order (the steps that read ``dst`` come after)."""
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.device)
        self.kv.index_copy_(0, dst, self.kv.index_select(0, src))

    # --- slot addressing used by the engine --------------------------------------------------

    def write(
        self, layer: int, block_idx: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store ``values[i]`` at ``(block_idx[i], offsets[i])`` of ``layer``."""
        if values.numel():
            self.kv[block_idx, layer, offsets] = self.pack(values)

    def read(self, layer: int, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` latents held in ``block_ids`` (filled in order), ``[N, D]``."""
        if num_tokens == 0:
            return torch.empty(0, self.latent_dim, dtype=self.dtype, device=self.device)
        nb = -(-num_tokens // self.block_size)
        return self.read_blocks(layer, block_ids[:nb])[:num_tokens]

    def read_blocks(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Every row of ``block_ids`` of ``layer``, in order, ``[len(block_ids) * block_size,
        D]``."""
        # One block of one layer is a contiguous row: gathering whole rows runs at copy speed,
        # several times faster than element-wise advanced indexing.
        rows = self.kv.view(self.num_blocks * self.num_layers, self.block_size * self.token_width)
        blocks = rows.index_select(0, block_ids * self.num_layers + layer)
        return self.unpack(blocks.view(block_ids.shape[0] * self.block_size, self.token_width))
