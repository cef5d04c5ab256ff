"""DeepSeek-V3's multi-token-prediction (MTP) module: its weights and a torch reference.

V3-family checkpoints carry ``num_nextn_predict_layers`` extra modules after the main layers
(``model.layers.{num_hidden_layers + k}.``): ``enorm`` and ``hnorm`` (RMSNorms), ``eh_proj``
(``2 * hidden -> hidden``), one decoder layer of the main model's shape, and a shared head
(``shared_head.norm``, ``shared_head.head``) with its own ``embed_tokens`` copy. For position
``i`` the module reads the main model's final (normed) hidden state ``h_i`` and the embedding of
the token at ``i + 1`` and predicts the token at ``i + 2``: a draft for speculative decoding that
costs one layer instead of the model.

The module is loaded through the main layers' own loader: a source that presents the MTP
tensors under the names of a one-layer model (``model.layers.0.``, ``model.embed_tokens``,
``model.norm``, ``lm_head``), so TP slicing, FP8 block dequantization and fused-expert layouts
are the main model's, not a second copy of them. The input order of ``eh_proj``
(``[embedding, hidden]``) and the zeroed embedding at position 0 are what vLLM and SGLang run
DeepSeek's released MTP weights with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdd_sidecar.model.config import ConfigError, ModelConfig
from pdd_sidecar.model.kernels.norm_rope import rms_norm
from pdd_sidecar.model.mla import prefill_attention, project_latent, project_q
from pdd_sidecar.model.moe import dense_mlp, moe
from pdd_sidecar.model.rank_model import RankModel
from pdd_sidecar.model.rope import Rotary
from pdd_sidecar.model.weights import (
    LayerWeights,
    RankWeights,
    TensorSource,
    load_rank_weights,
    open_source,
)

_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
_RENAMED = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "shared_head.norm.weight",
    "lm_head.weight": "shared_head.head.weight",
}


def mtp_prefix(cfg: ModelConfig, depth: int = 0) -> str:
    return f"model.layers.{cfg.num_hidden_layers + depth}."


def has_mtp(cfg: ModelConfig, src: TensorSource) -> bool:
    """The checkpoint declares an MTP module and holds its tensors (quantized releases and
    trimmed test checkpoints may declare one and ship none)."""
    return cfg.num_nextn_predict_layers > 0 and src.has(mtp_prefix(cfg) + "eh_proj.weight")


class _ModuleAsModel:
    """The MTP tensors of one depth under the names of a one-layer model."""

    def __init__(self, inner: TensorSource, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix

    def _name(self, name: str) -> str:
        if name in _RENAMED:
            return self.prefix + _RENAMED[name]
        if name.startswith("model.layers.0."):
            return self.prefix + name.removeprefix("model.layers.0.")
        return name

    def has(self, name: str) -> bool:
        return self.inner.has(self._name(name))

    def names(self) -> list[str]:
        back = {v: k for k, v in _RENAMED.items()}
        out = []
        for n in self.inner.names():
            rest = n.removeprefix(self.prefix)
            if rest == n or rest in _OWN:
                continue
            out.append(back.get(rest, "model.layers.0." + rest))
        return out

    def get(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.inner.get(self._name(name), dim, start, stop)


@dataclass
class MTPWeights:
    enorm: torch.Tensor  # [hidden]
    hnorm: torch.Tensor  # [hidden]
    eh_proj: torch.Tensor  # [hidden, 2 * hidden]: input [embedding, hidden]
    layer: LayerWeights
    embed: torch.Tensor
    norm: torch.Tensor  # shared_head.norm
    head: torch.Tensor  # shared_head.head
    layer_config: ModelConfig  # the main config as a one-layer model whose layer is this one


def load_mtp_weights(
    cfg: ModelConfig,
    src: TensorSource,
    rank: int,
    tp: int,
    dtype: torch.dtype,
    device: str | torch.device,
    depth: int = 0,
) -> MTPWeights:
    """One rank's share of the MTP module at ``depth``, sliced like a main layer."""
    if not 0 <= depth < cfg.num_nextn_predict_layers:
        raise ConfigError(
            f"num_nextn_predict_layers is {cfg.num_nextn_predict_layers}: no MTP module at "
            f"depth {depth}"
        )
    prefix = mtp_prefix(cfg, depth)
    missing = [prefix + n for n in _OWN if not src.has(prefix + n)]
    if missing:
        raise ConfigError(f"checkpoint declares an MTP module but has no {', '.join(missing)}")
    moe_layer = cfg.is_moe_layer(cfg.num_hidden_layers + depth)
    one = dataclasses.replace(
        cfg,
        num_hidden_layers=1,
        first_k_dense_replace=0 if moe_layer else 1,
        moe_layer_freq=1,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    )
    view = _ModuleAsModel(src, prefix)
    w = load_rank_weights(one, view, rank, tp, dtype, torch.device(device))

    def own(name: str) -> torch.Tensor:
        return src.get(prefix + name).to(device=device, dtype=dtype).contiguous()

    return MTPWeights(
        enorm=own("enorm.weight"),
        hnorm=own("hnorm.weight"),
        eh_proj=own("eh_proj.weight"),
        layer=w.layers[0],
        embed=w.embed,
        norm=w.norm,
        head=w.lm_head,
        layer_config=one,
    )


def mtp_input(
    w: MTPWeights, eps: float, hidden: torch.Tensor, next_tokens: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """The decoder layer's input: ``eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])``, the
    embedding zeroed at position 0."""
    e = F.embedding(next_tokens, w.embed)
    e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
    x = torch.cat([rms_norm(e, w.enorm, eps), rms_norm(hidden, w.hnorm, eps)], -1)
    return F.linear(x, w.eh_proj)


def mtp_reference_logits(
    w: MTPWeights,
    cfg: ModelConfig,
    rotary: Rotary,
    hidden: torch.Tensor,
    next_tokens: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Draft logits ``[T, vocab]`` for one whole sequence on one rank holding every head
    (``tp`` 1): position ``i`` gets ``h_i`` (the main model's normed final hidden state) and
    the token at ``i + 1``, and attends causally over the module's own latents of positions
    ``0..i``. The engine's paged path is checked against this."""
    lw, one = w.layer, w.layer_config
    if lw.attn.w_uk.shape[0] != cfg.num_attention_heads:
        raise ValueError("the reference runs one rank with every head (tp 1)")
    eps = cfg.rms_norm_eps
    x = mtp_input(w, eps, hidden, next_tokens, positions)
    cos, sin = rotary.cos_sin(positions)
    a = rms_norm(x, lw.input_norm, eps)
    q_nope, q_pe = project_q(a, lw.attn, one, cos, sin)
    latent = project_latent(a, lw.attn, one, cos, sin)
    o = prefill_attention(q_nope, q_pe, latent, lw.attn, one)
    x = x + F.linear(o.flatten(1), lw.attn.o_proj, lw.attn.o_bias)
    m = rms_norm(x, lw.post_norm, eps)
    if lw.moe is not None:
        x = x + moe(m, lw.moe, one)
    else:
        assert lw.mlp is not None
        x = x + dense_mlp(m, lw.mlp)
    return F.linear(rms_norm(x, w.norm, eps), w.head).float()


def load_mtp_rank_model(model: str | Path, main: RankModel, seed: int = 0
                        ) -> tuple[MTPWeights, RankModel]:
    """The MTP module of ``model`` beside its main rank model ``main`` (same rank, TP share,
    dtype, device, rotary table), as a one-layer ``RankModel`` the engine runs like the main
    one (its embedding and head are the module's; its input comes from ``mtp_input``). Refused
    with a message naming the setting and the model when the checkpoint has no module."""
    cfg = main.config
    src = open_source(model, cfg, seed)
    if not has_mtp(cfg, src):
        raise ConfigError(
            f"speculative.method: 'mtp' needs a checkpoint with an MTP module, and model "
            f"{str(model)!r} has none (num_nextn_predict_layers {cfg.num_nextn_predict_layers}"
            f"{'' if cfg.num_nextn_predict_layers == 0 else ', no ' + mtp_prefix(cfg) + 'eh_proj'}"
            f"); use method 'ngram' or a V3-family checkpoint"
        )
    w = load_mtp_weights(cfg, src, main.rank, main.tp, main.dtype, main.device)
    weights = RankWeights(embed=w.embed, layers=[w.layer], norm=w.norm, lm_head=w.head)
    return w, RankModel(w.layer_config, weights, main.rotary, main.rank, main.tp, main.dtype,
                        main.device)
