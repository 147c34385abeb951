"""Forward graph of a fine-grained mixture-of-experts decoder (Mixtral, DeepSeek-MoE).

The Llama block of `_llama` (RMSNorm, grouped-query attention with RoPE) with its
SwiGLU feed-forward replaced, after the first `dense_layers` blocks, by

* a router ``GSM,ME->GSE`` and softmax over E routed experts, tokens taken in groups
  of S (`group_size`, shrunk to a divisor of the batch's tokens);
* top-k routing with capacity C = ceil(capacity_pct / 100 * k * S / E) per expert and
  group (`topk_gating`: the i-th choices of all tokens queue before the (i+1)-th; with
  `normalize_topk` the kept weights are rescaled to sum to one, as Mixtral does;
  DeepSeek-V2 keeps the softmax's own);
* dispatch ``GSEC,GSM->EGCM``, each expert a SwiGLU of `expert_ffn`
  (``EGCM,EMH->EGCH`` for gate and up, ``EGCH,EHM->GECM`` down), combine
  ``GSEC,GECM->GSM``: sharding E is expert parallelism, G data parallelism;
* `shared_experts` always-on experts (DeepSeek-MoE), one SwiGLU of
  shared_experts * expert_ffn applied to every token and added.

Mixtral-8x7B (Jiang et al. 2024): 8 experts, top-2, no shared expert, 46.7e9
parameters. DeepSeek-V2-Lite (DeepSeek-AI 2024): 64 routed experts, top-6, two shared,
the first block dense; "-like" here because its multi-head latent attention is
replaced by plain multi-head attention (16 KV heads), which has 3 M more parameters a
layer than MLA's low-rank projections: 15.8e9 against the published 15.7e9.

Parameters: 2Vh + L (2hnd + 2hgd + 2h) + h + dense layers 3h f_dense + MoE layers
(hE + 3Eh f_e + 3h (shared f_e)).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._builder import GraphBuilder
from ._llama import check_decoder, decoder_lm, silu_mul, swiglu
from ._transformer import routing_group_size
from ._types import OpGraph


@dataclass(frozen=True, slots=True)
class TopKMoEConfig:
    """Fine-grained MoE family. `batch` is the global batch in sequences."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0
    dense_layers: int = 0
    dense_ffn: int = 0
    seq: int = 4096
    vocab: int = 32000
    batch: int = 512
    group_size: int = 4096
    capacity_pct: int = 125
    normalize_topk: int = 1
    rope_theta: int = 1000000
    dtype: str = "bfloat16"
    attention: str = "explicit"

    def __post_init__(self) -> None:
        check_decoder(self, ("experts", "top_k", "expert_ffn", "group_size", "capacity_pct"),
                      ("shared_experts", "dense_layers", "dense_ffn"))
        if self.normalize_topk not in (0, 1):
            raise ValueError(f"topk-moe: normalize_topk must be 0 or 1, got {self.normalize_topk!r}")
        if self.top_k > self.experts:
            raise ValueError(f"topk-moe: top_k={self.top_k} exceeds the {self.experts} experts")
        if self.dense_layers > self.layers:
            raise ValueError(f"topk-moe: dense_layers={self.dense_layers} exceeds layers={self.layers}")
        if self.dense_layers and not self.dense_ffn:
            raise ValueError("topk-moe: dense_layers needs dense_ffn (their SwiGLU size)")

    @property
    def family(self) -> str:
        return "topk-moe"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens_per_group(self) -> int:
        """S: the routing group size, shrunk (to a divisor) when the batch has fewer tokens."""
        return routing_group_size(self.batch * self.seq, self.group_size)

    @property
    def capacity(self) -> int:
        """C: each expert's slots per group, capacity_pct of its share of k S choices."""
        return max(1, -(-self.capacity_pct * self.top_k * self.tokens_per_group // (100 * self.experts)))


def _routed_experts(b: GraphBuilder, x: str, cfg: TopKMoEConfig) -> str:
    h, f, e, dt = cfg.hidden, cfg.expert_ffn, cfg.experts, cfg.dtype
    s, c = cfg.tokens_per_group, cfg.capacity
    g = cfg.batch * cfg.seq // s
    with b.scope(tags=("moe",)):
        tokens = b.one("reshape", [x], name="group_tokens", shape=(g, s, h))
        logits = b.einsum("GSM,ME->GSE", tokens, b.param("w_router", (h, e), dt, tp="replicated"), name="router")
        probs = b.one("softmax", [logits], name="router_softmax", axis=-1)
        combine, dispatch = b.apply("topk_gating", [probs], name="topk_gating", out_names=["combine", "dispatch"],
                                    k=cfg.top_k, capacity=c, normalize=bool(cfg.normalize_topk))
        xe = b.einsum("GSEC,GSM->EGCM", dispatch, tokens, name="dispatch")
        w_gate = b.param("w_expert_gate", (e, h, f), dt, tp=("column", 2), expert=True)
        gate = b.einsum("EGCM,EMH->EGCH", xe, w_gate, name="expert_gate")
        w_up = b.param("w_expert_up", (e, h, f), dt, tp=("column", 2), expert=True)
        up = b.einsum("EGCM,EMH->EGCH", xe, w_up, name="expert_up")
        act = silu_mul(b, gate, up)
        w_down = b.param("w_expert_down", (e, f, h), dt, tp=("row", 1), expert=True)
        ye = b.einsum("EGCH,EHM->GECM", act, w_down, name="expert_down")
        y = b.einsum("GSEC,GECM->GSM", combine, ye, name="combine")
        return b.one("reshape", [y], name="ungroup_tokens", shape=(cfg.batch, cfg.seq, h))


def _feed_forward(b: GraphBuilder, x: str, layer: int, cfg: TopKMoEConfig) -> str:
    if layer < cfg.dense_layers:
        return swiglu(b, x, cfg.dense_ffn, cfg.dtype)
    y = _routed_experts(b, x, cfg)
    if cfg.shared_experts:
        y = b.ew("add", y, swiglu(b, x, cfg.shared_experts * cfg.expert_ffn, cfg.dtype, prefix="shared_"),
                 name="with_shared")
    return y


def topk_moe_lm(cfg: TopKMoEConfig, name: str) -> OpGraph:
    """Forward graph of a fine-grained MoE language model ending in the mean loss."""
    return decoder_lm(cfg, name, lambda b, x, i: _feed_forward(b, x, i, cfg))
