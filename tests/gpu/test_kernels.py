"""GPU kernels against their torch references (run by hand on a CUDA machine; skipped without
one): the Triton paged MLA decode, the grouped-GEMM MoE and the fused prefill attention.

    PYTHONPATH=sidecar python -m pytest tests/gpu/test_kernels.py -q
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from pdd_sidecar.engine.rank_engine import (  # noqa: E402
    batch_continuing_chunks as _batch_continuing_chunks,
)
from pdd_sidecar.model.config import ModelConfig  # noqa: E402
from pdd_sidecar.model.kernels import mla_decode as md  # noqa: E402
from pdd_sidecar.model.kernels.moe_grouped import (  # noqa: E402
    can_group,
    grouped_experts,
    loop_experts,
)
from pdd_sidecar.model.mla import prefill_attention  # noqa: E402
from pdd_sidecar.model.moe import moe  # noqa: E402
from pdd_sidecar.model.weights import AttnWeights, MLPWeights, MoEWeights  # noqa: E402

DEV = torch.device("cuda")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Any synchronising call inside raises (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _decode_case(
    lens: list[int], h: int, c: int, r: int, bs: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    layers = 3
    need = sum(max(1, -(-n // bs)) for n in lens) + 8
    kv = torch.randn(need, layers, bs, c + r, device=DEV, generator=g).to(dtype)
    perm = torch.randperm(need, device=DEV, generator=g).tolist()
    width = max(max(1, -(-n // bs)) for n in lens) + 2
    rows = []
    for n in lens:
        k = max(1, -(-n // bs))
        ids = [perm.pop() for _ in range(k)]
        rows.append(ids + [perm[0]] * (width - k))  # padding points at live foreign data
    table = torch.tensor(rows, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), h, c + r, device=DEV, generator=g).to(dtype)
    return q, kv, table, torch.tensor(lens, dtype=torch.int32, device=DEV)


LENS = [0, 1, 63, 64, 65, 1000, 4097, 0, 300]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("h", "c", "r", "bs"),
    [(16, 512, 64, 64), (16, 512, 64, 16), (8, 512, 64, 64), (32, 512, 64, 32), (8, 32, 8, 16)],
)
def test_triton_decode_matches_reference(
    dtype: torch.dtype, h: int, c: int, r: int, bs: int, splits: int | None = None
) -> None:
    q, kv, table, lens = _decode_case(LENS, h, c, r, bs, dtype, seed=h + c + bs)
    scale = 0.1
    out, lse = md.paged_mla_decode_triton(q, kv, 1, table, lens, c, scale, num_splits=splits)
    # fp32 reference from widened inputs: the kernel's bf16 rounding of p is its only loss
    ref_out, ref_lse = md.paged_mla_decode_ref(q.float(), kv.float(), 1, table, lens, c, scale)
    assert out.shape == (len(LENS), h, c) and lse.shape == (len(LENS), h)
    empty = lens == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.isneginf(lse[empty]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[~empty]).all()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(out[~empty], ref_out[~empty]) < tol
    assert float((lse[~empty] - ref_lse[~empty]).abs().max()) < 10 * tol


@pytest.mark.parametrize("splits", [1, 7])
def test_triton_decode_forced_splits(splits: int) -> None:
    test_triton_decode_matches_reference(torch.bfloat16, 16, 512, 64, 64, splits)


def test_triton_decode_dispatch_and_no_host_sync() -> None:
    q, kv, table, lens = _decode_case(LENS, 16, 512, 64, 64, torch.bfloat16, seed=1)
    md.paged_mla_decode(q, kv, 0, table, lens, 512, 0.1)  # compile outside the check
    with no_host_sync():
        out, lse = md.paged_mla_decode(q, kv, 0, table, lens, 512, 0.1)
    ref_out, _ = md.paged_mla_decode_ref(q, kv, 0, table, lens, 512, 0.1)
    assert rel_err(out, ref_out) < 1e-2


def test_triton_decode_replays_in_a_cuda_graph_with_new_lengths() -> None:
    q, kv, table, lens = _decode_case(LENS, 16, 512, 64, 64, torch.bfloat16, seed=2)
    md.paged_mla_decode(q, kv, 2, table, lens, 512, 0.1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        md.paged_mla_decode(q, kv, 2, table, lens, 512, 0.1)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = md.paged_mla_decode(q, kv, 2, table, lens, 512, 0.1)
    new_lens = torch.tensor([5, 0, 64, 1, 100, 999, 4000, 17, 0], dtype=torch.int32, device=DEV)
    lens.copy_(new_lens)
    q.copy_(torch.randn_like(q))
    table.copy_(table.flip(0))
    graph.replay()
    ref_out, ref_lse = md.paged_mla_decode_ref(q, kv, 2, table, lens, 512, 0.1)
    assert rel_err(out, ref_out) < 1e-2
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))


def _moe_weights(e: int, hidden: int, inter: int, dtype: torch.dtype) -> MoEWeights:
    g = torch.Generator(device=DEV).manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=DEV, generator=g) / shape[-1] ** 0.5).to(dtype)

    return MoEWeights(
        router=torch.randn(e, hidden, device=DEV, generator=g),
        w_gate=w(e, inter, hidden),
        w_up=w(e, inter, hidden),
        w_down=w(e, hidden, inter),
        shared=MLPWeights(
            gate=w(2 * inter, hidden), up=w(2 * inter, hidden), down=w(hidden, 2 * inter)
        ),
    )


@pytest.mark.parametrize("gemv", [True, False, None])
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
def test_grouped_moe_matches_loop(tokens: int, gemv: bool | None) -> None:
    e, k, hidden, inter = 16, 6, 256, 128
    w = _moe_weights(e, hidden, inter, torch.bfloat16)
    x = torch.randn(tokens, hidden, device=DEV).to(torch.bfloat16)
    assert can_group(x, w), "torch._grouped_mm should serve bf16 on this GPU"
    weights = torch.rand(tokens, k, device=DEV)
    ids = torch.stack([torch.randperm(e, device=DEV)[:k] for _ in range(tokens)])
    grouped_experts(x, weights, ids, w, gemv)
    with no_host_sync():
        got = grouped_experts(x, weights, ids, w, gemv)
    want = loop_experts(x.float(), weights, ids, _as_float(w))
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2


def _as_float(w: MoEWeights) -> MoEWeights:
    return MoEWeights(w.router, w.w_gate.float(), w.w_up.float(), w.w_down.float(), None)


def test_moe_dispatches_to_grouped_on_cuda() -> None:
    cfg = ModelConfig(
        vocab_size=16,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        moe_intermediate_size=128,
        n_routed_experts=16,
        n_shared_experts=2,
        num_experts_per_tok=6,
    )
    w = _moe_weights(16, 256, 128, torch.bfloat16)
    x = torch.randn(37, 256, device=DEV).to(torch.bfloat16)
    moe(x, w, cfg)
    with no_host_sync():
        got = moe(x, w, cfg)
    wf = _as_float(w)
    assert w.shared is not None
    wf.shared = MLPWeights(w.shared.gate.float(), w.shared.up.float(), w.shared.down.float())
    want = moe(x.float(), wf, cfg)  # fp32: can_group is False, the loop runs
    assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("t", [1, 17, 300, 2048])
def test_prefill_attention_fused_matches_reference(t: int) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hl, nope, rope, v, c = 16, 128, 64, 128, 512
    cfg = ModelConfig(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=hl,
        kv_lora_rank=c,
        q_lora_rank=None,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
    )
    g = torch.Generator(device=DEV).manual_seed(t)
    w_uk = torch.randn(hl, nope, c, device=DEV, generator=g) / c**0.5
    w_uv = torch.randn(hl, v, c, device=DEV, generator=g) / c**0.5
    q_nope = torch.randn(t, hl, nope, device=DEV, generator=g)
    q_pe = torch.randn(t, hl, rope, device=DEV, generator=g)
    latent = torch.randn(t, c + rope, device=DEV, generator=g)

    def attn(dtype: torch.dtype) -> AttnWeights:
        z = torch.zeros(1, device=DEV)
        return AttnWeights(
            q_proj=z, q_a_proj=None, q_a_bias=None, q_a_norm=None, q_b_proj=None,
            kv_a_proj=z, kv_a_bias=None, kv_a_norm=z,
            w_uk=w_uk.to(dtype), w_uv=w_uv.to(dtype), o_proj=z, o_bias=None,
        )  # fmt: skip

    bf = torch.bfloat16
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        got = prefill_attention(q_nope.to(bf), q_pe.to(bf), latent.to(bf), attn(bf), cfg)
    with sdpa_kernel([SDPBackend.MATH]):
        want = prefill_attention(q_nope, q_pe, latent, attn(torch.float32), cfg)
    assert got.shape == (t, hl, v)
    assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rope_kernels_match_references(dtype: torch.dtype) -> None:
    """The shapes of V2-Lite: hidden rows, kv_a's latent part (a strided view), the rope part
    of q (16 heads of 128 + 64) and of kv_a; dispatched to Triton on CUDA, no host sync, and
    captured in a graph."""
    from pdd_sidecar.model.kernels import norm_rope as nr

    torch.manual_seed(0)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    x = torch.randn(64, 2048, device=DEV, dtype=dtype)
    w = (1 + 0.1 * torch.randn(2048, device=DEV)).to(dtype)
    kv = torch.randn(64, 576, device=DEV, dtype=dtype)
    wk = (1 + 0.1 * torch.randn(512, device=DEV)).to(dtype)
    q = torch.randn(64, 16, 192, device=DEV, dtype=dtype)
    angles = torch.rand(64, 32, device=DEV) * 1000
    cos, sin = torch.cos(angles), torch.sin(angles)
    lat, qpe, kpe = (lambda: kv[:, :512]), (lambda: q[..., 128:]), (lambda: kv[:, 512:])
    cases = [
        (lambda: nr.rms_norm(x, w, 1e-6), lambda: nr.rms_norm_ref(x, w, 1e-6)),
        (lambda: nr.rms_norm(lat(), wk, 1e-6), lambda: nr.rms_norm_ref(lat(), wk, 1e-6)),
        (lambda: nr.apply_rope(qpe(), cos, sin), lambda: nr.apply_rope_ref(qpe(), cos, sin)),
        (lambda: nr.apply_rope(kpe(), cos, sin), lambda: nr.apply_rope_ref(kpe(), cos, sin)),
    ]
    for fast, ref in cases:
        with no_host_sync():
            got = fast()
        assert rel_err(got, ref()) < tol
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fast()
        x.normal_(), kv.normal_(), q.normal_()
        graph.replay()
        assert rel_err(out, ref()) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", [0, 1, 2, None], ids=["128x64", "64x64", "32x32", "default"])
@pytest.mark.parametrize(("m", "n_ctx", "dcp_rank"), [(300, 1000, None), (1000, 4099, 1)])
def test_chunk_attention_matches_reference(
    dtype: torch.dtype, config: int | None, m: int, n_ctx: int, dcp_rank: int | None
) -> None:
    """V2-Lite's head dims (qk 128 + 64, v 128): a chunk at the end of a context, dense or a
    DCP rank's blocks (64-token blocks, dcp 2), every launch config; no host sync."""
    from pdd_sidecar.model.kernels import chunk_attention as ca

    if dtype == torch.float32 and config is not None:
        pytest.skip("fp32 takes the first config that fits (the larger tiles may not)")
    g = torch.Generator(device=DEV).manual_seed(m + n_ctx)
    h, dn, dr, dv = 16, 128, 64, 128
    k_pos = torch.arange(n_ctx, device=DEV)
    if dcp_rank is not None:
        k_pos = k_pos[(k_pos // 64) % 2 == dcp_rank]
    n = k_pos.shape[0]
    q_pos = torch.arange(n_ctx - m, n_ctx, device=DEV)
    qn, qr = (torch.randn(m, h, d, device=DEV, generator=g).to(dtype) for d in (dn, dr))
    kn = torch.randn(n, h, dn, device=DEV, generator=g).to(dtype)
    kr = torch.randn(n, dr, device=DEV, generator=g).to(dtype)
    v = torch.randn(n, h, dv, device=DEV, generator=g).to(dtype)
    cfg = None if config is None else ca.CONFIGS[config]
    ca.chunk_attention_triton(qn, qr, kn, kr, v, q_pos, k_pos, 0.07, cfg)  # compile first
    with no_host_sync():
        out, lse = ca.chunk_attention_triton(qn, qr, kn, kr, v, q_pos, k_pos, 0.07, cfg)
    want_out, want_lse = ca.chunk_attention_ref(
        qn.float(), qr.float(), kn.float(), kr.float(), v.float(), q_pos, k_pos, 0.07)
    assert out.shape == (m, h, dv) and lse.shape == (m, h)
    assert torch.isfinite(out).all()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(out, want_out) < tol
    assert float((lse[fin] - want_lse[fin]).abs().max()) < 10 * tol


VARLEN_SEGMENTS = {"64x32": [32] * 64, "ragged": [1, 5, 16, 33, 300, 1000, 7, 129, 64]}


def _segment_starts(lengths: list[int]) -> torch.Tensor:
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    return torch.repeat_interleave(starts, torch.tensor(lengths)).to(DEV)


@pytest.mark.parametrize("config", [0, 1, 2, None], ids=["128x64", "64x64", "32x32", "default"])
@pytest.mark.parametrize("segments", list(VARLEN_SEGMENTS), ids=list(VARLEN_SEGMENTS))
def test_varlen_chunk_attention_matches_reference(config: int | None, segments: str) -> None:
    """Fresh prompts concatenated, each attending causally over itself (``q_lo``, the segment
    start per query), in bf16 with V2-Lite's head dims, every launch config; no host sync."""
    from pdd_sidecar.model.kernels import chunk_attention as ca

    lengths = VARLEN_SEGMENTS[segments]
    t = sum(lengths)
    g = torch.Generator(device=DEV).manual_seed(t)
    h, dn, dr, dv = 16, 128, 64, 128
    bf = torch.bfloat16
    qn, qr = (torch.randn(t, h, d, device=DEV, generator=g).to(bf) for d in (dn, dr))
    kn = torch.randn(t, h, dn, device=DEV, generator=g).to(bf)
    kr = torch.randn(t, dr, device=DEV, generator=g).to(bf)
    v = torch.randn(t, h, dv, device=DEV, generator=g).to(bf)
    pos, lo = torch.arange(t, device=DEV), _segment_starts(lengths)
    cfg = None if config is None else ca.CONFIGS[config]
    ca.chunk_attention_triton(qn, qr, kn, kr, v, pos, pos, 0.07, cfg, q_lo=lo)  # compile
    with no_host_sync():
        out, lse = ca.chunk_attention_triton(qn, qr, kn, kr, v, pos, pos, 0.07, cfg, q_lo=lo)
    want_out, want_lse = ca.chunk_attention_ref(
        qn.float(), qr.float(), kn.float(), kr.float(), v.float(), pos, pos, 0.07, q_lo=lo)
    assert out.shape == (t, h, dv) and torch.isfinite(lse).all()
    assert rel_err(out, want_out) < 1e-2
    assert float((lse - want_lse).abs().max()) < 0.1


@pytest.mark.parametrize("segments", list(VARLEN_SEGMENTS), ids=list(VARLEN_SEGMENTS))
def test_varlen_prefill_attention_equals_each_prompt(segments: str) -> None:
    """The engine's batched fresh path on CUDA (bf16, the kernel) against each prompt through
    ``prefill_attention`` in fp32."""
    from pdd_sidecar.model import mla
    from pdd_sidecar.model.kernels import chunk_attention as ca

    lengths = VARLEN_SEGMENTS[segments]
    t = sum(lengths)
    hl, nope, rope, v, c = 16, 128, 64, 128, 512
    cfg = ModelConfig(
        vocab_size=16, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=hl, kv_lora_rank=c, q_lora_rank=None, qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=v,
    )  # fmt: skip
    g = torch.Generator(device=DEV).manual_seed(t + 1)
    w_uk = torch.randn(hl, nope, c, device=DEV, generator=g) / c**0.5
    w_uv = torch.randn(hl, v, c, device=DEV, generator=g) / c**0.5
    q_nope = torch.randn(t, hl, nope, device=DEV, generator=g)
    q_pe = torch.randn(t, hl, rope, device=DEV, generator=g)
    latent = torch.randn(t, c + rope, device=DEV, generator=g)

    def attn(dtype: torch.dtype) -> AttnWeights:
        z = torch.zeros(1, device=DEV)
        return AttnWeights(
            q_proj=z, q_a_proj=None, q_a_bias=None, q_a_norm=None, q_b_proj=None,
            kv_a_proj=z, kv_a_bias=None, kv_a_norm=z,
            w_uk=w_uk.to(dtype), w_uv=w_uv.to(dtype), o_proj=z, o_bias=None,
        )  # fmt: skip

    bf = torch.bfloat16
    ca.LAST_LAUNCH.clear()
    got = mla.varlen_prefill_attention(q_nope.to(bf), q_pe.to(bf), latent.to(bf),
                                       _segment_starts(lengths), attn(bf), cfg)
    assert "fwd" in ca.LAST_LAUNCH and got.dtype == bf and got.shape == (t, hl, v)
    a, want = 0, []
    for n in lengths:
        want.append(prefill_attention(q_nope[a:a + n], q_pe[a:a + n], latent[a:a + n],
                                      attn(torch.float32), cfg))
        a += n
    assert rel_err(got, torch.cat(want)) < 2e-2


def test_chunk_prefill_attention_dispatches_to_the_kernel() -> None:
    """The engine's entry point on CUDA runs the kernel over sliced expansions and matches the
    CPU path (the reference) on the same inputs."""
    from pdd_sidecar.model import mla
    from pdd_sidecar.model.kernels import chunk_attention as ca

    g = torch.Generator(device=DEV).manual_seed(5)
    h, nope, rope, dv, c, n, m = 16, 128, 64, 128, 512, 3000, 700
    w_uk = (torch.randn(h, nope, c, device=DEV, generator=g) / c**0.5).bfloat16()
    w_uv = (torch.randn(h, dv, c, device=DEV, generator=g) / c**0.5).bfloat16()
    latent = torch.randn(n, c + rope, device=DEV, generator=g).bfloat16()
    qn = torch.randn(m, h, nope, device=DEV, generator=g).bfloat16()
    qr = torch.randn(m, h, rope, device=DEV, generator=g).bfloat16()
    q_pos, k_pos = torch.arange(n - m, n, device=DEV), torch.arange(n, device=DEV)
    ca.LAST_LAUNCH.clear()
    old = mla.EXPANDED_SLICE_BYTES
    mla.EXPANDED_SLICE_BYTES = 1000 * h * (nope + dv) * 2  # three slices
    try:
        out, lse = mla.chunk_prefill_attention(qn, qr, latent, q_pos, k_pos, w_uk, w_uv, 0.07)
    finally:
        mla.EXPANDED_SLICE_BYTES = old
    assert "fwd" in ca.LAST_LAUNCH
    cpu = [t.cpu() for t in (qn, qr, latent, q_pos, k_pos, w_uk, w_uv)]
    want_out, want_lse = mla.chunk_prefill_attention(*cpu, 0.07)
    assert rel_err(out.cpu(), want_out) < 1e-2
    assert float((lse.cpu() - want_lse).abs().max()) < 0.1


@pytest.mark.parametrize("shared", [False, True], ids=["own-blocks", "shared-prefix"])
def test_continuing_chunks_batched_equal_each_chunk_alone(shared: bool) -> None:
    """The engine's batched continuing path on CUDA (bf16: three prefix-cache-hit-like
    suffixes over cached contexts in one kernel call per layer, key slices merged by LSE; with
    ``shared``, their tables start with the same 16 cached blocks, attended once) against the
    same step with each chunk attending alone."""
    from pdd_sidecar.engine import rank_engine as re_
    from pdd_sidecar.engine.comm import SingleComm
    from pdd_sidecar.engine.seq_chunk import SeqChunk
    from pdd_sidecar.model import mla
    from pdd_sidecar.model.rank_model import load_rank_model

    model = load_rank_model("builtin", 0, 1, "bfloat16", "cuda")
    seqs = [(300, 45), (264, 30), (517, 3)]  # (cached tokens, new tokens)
    prompts = [[(i * 37 + s * 11 + 5) % 256 for i in range(a + b)]
               for s, (a, b) in enumerate(seqs)]
    outs, caches = [], []
    old = mla.EXPANDED_SLICE_BYTES
    mla.EXPANDED_SLICE_BYTES = 200 * 8 * 32 * 2  # several slices across sequence boundaries
    try:
        for batched in (False, True):
            eng = re_.RankEngine(model, re_.new_cache(model, 256, 16), SingleComm())
            if shared:
                pre = eng.cache.allocate(16)
                tables = [pre + eng.cache.allocate(-(-len(p) // 16) - 16) for p in prompts]
                for p in prompts[1:]:
                    p[:256] = prompts[0][:256]
                eng.step([SeqChunk(prompts[0][:256], 0, tables[0])])
                for (k, _), p, t in zip(seqs, prompts, tables, strict=True):
                    eng.step([SeqChunk(p[256:k], 256, t)])
            else:
                tables = [re_.allocate_request(eng.cache, len(p), 1) for p in prompts]
                for (k, _), p, t in zip(seqs, prompts, tables, strict=True):
                    eng.step([SeqChunk(p[:k], 0, t)])
            re_.batch_continuing_chunks = (lambda n, d, t: n >= 2) if batched \
                else (lambda n, d, t: False)
            out = eng.step([SeqChunk(p[k:], k, t)
                            for (k, _), p, t in zip(seqs, prompts, tables, strict=True)])
            assert out is not None
            outs.append(out)
            caches.append(eng.cache.kv.clone())
    finally:
        mla.EXPANDED_SLICE_BYTES = old
        re_.batch_continuing_chunks = _batch_continuing_chunks
    assert rel_err(outs[1], outs[0]) < 2e-2
    assert rel_err(caches[1].float(), caches[0].float()) < 2e-2
