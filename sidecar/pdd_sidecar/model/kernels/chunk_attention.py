"""Attention of a prompt chunk's queries over expanded keys and values (the MHA form of MLA),
returning the output and its log-sum-exp: the continuing-chunk path of chunked prefill.

Contract: ``q_nope [M, H, Dn]``, ``q_pe [M, H, Dr]`` (roped); ``k_nope [N, H, Dn]`` and
``v [N, H, Dv]`` up-projected from the cached latent; ``k_pe [N, Dr]``, the roped key shared by
every head; ``q_pos [M]`` and ``k_pos [N]`` absolute positions, ``k_pos`` ascending (storage
order; under DCP a rank's keys skip the other ranks' blocks). Query ``i`` sees key ``j`` iff
``k_pos[j] <= q_pos[i]``, and, given ``q_lo [M]``, also ``q_lo[i] <= k_pos[j]``: a segment start
per query, so several fresh prompts concatenated into one token range (positions their global
index in the step) attend block-diagonally and causally in one call. Scores are
``(q_nope . k_nope + q_pe . k_pe) * scale``. Returns ``(out [M, H, Dv] fp32, lse [M, H] fp32,
natural log)``; a query that sees no key gets output 0 and LSE ``-inf``, which an LSE merge (over
DCP ranks or context slices) weighs as nothing.

The torch reference runs on the CPU (and is what the Triton kernel is tested against): it walks
the keys in slices with an online merge by LSE, so scores never exist for the whole context at
once. On CUDA the Triton kernel is a flash-attention forward: one program per (query tile,
head), keys in tiles, fp32 accumulation; tiles every query of the tile sees skip the mask, and
the loop stops at the last key the tile's latest query sees (bounds found on the device from the
ascending ``k_pos``, so no host sync); with ``q_lo`` the loop also starts at the tile's
earliest segment start, and only tiles inside every query's window run unmasked.
"""

from __future__ import annotations

from typing import Any

import torch

from pdd_sidecar.model.kernels.pow2 import next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # machines without a GPU may have no Triton: the reference serves them
    HAS_TRITON = False
else:
    HAS_TRITON = True

LOG2E = 1.4426950408889634
REF_SCORE_ELEMS = 1 << 24  # fp32 scores the reference holds per slice (64 MiB)


def _check(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_lo: torch.Tensor | None = None,
) -> None:
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"q_nope [M, H, Dn] and q_pe [M, H, Dr] disagree: "
                         f"{tuple(q_nope.shape)}, {tuple(q_pe.shape)}")
    m, h, dn = q_nope.shape
    dr = q_pe.shape[2]
    n = k_nope.shape[0]
    if k_nope.shape != (n, h, dn):
        raise ValueError(f"k_nope must be [N, {h}, {dn}], got {tuple(k_nope.shape)}")
    if k_pe.shape != (n, dr):
        raise ValueError(f"k_pe must be [{n}, {dr}], got {tuple(k_pe.shape)}")
    if v.dim() != 3 or v.shape[:2] != (n, h):
        raise ValueError(f"v must be [{n}, {h}, Dv], got {tuple(v.shape)}")
    if q_pos.shape != (m,) or k_pos.shape != (n,):
        raise ValueError(f"q_pos must be [{m}] and k_pos [{n}], got {tuple(q_pos.shape)}, "
                         f"{tuple(k_pos.shape)}")
    if q_lo is not None and q_lo.shape != (m,):
        raise ValueError(f"q_lo must be [{m}], got {tuple(q_lo.shape)}")


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over the union of two disjoint key sets from each one's ``(out, lse)``;
    ``out [..., D]``, ``lse [...]``; a side with LSE ``-inf`` weighs nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.nan_to_num(torch.exp(lse_a - lse), nan=0.0)
    wb = torch.nan_to_num(torch.exp(lse_b - lse), nan=0.0)
    return out_a * wa[..., None] + out_b * wb[..., None], lse


def chunk_attention_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    slice_keys: int | None = None,
    q_lo: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 arithmetic over key slices of ``slice_keys`` (default: what ``REF_SCORE_ELEMS``
    scores allow), each slice's softmax merged into the running one by LSE. ``k_pos`` need not
    be sorted here."""
    _check(q_nope, q_pe, k_nope, k_pe, v, q_pos, k_pos, q_lo)
    m, h, _ = q_nope.shape
    n, dv = v.shape[0], v.shape[2]
    out = torch.zeros(m, h, dv, dtype=torch.float32, device=q_nope.device)
    lse = torch.full((m, h), float("-inf"), dtype=torch.float32, device=q_nope.device)
    if m == 0 or n == 0:
        return out, lse
    step = slice_keys or max(1, REF_SCORE_ELEMS // (m * h))
    qn, qr = q_nope.float(), q_pe.float()
    for a in range(0, n, step):
        b = min(n, a + step)
        s = torch.einsum("mhd,nhd->mhn", qn, k_nope[a:b].float())
        s += torch.einsum("mhd,nd->mhn", qr, k_pe[a:b].float())
        s *= scale
        hidden = k_pos[a:b][None, :] > q_pos[:, None]
        if q_lo is not None:
            hidden |= k_pos[a:b][None, :] < q_lo[:, None]
        s.masked_fill_(hidden[:, None, :], float("-inf"))
        lse_s = torch.logsumexp(s, dim=-1)
        p = torch.nan_to_num(torch.exp(s - lse_s[..., None]), nan=0.0)
        out_s = torch.einsum("mhn,nhv->mhv", p, v[a:b].float())
        out, lse = merge_partials(out, lse, out_s, lse_s)
    return out, lse


def chunk_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    q_lo: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA, the torch reference elsewhere (see the module's contract)."""
    if q_nope.is_cuda and HAS_TRITON:
        return chunk_attention_triton(q_nope, q_pe, k_nope, k_pe, v, q_pos, k_pos, scale,
                                      q_lo=q_lo)
    return chunk_attention_ref(q_nope, q_pe, k_nope, k_pe, v, q_pos, k_pos, scale, q_lo=q_lo)


# --- Triton -----------------------------------------------------------------------------------

# Tunables, tried in order until one fits the device (shared memory, registers), then kept per
# device, dtype and head dims. Head dims 192 (qk) and 128 (v) in bf16 at 128 x 64 tiles and 2
# stages need about 130 KiB; fp32 (tests) may need the smaller ones.
CONFIGS: list[dict[str, int]] = [
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
    {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1},
]
_CHOSEN: dict[tuple[Any, ...], int] = {}
_TOO_BIG: tuple[type[Exception], ...] = ()
if HAS_TRITON:
    _errors = triton.runtime.errors
    _TOO_BIG = (_errors.OutOfResources,) + tuple(
        e for e in (getattr(_errors, "PTXASError", None),) if isinstance(e, type))
LAST_LAUNCH: dict[str, Any] = {}  # the last launch's config and compiled kernel (for the bench)


def tile_bounds(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    block_m: int,
    block_n: int,
    q_lo: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per query tile, key indices ``[start, full_lo, full_hi, end]`` (``[4, tiles]`` int32):
    the loop runs from the first key any query of the tile sees (rounded down to a key tile)
    to past the last one; ``[full_lo, full_hi)``, whole key tiles every query sees, runs
    unmasked (``full_lo == full_hi == end`` when there is none). All rest on ``k_pos``
    ascending."""
    m = q_pos.shape[0]
    tiles = -(-m // block_m)
    pad = tiles * block_m - m
    big = 1 << 62  # above any position; F.pad takes its value through a double

    def per_tile(t: torch.Tensor, fill: int, least: bool) -> torch.Tensor:
        t = torch.nn.functional.pad(t.to(torch.int64), (0, pad), value=fill).view(tiles, block_m)
        return t.amin(1) if least else t.amax(1)

    qmin, qmax = per_tile(q_pos, big, True), per_tile(q_pos, -1, False)
    kp = k_pos.to(torch.int64).contiguous()
    full_hi = torch.searchsorted(kp, qmin, right=True) // block_n * block_n
    end = torch.searchsorted(kp, qmax, right=True)
    if q_lo is None:
        start = torch.zeros_like(end)
        full_lo = start
    else:
        lo_min, lo_max = per_tile(q_lo, big, True), per_tile(q_lo, -big, False)
        start = torch.searchsorted(kp, lo_min) // block_n * block_n
        full_lo = -(-torch.searchsorted(kp, lo_max) // block_n) * block_n
    none = full_lo >= full_hi
    full_lo = torch.where(none, end, full_lo)
    full_hi = torch.where(none, end, full_hi)
    return torch.stack([start, full_lo, full_hi, end]).to(torch.int32)


def chunk_attention_triton(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    config: dict[str, int] | None = None,
    q_lo: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``config`` (block_m, block_n, num_warps, num_stages) pins the launch; by default the
    first of ``CONFIGS`` that compiles on this device for these head dims and dtype."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not importable")
    _check(q_nope, q_pe, k_nope, k_pe, v, q_pos, k_pos, q_lo)
    if not scale > 0:
        raise ValueError(f"scale must be > 0 (the kernel scales row maxima), got {scale}")
    m, h, dn = q_nope.shape
    dr, n, dv = q_pe.shape[2], v.shape[0], v.shape[2]
    dt = k_nope.dtype
    if m == 0 or n == 0:
        return (torch.zeros(m, h, dv, dtype=torch.float32, device=q_nope.device),
                torch.full((m, h), float("-inf"), dtype=torch.float32, device=q_nope.device))
    out = torch.empty(m, h, dv, dtype=torch.float32, device=q_nope.device)  # every row stored
    lse = torch.empty(m, h, dtype=torch.float32, device=q_nope.device)

    def inner(t: torch.Tensor) -> torch.Tensor:
        t = t.to(dt)
        return t if t.stride(-1) == 1 else t.contiguous()

    qn, qr, kn, kr, vv = (inner(t) for t in (q_nope, q_pe, k_nope, k_pe, v))
    qp = q_pos.to(torch.int32).contiguous()
    kp = k_pos.to(torch.int32).contiguous()
    lo = None if q_lo is None else q_lo.to(torch.int32).contiguous()
    key = (q_nope.device, dt, dn, dr, dv)
    if config is not None:
        return _launch(qn, qr, kn, kr, vv, qp, kp, lo, out, lse, scale, config)
    first = _CHOSEN.get(key, 0)
    for i in range(first, len(CONFIGS)):
        try:
            res = _launch(qn, qr, kn, kr, vv, qp, kp, lo, out, lse, scale, CONFIGS[i])
        except _TOO_BIG:
            if i + 1 == len(CONFIGS):
                raise
            continue
        _CHOSEN[key] = i
        return res
    raise AssertionError("unreachable")


def _launch(
    qn: torch.Tensor,
    qr: torch.Tensor,
    kn: torch.Tensor,
    kr: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_lo: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    config: dict[str, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    m, h, dn = qn.shape
    dr, n, dv = qr.shape[2], v.shape[0], v.shape[2]
    bm, bn = config["block_m"], config["block_n"]
    bounds = tile_bounds(q_pos, k_pos, bm, bn, q_lo)
    tiles = bounds.shape[1]
    LAST_LAUNCH["config"] = config
    kernel: Any = _chunk_attn_fwd
    LAST_LAUNCH["fwd"] = kernel[(tiles, h)](
        qn, qr, kn, kr, v, q_pos, q_pos if q_lo is None else q_lo, k_pos, bounds, out, lse,
        scale * LOG2E,
        qn.stride(0), qn.stride(1), qr.stride(0), qr.stride(1),
        kn.stride(0), kn.stride(1), kr.stride(0), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        m, n, tiles,
        DN=dn, DR=dr, DV=dv, DN_P2=next_pow2(dn), DR_P2=next_pow2(dr), DV_P2=next_pow2(dv),
        BLOCK_M=bm, BLOCK_N=bn, IEEE=kn.dtype == torch.float32, HAS_LO=q_lo is not None,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip
    return out, lse


if HAS_TRITON:

    @triton.jit
    def _rows(ptrs, live, offs_d, D: tl.constexpr, D_P2: tl.constexpr, MASKED: tl.constexpr):
        """A tile of rows; masks only where rows may run past the keys or dims are padded, so
        the unmasked tiles load without predicates."""
        if MASKED:
            if D == D_P2:
                t = tl.load(ptrs, mask=live[:, None], other=0.0)
            else:
                t = tl.load(ptrs, mask=live[:, None] & (offs_d < D)[None, :], other=0.0)
        else:
            if D == D_P2:
                t = tl.load(ptrs)
            else:
                t = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0.0)
        return t

    @triton.jit
    def _key_tile(
        acc, m_i, l_i, qn, qr, q_pos, q_lo,
        KN, KR, V, KPOS,
        n0, n_keys, h,
        stride_kn_n, stride_kn_h, stride_kr_n, stride_v_n, stride_v_h,
        scale_log2,
        DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
        DN_P2: tl.constexpr, DR_P2: tl.constexpr, DV_P2: tl.constexpr,
        BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
        HAS_LO: tl.constexpr,
    ):  # fmt: skip
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_dn = tl.arange(0, DN_P2)
        offs_dr = tl.arange(0, DR_P2)
        offs_dv = tl.arange(0, DV_P2)
        rows = offs_n.to(tl.int64)
        live = offs_n < n_keys
        kn = _rows(KN + rows[:, None] * stride_kn_n + h * stride_kn_h + offs_dn[None, :],
                   live, offs_dn, DN, DN_P2, MASKED)
        kr = _rows(KR + rows[:, None] * stride_kr_n + offs_dr[None, :],
                   live, offs_dr, DR, DR_P2, MASKED)
        if IEEE:
            qk = tl.dot(qn, tl.trans(kn), input_precision="ieee")
            qk += tl.dot(qr, tl.trans(kr), input_precision="ieee")
        else:
            qk = tl.dot(qn, tl.trans(kn))
            qk += tl.dot(qr, tl.trans(kr))
        if MASKED:
            k_pos = tl.load(KPOS + offs_n, mask=live, other=2147483647)
            seen = k_pos[None, :] <= q_pos[:, None]
            if HAS_LO:
                seen = seen & (k_pos[None, :] >= q_lo[:, None])
            qk = tl.where(seen, qk, float("-inf"))
        # the scale (> 0) applied to the row maxima, then fused into the exponent's argument
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(qk * scale_log2 - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = _rows(V + rows[:, None] * stride_v_n + h * stride_v_h + offs_dv[None, :],
                   live, offs_dv, DV, DV_P2, MASKED)
        if IEEE:
            pv = tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        else:
            pv = tl.dot(p.to(vt.dtype), vt)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_i

    # Lengths are not specialized on (Triton would compile a variant per divisibility of each:
    # a step shape first seen under load then paid a compile, measured ~1 s on an H200).
    @triton.jit(do_not_specialize=["n_queries", "n_keys", "n_tiles"])
    def _chunk_attn_fwd(
        QN, QR, KN, KR, V, QPOS, QLO, KPOS, BOUNDS, OUT, LSE,
        scale_log2,
        stride_qn_m, stride_qn_h, stride_qr_m, stride_qr_h,
        stride_kn_n, stride_kn_h, stride_kr_n, stride_v_n, stride_v_h,
        stride_o_m, stride_o_h, stride_l_m, stride_l_h,
        n_queries, n_keys, n_tiles,
        DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
        DN_P2: tl.constexpr, DR_P2: tl.constexpr, DV_P2: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        HAS_LO: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n_queries
        offs_dn = tl.arange(0, DN_P2)
        offs_dr = tl.arange(0, DR_P2)
        offs_dv = tl.arange(0, DV_P2)
        rows = offs_m.to(tl.int64)
        qn = tl.load(
            QN + rows[:, None] * stride_qn_m + h * stride_qn_h + offs_dn[None, :],
            mask=mask_m[:, None] & (offs_dn < DN)[None, :], other=0.0,
        )
        qr = tl.load(
            QR + rows[:, None] * stride_qr_m + h * stride_qr_h + offs_dr[None, :],
            mask=mask_m[:, None] & (offs_dr < DR)[None, :], other=0.0,
        )
        q_pos = tl.load(QPOS + offs_m, mask=mask_m, other=-1)
        if HAS_LO:
            q_lo = tl.load(QLO + offs_m, mask=mask_m, other=0)
        else:
            q_lo = q_pos
        k_start = tl.load(BOUNDS + tile)
        k_full_lo = tl.load(BOUNDS + n_tiles + tile)
        k_full_hi = tl.load(BOUNDS + 2 * n_tiles + tile)
        k_end = tl.load(BOUNDS + 3 * n_tiles + tile)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV_P2], dtype=tl.float32)
        for n0 in range(k_start, k_full_lo, BLOCK_N):
            acc, m_i, l_i = _key_tile(
                acc, m_i, l_i, qn, qr, q_pos, q_lo, KN, KR, V, KPOS, n0, n_keys, h,
                stride_kn_n, stride_kn_h, stride_kr_n, stride_v_n, stride_v_h, scale_log2,
                DN, DR, DV, DN_P2, DR_P2, DV_P2, BLOCK_N, True, IEEE, HAS_LO,
            )  # fmt: skip
        for n0 in range(k_full_lo, k_full_hi, BLOCK_N):
            acc, m_i, l_i = _key_tile(
                acc, m_i, l_i, qn, qr, q_pos, q_lo, KN, KR, V, KPOS, n0, n_keys, h,
                stride_kn_n, stride_kn_h, stride_kr_n, stride_v_n, stride_v_h, scale_log2,
                DN, DR, DV, DN_P2, DR_P2, DV_P2, BLOCK_N, False, IEEE, HAS_LO,
            )  # fmt: skip
        for n0 in range(k_full_hi, k_end, BLOCK_N):
            acc, m_i, l_i = _key_tile(
                acc, m_i, l_i, qn, qr, q_pos, q_lo, KN, KR, V, KPOS, n0, n_keys, h,
                stride_kn_n, stride_kn_h, stride_kr_n, stride_v_n, stride_v_h, scale_log2,
                DN, DR, DV, DN_P2, DR_P2, DV_P2, BLOCK_N, True, IEEE, HAS_LO,
            )  # fmt: skip
        has = l_i > 0
        l_safe = tl.where(has, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(
            OUT + rows[:, None] * stride_o_m + h * stride_o_h + offs_dv[None, :], o,
            mask=mask_m[:, None] & (offs_dv < DV)[None, :],
        )
        tl.store(LSE + rows * stride_l_m + h * stride_l_h, lse, mask=mask_m)


__all__ = [
    "CONFIGS",
    "HAS_TRITON",
    "chunk_attention",
    "chunk_attention_ref",
    "chunk_attention_triton",
    "merge_partials",
    "tile_bounds",
]
