"""DeepSeek-V3's MTP module against transformers on checkpoints the tests write.

transformers has no MTP module, but its decoder layer, final norm and LM head are the MTP
module's block and shared head: the oracle is a one-layer transformers DeepseekV3 holding the
MTP layer's tensors, fed ``inputs_embeds = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])``
computed here by hand (the three lines of DeepSeek's module that transformers lacks).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from model_fixtures import FP32_TOL, V3_BASE, V3_GROUPED, max_diff, write_v3_checkpoint
from safetensors.torch import load_file, save_file

from pdd_sidecar.model.config import ConfigError, load_config
from pdd_sidecar.model.mtp import has_mtp, load_mtp_weights, mtp_reference_logits
from pdd_sidecar.model.rank_model import load_rank_model
from pdd_sidecar.model.weights import open_source

pytestmark = pytest.mark.dataplane

LAYERS = V3_GROUPED["num_hidden_layers"]
MTP = f"model.layers.{LAYERS}."
T = 24


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A V3 checkpoint of ``LAYERS`` layers plus one MTP module: the module's decoder layer is
    the extra layer of a ``LAYERS + 1``-layer transformers model; its own tensors are random."""
    full = tmp_path_factory.mktemp("v3-plus-one")
    write_v3_checkpoint(full, {**V3_GROUPED, "num_hidden_layers": LAYERS + 1}, seed=7)
    state = load_file(str(full / "model.safetensors"))
    cfg = json.loads((full / "config.json").read_text())
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(11)
    state.update({
        MTP + "enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        MTP + "hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        MTP + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5,
        MTP + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=g),
        MTP + "shared_head.head.weight": torch.randn(vocab, h, generator=g) / h**0.5,
        MTP + "embed_tokens.weight": torch.randn(vocab, h, generator=g),
    })
    out = tmp_path_factory.mktemp("v3-mtp")
    cfg.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(out / "model.safetensors"))
    return out, state


def _oracle(state: dict[str, torch.Tensor], hidden: torch.Tensor, nxt: torch.Tensor,
            pos: torch.Tensor, tmp: Path) -> torch.Tensor:
    cfg = transformers.DeepseekV3Config(**V3_BASE, **{**V3_GROUPED, "num_hidden_layers": 1,
                                                        "first_k_dense_replace": 0})
    renamed = {"shared_head.norm.weight": "model.norm.weight",
               "shared_head.head.weight": "lm_head.weight",
               "embed_tokens.weight": "model.embed_tokens.weight"}
    one = {}
    for name, t in state.items():
        if not name.startswith(MTP):
            continue
        rest = name.removeprefix(MTP)
        if rest in renamed:
            one[renamed[rest]] = t
        elif rest not in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            one["model.layers.0." + rest] = t
    cfg.save_pretrained(tmp)
    save_file(one, str(tmp / "model.safetensors"))
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    eps = cfg.rms_norm_eps
    e = F.embedding(nxt, state[MTP + "embed_tokens.weight"])
    e[pos == 0] = 0
    x = torch.cat([_rms(e, state[MTP + "enorm.weight"], eps),
                   _rms(hidden, state[MTP + "hnorm.weight"], eps)], -1)
    x = F.linear(x, state[MTP + "eh_proj.weight"])
    with torch.no_grad():
        out = model(inputs_embeds=x[None], position_ids=pos[None], use_cache=False)
    return out.logits[0].float()


@pytest.mark.parametrize("start", [0, 5], ids=["from-position-0", "from-position-5"])
def test_mtp_matches_transformers_block(mtp_checkpoint, start, tmp_path):
    path, state = mtp_checkpoint
    cfg = load_config(path)
    src = open_source(path, cfg, seed=0)
    assert has_mtp(cfg, src)
    w = load_mtp_weights(cfg, src, rank=0, tp=1, dtype=torch.float32, device="cpu")
    model = load_rank_model(path)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, cfg.hidden_size, generator=g)
    nxt = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    pos = torch.arange(start, start + T)
    got = mtp_reference_logits(w, cfg, model.rotary, hidden, nxt, pos)
    want = _oracle(state, hidden, nxt, pos, tmp_path)
    print(f"mtp vs transformers block, start {start}: max |dlogit| {max_diff(got, want):.2e}")
    assert max_diff(got, want) <= FP32_TOL
    assert float(want.std()) > 0.1  # logits spread enough that a wrong input would show


def test_mtp_tp_shares_sum_to_the_whole(mtp_checkpoint):
    """Each TP rank holds its heads and expert slices of the module, like a main layer."""
    path, _ = mtp_checkpoint
    cfg = load_config(path)
    src = open_source(path, cfg, seed=0)
    whole = load_mtp_weights(cfg, src, 0, 1, torch.float32, "cpu")
    parts = [load_mtp_weights(cfg, src, r, 2, torch.float32, "cpu") for r in range(2)]
    assert torch.equal(torch.cat([p.layer.attn.w_uk for p in parts]), whole.layer.attn.w_uk)
    assert torch.equal(torch.cat([p.layer.attn.o_proj for p in parts], 1),
                       whole.layer.attn.o_proj)
    assert whole.layer.moe is not None and parts[0].layer.moe is not None
    assert parts[0].layer.moe.w_gate.shape[1] * 2 == whole.layer.moe.w_gate.shape[1]
    assert torch.equal(parts[1].eh_proj, whole.eh_proj)


def test_main_model_still_skips_the_module(mtp_checkpoint, caplog):
    path, _ = mtp_checkpoint
    with caplog.at_level(logging.INFO, logger="pdd_sidecar.model.weights"):
        m = load_rank_model(path)
    assert len(m.weights.layers) == LAYERS
    assert f"skipping 1 multi-token-prediction layer(s) (model.layers.{LAYERS})" in caplog.text


def test_declared_but_absent_module_is_refused(tmp_path, mtp_checkpoint):
    path, state = mtp_checkpoint
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v for k, v in state.items() if "eh_proj" not in k},
              str(tmp_path / "model.safetensors"))
    cfg = load_config(tmp_path)
    src = open_source(tmp_path, cfg, seed=0)
    assert not has_mtp(cfg, src)
    with pytest.raises(ConfigError, match=r"model\.layers\.4\.eh_proj\.weight"):
        load_mtp_weights(cfg, src, 0, 1, torch.float32, "cpu")


def test_v2_has_no_module():
    cfg = load_config("builtin")
    assert not has_mtp(cfg, open_source("builtin", cfg, seed=0))
    with pytest.raises(ConfigError, match="no MTP module at depth 0"):
        load_mtp_weights(cfg, open_source("builtin", cfg, seed=0), 0, 1, torch.float32, "cpu")
