"""The fine-grained MoE family against closed forms, the published sizes and a dense
JAX evaluation of the same experts."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from alpasim.graphs import (ModelSpecError, TopKMoEConfig, build_training_graph, flops_by_kind, forward_graph,
                            resolve_model)

sys.path.insert(0, str(Path(__file__).parent))
from jax_models import LlamaReference  # noqa: E402

TINY = ("topk-moe:hidden=32,layers=3,heads=4,kv_heads=2,experts=6,top_k=3,expert_ffn=24,shared_experts=1,"
        "dense_layers=1,dense_ffn=40,seq=8,vocab=64,batch=4,group_size=16,capacity_pct=150,normalize_topk=0,"
        "dtype=float32")


def topk_moe_params_closed_form(c: TopKMoEConfig) -> int:
    """Embedding and head 2Vh; per layer attention 2h^2 + 2h(gd) and two norms 2h; the
    final norm h; dense layers' SwiGLU 3h f_dense; MoE layers' router hE, routed
    experts 3E h f_e and shared ones 3h (n_shared f_e)."""
    h, gd = c.hidden, c.kv_heads * (c.hidden // c.heads)
    moe = c.layers - c.dense_layers
    return (2 * c.vocab * h + c.layers * (2 * h * h + 2 * h * gd + 2 * h) + h + c.dense_layers * 3 * h * c.dense_ffn
            + moe * (h * c.experts + 3 * c.experts * h * c.expert_ffn + 3 * h * c.shared_experts * c.expert_ffn))


def topk_moe_einsum_flops_closed_form(c: TopKMoEConfig, remat: bool) -> float:
    """Forward, T = B s tokens in G groups with C slots an expert: attention as Llama's
    (4Th^2 + 4Th(gd) + 4Tsh a layer); dense SwiGLU 6Th f_dense; MoE router 2ThE,
    dispatch 2TECh, experts 6(GEC)h f_e, combine 2TECh, shared 6Th(n_shared f_e); head
    2ThV. Backward twice the forward, except dispatch, whose mask takes no gradient;
    full recomputation adds the layers' forward again (not the head's)."""
    t, s, h, v, e, f = c.batch * c.seq, c.seq, c.hidden, c.vocab, c.experts, c.expert_ffn
    g, cap, gd = t // c.tokens_per_group, c.capacity, c.kv_heads * (c.hidden // c.heads)
    moe = c.layers - c.dense_layers
    attention = c.layers * (4 * t * h * h + 4 * t * h * gd + 4 * t * s * h)
    dense = c.dense_layers * 6 * t * h * c.dense_ffn
    dispatch = moe * 2 * t * e * cap * h
    moe_rest = moe * (2 * t * h * e + 6 * g * e * cap * h * f + 2 * t * e * cap * h + 6 * t * h * c.shared_experts * f)
    layers = attention + dense + dispatch + moe_rest
    return 3 * (layers + 2 * t * h * v) - dispatch + (layers if remat else 0)


@pytest.mark.parametrize("name,published", [("mixtral-8x7b", 46.7e9), ("deepseek-v2-lite", 15.7e9)])
def test_params_match_the_closed_form_and_the_published_size(name, published):
    _, cfg = resolve_model(name)
    got = forward_graph(f"{name}:batch=1,seq=256").num_params()
    assert got == topk_moe_params_closed_form(cfg)
    # DeepSeek-V2-Lite's latent attention has fewer parameters than our multi-head one.
    assert got == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("name", ["mixtral-8x7b:layers=2,batch=2,seq=512,group_size=256",
                                  "deepseek-v2-lite:layers=3,batch=2,seq=512,group_size=512", TINY])
@pytest.mark.parametrize("remat", [False, True])
def test_einsum_flops_match_the_closed_form(name, remat):
    _, cfg = resolve_model(name)
    einsum = flops_by_kind(build_training_graph(name, remat=remat).graph)["einsum"]
    assert einsum == pytest.approx(topk_moe_einsum_flops_closed_form(cfg, remat), rel=1e-9)


def test_capacity_is_the_factor_times_each_experts_share_of_the_choices():
    _, cfg = resolve_model("mixtral-8x7b")
    assert cfg.tokens_per_group == 4096 and cfg.capacity == math.ceil(1.25 * 2 * 4096 / 8)
    _, cfg = resolve_model("deepseek-v2-lite:group_size=1000,batch=1,seq=4000")
    assert cfg.tokens_per_group == 1000 and cfg.capacity == math.ceil(1.25 * 6 * 1000 / 64)


def test_spec_is_checked():
    with pytest.raises(ModelSpecError, match="top_k"):
        resolve_model("topk-moe:experts=4,top_k=5")
    with pytest.raises(ModelSpecError, match="dense_ffn"):
        resolve_model("topk-moe:dense_layers=1")


@pytest.mark.slow
def test_forward_equals_a_dense_evaluation_of_the_chosen_experts():
    """The built-in graph lowered to JAX against every token's output written densely:
    each expert's SwiGLU on every token, weighted by the routing weights the (separately
    loop-checked) `topk_gating` gives, plus the shared expert; attention and norms as
    in the Llama test."""
    import jax
    import jax.numpy as jnp

    from alpasim.backends import topk_gating

    ref = LlamaReference(TINY, seed=4)
    cfg = ref.cfg

    def layers(x, weights):
        for i in range(cfg.layers):
            w = weights(i)
            x = ref.attention_block(x, w)
            y = ref.norm(x, w["ffn_norm/scale"])
            if i < cfg.dense_layers:
                x = x + ref.swiglu(y, w["w_gate_proj"], w["w_up_proj"], w["w_down_proj"])
                continue
            tokens = y.reshape(-1, cfg.tokens_per_group, cfg.hidden)
            combine, _ = topk_gating(jax.nn.softmax(tokens @ w["w_router"], -1), cfg.top_k, cfg.capacity,
                                     bool(cfg.normalize_topk))
            weight = combine.sum(-1)                                         # (G, S, E): 0 where not routed
            experts = jnp.stack([ref.swiglu(tokens, w["w_expert_gate"][e], w["w_expert_up"][e],
                                            w["w_expert_down"][e]) for e in range(cfg.experts)], 2)  # (G, S, E, h)
            routed = (weight[..., None] * experts).sum(2).reshape(y.shape)
            x = x + routed + ref.swiglu(y, w["shared_w_gate_proj"], w["shared_w_up_proj"], w["shared_w_down_proj"])
        return x
    assert ref.got == pytest.approx(ref.loss(layers), rel=1e-5)
