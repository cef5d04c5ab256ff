"""Multi-head latent attention (MLA) of one rank's heads.

The cache holds per token only the normalised compressed KV ``c`` (``kv_lora_rank``) and the
roped shared key ``k_pe`` (``qk_rope_head_dim``). Prefill expands ``c`` into per-head keys and
values (cheap while the whole prompt is at hand); so does a prompt chunk continuing a cached
sequence, expanding the cached latent slice by slice (``chunk_prefill_attention``), since many
queries share each expanded key. Decode uses the absorbed form: ``W_UK`` is folded into the query
and ``W_UV`` applied after attention, so attention reads the latent cache directly. Both cached
paths return the output plus its log-sum-exp, which is what DCP ranks merge.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdd_sidecar.model import fusion
from pdd_sidecar.model.config import ModelConfig
from pdd_sidecar.model.kernels.chunk_attention import chunk_attention, merge_partials
from pdd_sidecar.model.kernels.dense_gemv import small_linear
from pdd_sidecar.model.kernels.kv_write import write_latents
from pdd_sidecar.model.kernels.norm_rope import apply_rope, rms_norm
from pdd_sidecar.model.kernels.rope_kv_write import rope_kv_write
from pdd_sidecar.model.weights import AttnWeights

LORA_NORM_EPS = 1e-6  # q_a/kv_a layernorms use the RMSNorm default, not rms_norm_eps


def project_q(
    x: torch.Tensor, w: AttnWeights, cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_nope [T, Hl, nope], q_pe [T, Hl, rope])`` with rope applied to ``q_pe``."""
    if w.q_proj is not None:
        q = F.linear(x, w.q_proj)
    else:
        assert w.q_a_proj is not None and w.q_a_norm is not None and w.q_b_proj is not None
        qa = rms_norm(F.linear(x, w.q_a_proj, w.q_a_bias), w.q_a_norm, LORA_NORM_EPS)
        q = F.linear(qa, w.q_b_proj)
    q = q.unflatten(-1, (-1, cfg.qk_head_dim))
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    return q_nope, apply_rope(q_pe, cos, sin)


def project_latent(
    x: torch.Tensor, w: AttnWeights, cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The cache entry of each token, ``[T, kv_lora + rope]``: ``[norm(c), rope(k_pe)]``."""
    ckv = F.linear(x, w.kv_a_proj, w.kv_a_bias)
    c, k_pe = ckv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    return torch.cat([rms_norm(c, w.kv_a_norm, LORA_NORM_EPS), apply_rope(k_pe, cos, sin)], -1)


def project_and_store(
    x: torch.Tensor, w: AttnWeights, cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor,
    kv_cache: torch.Tensor, layer: int, blk: torch.Tensor, off: torch.Tensor,
    mask: torch.Tensor, want_latent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A padded step's projections of the normed input ``x``: ``(q_nope, q_pe roped, latent
    or None)``, each token's latent stored at its slot where ``mask`` is set
    (``write_latents``). Fused on CUDA (``fusion.fused()``, stacked ``qkv_a``): one GEMV for the
    query and the latent, then one kernel for their norm, RoPE and the store."""
    if not (fusion.fused() and x.is_cuda and w.qkv_a is not None):
        q_nope, q_pe = project_q(x, w, cfg, cos, sin)
        latent = project_latent(x, w, cfg, cos, sin)
        write_latents(kv_cache, layer, blk, off, mask, latent, kv_lora_rank=cfg.kv_lora_rank)
        return q_nope, q_pe, latent if want_latent else None
    q_nope, q_pe, ckv = _split_projection(x, w, cfg)
    q_rot, stored = rope_kv_write(ckv, q_pe, w.kv_a_norm, cos, sin, LORA_NORM_EPS, kv_cache,
                                  layer, blk, off, mask, want_latent)
    return q_nope, q_rot, stored


def absorbed_query_and_store(
    x: torch.Tensor, w: AttnWeights, cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor,
    kv_cache: torch.Tensor, layer: int, blk: torch.Tensor, off: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """A padded decode step's absorbed query ``[T, Hl, kv_lora + rope]``, the new latents
    stored as ``project_and_store`` does. Fused, the query is assembled in place: RoPE writes
    its part and the ``W_UK`` product its own into one buffer (no concatenation), laid out
    head-major so the batched product writes straight into it."""
    if not (fusion.fused() and x.is_cuda and w.qkv_a is not None):
        q_nope, q_pe, _ = project_and_store(x, w, cfg, cos, sin, kv_cache, layer, blk, off, mask)
        return absorb_q(q_nope, q_pe, w)
    q_nope, q_pe, ckv = _split_projection(x, w, cfg)
    t, h = q_nope.shape[0], q_nope.shape[1]
    kvl = cfg.kv_lora_rank
    buf = torch.empty(h, t, cfg.latent_dim, dtype=x.dtype, device=x.device)
    rope_kv_write(ckv, q_pe, w.kv_a_norm, cos, sin, LORA_NORM_EPS, kv_cache, layer, blk, off,
                  mask, q_out=buf[:, :, kvl:].transpose(0, 1))
    torch.bmm(q_nope.transpose(0, 1), w.w_uk, out=buf[:, :, :kvl])
    return buf.transpose(0, 1)


def unabsorb_v_flat(out_latent: torch.Tensor, w: AttnWeights) -> torch.Tensor:
    """``unabsorb_v`` flattened over heads, ``[T, Hl * v]`` (the output projection's input):
    fused, the batched product writes token-major rows directly (no copy before o_proj)."""
    if not (fusion.fused() and out_latent.is_cuda):
        return unabsorb_v(out_latent, w).flatten(1)
    t, h = out_latent.shape[0], out_latent.shape[1]
    dv = w.w_uv.shape[1]
    o = torch.empty(t, h, dv, dtype=out_latent.dtype, device=out_latent.device)
    torch.bmm(out_latent.transpose(0, 1), w.w_uv.transpose(1, 2), out=o.transpose(0, 1))
    return o.view(t, h * dv)


def _split_projection(
    x: torch.Tensor, w: AttnWeights, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_nope, q_pe, ckv)`` from one GEMV over the stacked ``qkv_a`` (views of its output;
    with a query LoRA, ``q_a`` normed and up-projected first)."""
    assert w.qkv_a is not None
    both = small_linear(x, w.qkv_a)
    n_q = both.shape[-1] - cfg.latent_dim
    q, ckv = both[:, :n_q], both[:, n_q:]
    if w.q_b_proj is not None:
        assert w.q_a_norm is not None
        q = F.linear(rms_norm(q, w.q_a_norm, LORA_NORM_EPS), w.q_b_proj)
    q = q.unflatten(-1, (-1, cfg.qk_head_dim))
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    return q_nope, q_pe, ckv


def prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    w: AttnWeights,
    cfg: ModelConfig,
) -> torch.Tensor:
    """Causal attention of the prompt over itself, ``[T, Hl, v]``."""
    c, k_pe = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    hl, t = q_nope.shape[1], q_nope.shape[0]
    k_nope = torch.einsum("tc,hnc->htn", c, w.w_uk)
    v = torch.einsum("tc,hvc->htv", c, w.w_uv)
    q = torch.cat([q_nope, q_pe], -1).transpose(0, 1)
    k = torch.cat([k_nope, k_pe.unsqueeze(0).expand(hl, t, -1)], -1)
    dv, dqk = v.shape[-1], q.shape[-1]
    if q.is_cuda and q.dtype != torch.float32 and dv < dqk:
        # Flash and cuDNN attention want one head dim for q, k and v: zero-padding v to the qk
        # dim costs a little copying and keeps the fused kernels instead of the unfused math.
        vp = F.pad(v, (0, dqk - dv))
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), vp.unsqueeze(0), is_causal=True, scale=cfg.softmax_scale
        )[0, ..., :dv]
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.softmax_scale)
    return out.transpose(0, 1)


def varlen_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    seg_start: torch.Tensor,
    w: AttnWeights,
    cfg: ModelConfig,
) -> torch.Tensor:
    """Several fresh prompts concatenated into one token range, each attending causally over
    itself only, in one attention call: ``seg_start [T]`` is, per token, the index of its
    prompt's first token. Same result as ``prefill_attention`` per prompt, ``[T, Hl, v]``; one
    launch instead of a chain of kernels per prompt, which dominates a step of many short
    prompts."""
    h, nope, kv_lora = w.w_uk.shape
    dv, t = w.w_uv.shape[1], latent.shape[0]
    c, k_pe = latent[:, :kv_lora], latent[:, kv_lora:]
    k_nope = F.linear(c, w.w_uk.reshape(h * nope, kv_lora)).view(t, h, nope)
    v = F.linear(c, w.w_uv.reshape(h * dv, kv_lora)).view(t, h, dv)
    pos = torch.arange(t, device=latent.device)
    out, _ = chunk_attention(q_nope, q_pe, k_nope, k_pe, v, pos, pos, cfg.softmax_scale,
                             q_lo=seg_start)
    return out.to(q_nope.dtype)


EXPANDED_SLICE_BYTES = 256 << 20  # keys and values expanded at once, per chunk and layer


def chunk_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    q_lo: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's queries ``[T, H, nope|rope]`` at ``q_pos`` over cached latents ``[N, L]`` at
    ``k_pos`` (ascending; the chunk's own tokens included), each key visible to the queries at
    or after its position. The latents are expanded with ``w_uk``/``w_uv`` (``[H, nope|v,
    kv_lora]``, the heads of ``q``) in slices of at most ``EXPANDED_SLICE_BYTES``, each slice's
    attention merged by LSE. With ``q_lo`` (per query, the lowest key position it sees) several
    sequences' chunks attend in one call, each over its own key range. Returns ``(out [T, H, v]
    fp32, lse [T, H] fp32)``; a query that sees nothing gets 0 and ``-inf``."""
    h, nope, kv_lora = w_uk.shape
    dv = w_uv.shape[1]
    t, n = q_nope.shape[0], latent.shape[0]
    out = torch.zeros(t, h, dv, dtype=torch.float32, device=q_nope.device)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=q_nope.device)
    if n == 0 or t == 0:
        return out, lse
    c, k_pe = latent[:, :kv_lora], latent[:, kv_lora:]
    w_k, w_v = w_uk.reshape(h * nope, kv_lora), w_uv.reshape(h * dv, kv_lora)
    per_token = h * (nope + dv) * latent.element_size()
    step = max(1, EXPANDED_SLICE_BYTES // per_token)
    for a in range(0, n, step):
        b = min(n, a + step)
        k_nope = F.linear(c[a:b], w_k).view(b - a, h, nope)
        v = F.linear(c[a:b], w_v).view(b - a, h, dv)
        part = chunk_attention(q_nope, q_pe, k_nope, k_pe[a:b], v, q_pos, k_pos[a:b], scale,
                               q_lo=q_lo)
        out, lse = part if a == 0 else merge_partials(out, lse, *part)
    return out, lse


def absorb_q(q_nope: torch.Tensor, q_pe: torch.Tensor, w: AttnWeights) -> torch.Tensor:
    """Query in latent space, ``[T, Hl, kv_lora + rope]``: ``q_nope @ W_UK`` then ``q_pe``."""
    return torch.cat([torch.einsum("thn,hnc->thc", q_nope, w.w_uk), q_pe], -1)


def decode_attention(
    q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token's heads ``q [H, L]`` over latents ``kv [N, L]``.

    Returns ``(out [H, kv_lora] fp32, lse [H] fp32)``; with no tokens (a DCP rank that holds no
    chunk yet) the output is 0 and the LSE ``-inf``, which the LSE merge weighs as nothing.
    """
    out, lse = latent_attention(q.unsqueeze(0), kv, kv_lora_rank, scale)
    return out[0], lse[0]


def latent_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed queries ``q [T, H, L]`` over latents ``kv [N, L]``; ``mask [T, N]`` (True =
    visible) for causal chunks. Returns ``(out [T, H, kv_lora] fp32, lse [T, H] fp32)``; a
    query that sees no token gets output 0 and LSE ``-inf``."""
    t, h = q.shape[0], q.shape[1]
    if kv.shape[0] == 0:
        return (
            torch.zeros(t, h, kv_lora_rank, dtype=torch.float32, device=q.device),
            torch.full((t, h), float("-inf"), dtype=torch.float32, device=q.device),
        )
    if kv.dtype != torch.float32 and not has_fp32_out_mm(kv.device):
        q, kv = q.float(), kv.float()  # widen once here rather than inside both products
    scores = (_mm_fp32(q.reshape(t * h, -1), kv.T) * scale).view(t, h, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0)
    out = _mm_fp32(p.view(t * h, -1).to(kv.dtype), kv[:, :kv_lora_rank])
    return out.view(t, h, kv_lora_rank), lse


_FP32_OUT_MM: dict[str, bool] = {}


def has_fp32_out_mm(device: torch.device) -> bool:
    """Whether bf16 matmuls can return fp32 directly (CUDA ``out_dtype``): bf16-rounded
    attention scores would cost ~1% of softmax weight per score, and widening the cache in
    memory would double the bytes decode reads."""
    key = str(device)
    if key not in _FP32_OUT_MM:
        ok = False
        if device.type == "cuda":
            try:
                one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
                torch.mm(one, one, out_dtype=torch.float32)
                ok = True
            except (RuntimeError, TypeError, NotImplementedError):
                pass
        _FP32_OUT_MM[key] = ok
    return _FP32_OUT_MM[key]


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.float32:
        return a @ b
    return torch.mm(a, b, out_dtype=torch.float32)


def unabsorb_v(out_latent: torch.Tensor, w: AttnWeights) -> torch.Tensor:
    """Latent attention output ``[..., Hl, kv_lora]`` to per-head values ``[..., Hl, v]``."""
    return torch.einsum("...hc,hvc->...hv", out_latent, w.w_uv)
