"""What an instance's warm-up runs, from its settings alone: the driver's warm-up before
``/readyz`` and the start-up memory probe (engine/memory_probe.py) run the same steps, so the
probe measures the memory serving will take."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdd_sidecar.kv.pool_sizing import blocks_for


def fresh_prompt_lengths(block_size: int) -> tuple[int, int]:
    """The two small fresh prompts a prefill's warm-up runs beside a continuing chunk: a block
    and a few tokens (continued by two more), two blocks and a few."""
    return block_size + 3, 2 * block_size + 5


def warmup_fresh_blocks(block_size: int, dcp: int) -> int:
    """Table blocks each fresh prompt gets: the longer one's, from its own length (a fixed count
    fell short at small block sizes: 13 tokens in blocks of 4 need 4)."""
    return blocks_for(max(fresh_prompt_lengths(block_size)), block_size, dcp)


@dataclass(frozen=True)
class WarmupShape:
    """A warm-up runs a ``prompt_tokens`` prompt in chunks of the scheduler's chunk size (and
    shorter fresh prompts in the blocks it leaves); a decode's then a decode step at each of
    ``batch_sizes``. ``blocks``: what it allocates from the cache."""

    prompt_tokens: int
    blocks: int
    batch_sizes: list[int] = field(default_factory=list)


def warmup_shape(role: str, num_blocks: int, block_size: int, dcp: int, chunk_tokens: int,
                 max_running: int, buckets: Sequence[int], eager_decode: bool) -> WarmupShape:
    """Both roles: a chunk-sized prompt and a ragged continuation of it (the cached-latent path
    and the shapes Triton specializes on, lengths divisible by 16 or not), as much of it as the
    cache holds. A decode prefills prompts too (a short one's local prefill, every request
    while no prefill is ready), so it warms that path as a prefill does; without it the first
    such prompt compiled kernels and captured prefill graphs on a request's path (TTFT 0.9 s
    for 64 prompts of 32 tokens on one H100 against 48 ms through a prefill). A decode also
    runs every CUDA-graph bucket up to its running limit (the first alone when decode steps
    run eagerly: nothing to capture per bucket)."""
    spare = 2 * warmup_fresh_blocks(block_size, dcp)
    prompt = min(chunk_tokens + block_size // 2 + 1,
                 max(1, num_blocks - spare) * block_size * dcp)
    blocks = blocks_for(prompt, block_size, dcp) + spare
    if role == "prefill":
        return WarmupShape(prompt, blocks)
    limit = next((b for b in buckets if b >= max_running), buckets[-1])
    batches = [b for b in buckets if b <= limit]
    if eager_decode:
        batches = batches[:1]
    return WarmupShape(prompt, blocks, batches)


def unbounded_warmup_blocks(role: str, block_size: int, dcp: int, chunk_tokens: int) -> int:
    """Blocks a warm-up needs when the cache does not cut its prompt short: the scratch cache
    the memory probe runs it on (the same for both roles: a decode prefills too)."""
    prompt = chunk_tokens + block_size // 2 + 1
    return blocks_for(prompt, block_size, dcp) + 2 * warmup_fresh_blocks(block_size, dcp)


def largest_step_prompts(role: str, step_tokens: int, chunk_tokens: int) -> list[int]:
    """Fresh prompts of one prefill step at its token budget, when that budget is more than a
    chunk (the warm-up's largest step): the memory probe runs it too, so the pool leaves room
    for the activations of the largest step serving can plan. Empty otherwise."""
    if role != "prefill" or step_tokens <= chunk_tokens:
        return []
    whole, rest = divmod(step_tokens, chunk_tokens)
    return [chunk_tokens] * whole + ([rest] if rest else [])
