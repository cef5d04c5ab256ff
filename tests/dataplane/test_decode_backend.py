"""The decode-attention backend choice (``PDD_ATTENTION_BACKEND``) and the FlashMLA adapter, on
the CPU with a stand-in ``flash_mla`` module (CI never has the wheel): triton/auto/flashmla and a
bad value; auto falls back to Triton when the wheel does not import or the GPU is not SM90, and
uses FlashMLA only at the shapes where it won; the adapter hands FlashMLA pdd's cache slice and
table unchanged and turns its bf16 output and ``[B, H, 1]`` LSE, with no answer for empty
sequences, into pdd's contract (fp32, output 0 and LSE ``-inf`` for length 0)."""

from __future__ import annotations

import logging
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from pdd_sidecar.model.kernels import decode_backend as db
from pdd_sidecar.model.kernels import flashmla_decode as fm
from pdd_sidecar.model.kernels.mla_decode import paged_mla_decode_ref

pytestmark = pytest.mark.dataplane

C, R, BS = 512, 64, 64


class FakeFlashMLA(ModuleType):
    """flash_mla's dense decode in torch, with FlashMLA's conventions: [B, 1, H, 576] bf16 in,
    bf16 out, LSE [B, H, 1], +inf LSE and NaN output for a length of 0."""

    def __init__(self) -> None:
        super().__init__("flash_mla")
        self.calls: list[dict[str, Any]] = []

    def get_mla_metadata(self) -> tuple[object, None]:
        return SimpleNamespace(), None

    def flash_mla_with_kvcache(self, q: torch.Tensor, k_cache: torch.Tensor,
                               block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                               head_dim_v: int, meta: object, **kw: Any,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append({"q": q.shape, "k": k_cache.shape, "k_stride": k_cache.stride(),
                           "table": block_table.dtype, "lens": cache_seqlens.dtype, **kw})
        b, _, h, _ = q.shape
        kv = k_cache.squeeze(2).unsqueeze(1)  # [nb, 1 layer, bs, L]
        out, lse = paged_mla_decode_ref(q.view(b, h, -1), kv, 0, block_table, cache_seqlens,
                                        head_dim_v, kw["softmax_scale"])
        empty = (cache_seqlens == 0).view(b, 1)
        lse = torch.where(empty, float("inf"), lse)
        out = torch.where(empty.unsqueeze(-1), float("nan"), out)
        return out.to(torch.bfloat16).view(b, 1, h, head_dim_v), lse.view(b, h, 1)


def _no_module(name: str) -> ModuleType:
    raise ImportError(f"No module named {name!r}")


def test_choice_and_fallbacks(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeFlashMLA()
    caplog.set_level(logging.INFO, logger=db.__name__)
    assert db.load_backend("triton", lambda _: fake).module is None
    auto = db.load_backend("auto", lambda _: fake, lambda: True)
    assert auto.module is fake and "auto: FlashMLA" in caplog.text
    assert db.load_backend("auto", _no_module, lambda: True).module is None
    assert "does not import" in caplog.text
    assert db.load_backend("auto", lambda _: fake, lambda: False).module is None
    with pytest.raises(RuntimeError, match="PDD_ATTENTION_BACKEND=flashmla: flash_mla does not"):
        db.load_backend("flashmla", _no_module, lambda: True)
    with pytest.raises(RuntimeError, match="SM90"):
        db.load_backend("flashmla", lambda _: fake, lambda: False)
    with pytest.raises(ValueError, match="PDD_ATTENTION_BACKEND 'fast' is not one of"):
        db.load_backend("fast")


def test_env_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(db.ENV, "triton")
    db.set_current(None)
    try:
        assert db.current().choice == "triton"
        monkeypatch.setenv(db.ENV, "flashmla")
        assert db.current().choice == "triton"
    finally:
        db.set_current(None)


def test_auto_uses_flashmla_only_where_it_wins() -> None:
    fake = FakeFlashMLA()
    auto = db.DecodeBackend("auto", fake)
    forced = db.DecodeBackend("flashmla", fake)
    bf16 = torch.empty(2, 2, BS, C + R, dtype=torch.bfloat16, device="meta")
    fp8 = torch.empty(2, 2, BS, 656, dtype=torch.uint8, device="meta")

    def q(b: int, h: int) -> Any:  # only its shape and device are read
        return SimpleNamespace(shape=(b, h, C + R), is_cuda=True)

    assert not auto.use_flashmla(q(1, 16), bf16, C)
    assert not auto.use_flashmla(q(128, 16), bf16, C), "16 heads: Triton won at every batch"
    assert auto.use_flashmla(q(1, db.FLASHMLA_MIN_HEADS), bf16, C)
    assert not auto.use_flashmla(q(1, db.FLASHMLA_MIN_HEADS), fp8, C)
    assert forced.use_flashmla(q(1, 16), bf16, C)
    assert not forced.use_flashmla(q(64, 16), fp8, C), "FP8 caches stay on Triton"
    small_blocks = torch.empty(2, 2, 16, C + R, dtype=torch.bfloat16, device="meta")
    assert not forced.use_flashmla(q(64, 16), small_blocks, C)
    off_gpu = SimpleNamespace(shape=(64, 16, C + R), is_cuda=False)
    assert not forced.use_flashmla(off_gpu, bf16, C)  # type: ignore[arg-type]


def test_adapter_keeps_pdds_contract() -> None:
    g = torch.Generator().manual_seed(0)
    layers, nb, h = 2, 9, 4
    kv = (torch.randn(nb, layers, BS, C + R, generator=g) * 0.3).to(torch.bfloat16)
    tables = torch.tensor([[3, 5, 1], [7, 2, 8], [4, 4, 4]], dtype=torch.int64)
    lens = torch.tensor([100, 0, 64], dtype=torch.int64)
    q = torch.randn(3, h, C + R, generator=g).to(torch.bfloat16)
    fake = FakeFlashMLA()
    out, lse = fm.flashmla_decode(fake, q, kv, 1, tables, lens, C, 0.1)
    want_o, want_l = paged_mla_decode_ref(q, kv, 1, tables, lens, C, 0.1)
    call = fake.calls[0]
    assert call["q"] == (3, 1, h, C + R) and call["k"] == (nb, BS, 1, C + R)
    assert call["k_stride"][0] == layers * BS * (C + R), "the cache's slice, not a copy"
    assert call["table"] == torch.int32 and call["lens"] == torch.int32
    assert call["use_legacy"] and call["softmax_scale"] == 0.1
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.equal(out[1], torch.zeros(h, C)) and bool(torch.isneginf(lse[1]).all())
    assert float((out - want_o).abs().max()) < 2e-2
    assert torch.allclose(lse[[0, 2]], want_l[[0, 2]])
    with pytest.raises(ValueError, match="64-token blocks"):
        fm.flashmla_decode(fake, q, kv[:, :, :16].contiguous(), 1, tables, lens, C, 0.1)
