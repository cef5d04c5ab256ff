"""Merging partial attention results by log-sum-exp (decode context parallelism).

Each DCP rank attends with all heads over only its own chunks, giving ``(out_r, lse_r)``. The full
softmax over the union is ``sum_r exp(lse_r - lse) * out_r`` with ``lse = logsumexp_r(lse_r)``.
As in vLLM, ranks all-gather the LSEs (tiny), rescale locally and reduce-scatter the outputs back
to each rank's head shard, so the big tensor crosses the wire once.
"""

from __future__ import annotations

import torch

from pdd_sidecar.engine.comm import Comm


def lse_weights(lse_r: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """``exp(lse_r - logsumexp(lses))`` per head; a rank with no tokens (-inf) weighs 0."""
    total = torch.logsumexp(lses, dim=0)
    return torch.nan_to_num(torch.exp(lse_r - total), nan=0.0)


def merge_by_lse(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process merge of ``outs [R, H, C]`` with ``lses [R, H]`` into ``(out, lse)``."""
    w = torch.stack([lse_weights(lses[r], lses) for r in range(lses.shape[0])])
    return (outs * w[..., None]).sum(0), torch.logsumexp(lses, dim=0)


def dcp_merge(out: torch.Tensor, lse: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's partial ``out [..., H, C]``, ``lse [..., H]`` to the merged output of its heads
    ``[..., H / world_size, C]``; leading dims are rows (tokens of a batch), merged in one go."""
    lses = comm.all_gather(lse.unsqueeze(0), dim=0)
    return comm.reduce_scatter(out * lse_weights(lse, lses)[..., None], dim=out.dim() - 2)
