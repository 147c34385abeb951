"""The Llama-3 family against closed forms, Meta's published sizes and JAX itself (an
imported flax Llama of the same shape: `tests/backends/test_third_party_models.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from alpasim.graphs import (
    ZOO,
    LlamaConfig,
    ModelSpecError,
    build_training_graph,
    flops_by_kind,
    forward_graph,
    resolve_model,
)

sys.path.insert(0, str(Path(__file__).parent))
from jax_models import LlamaReference  # noqa: E402

LLAMA_NAMES = [n for n in ZOO if n.startswith("llama")]
TINY = "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,seq=16,vocab=128,batch=8,dtype=float32"


def llama_params_closed_form(c: LlamaConfig) -> int:
    """Embedding and head 2Vh; per layer Q and O 2h(nd) = 2h^2, K and V 2h(gd), SwiGLU
    3hf, two RMSNorm scales 2h; the final norm h."""
    h, g, d = c.hidden, c.kv_heads, c.hidden // c.heads
    return 2 * c.vocab * h + c.layers * (2 * h * h + 2 * h * g * d + 3 * h * c.ffn + 2 * h) + h


def llama_einsum_flops_closed_form(c: LlamaConfig, remat: bool) -> float:
    """Forward, T = B s tokens: per layer Q and O 4Th^2, K and V 4Th(gd), scores and
    context 4Tsh (causal masking is not skipped work in our kernels), SwiGLU 6Thf;
    head 2ThV. Every contraction's backward is twice its forward (both operands take a
    gradient; the embedding's is a scatter, not a contraction). Full recomputation runs
    the layers' forward once more, not the head's."""
    t, s, h, f, v = c.batch * c.seq, c.seq, c.hidden, c.ffn, c.vocab
    gd = c.kv_heads * (h // c.heads)
    layers = c.layers * (4 * t * h * h + 4 * t * h * gd + 4 * t * s * h + 6 * t * h * f)
    head = 2 * t * h * v
    return 3 * (layers + head) + (layers if remat else 0)


@pytest.mark.parametrize("name", LLAMA_NAMES)
def test_llama_params_match_the_closed_form_and_metas_sizes(name):
    _, cfg = resolve_model(name)
    got = forward_graph(f"{name}:batch=1,seq=128").num_params()
    assert got == llama_params_closed_form(cfg)
    published = {"llama3-8b": 8.03e9, "llama3-70b": 70.55e9, "llama3-405b": 405.85e9}[name]
    assert got == pytest.approx(published, rel=0.005)


@pytest.mark.parametrize("remat", [False, True])
def test_llama_einsum_flops_match_the_closed_form(remat):
    name = "llama3-8b:layers=4,batch=2,seq=512"
    _, cfg = resolve_model(name)
    einsum = flops_by_kind(build_training_graph(name, remat=remat).graph)["einsum"]
    assert einsum == pytest.approx(llama_einsum_flops_closed_form(cfg, remat), rel=1e-9)


def test_llama_spec_is_checked():
    with pytest.raises(ModelSpecError, match="kv_heads"):
        resolve_model("llama:hidden=64,heads=4,kv_heads=3,ffn=96,layers=2")
    with pytest.raises(ModelSpecError, match="even"):
        resolve_model("llama:hidden=36,heads=4,kv_heads=2,ffn=96,layers=2")


@pytest.mark.slow
def test_llama_forward_equals_the_same_model_in_jax():
    """The built-in graph lowered to JAX against a direct jax.numpy Llama on the same
    weights: the loss to float32 rounding (RoPE, GQA, RMSNorm, SwiGLU all checked)."""
    ref = LlamaReference(TINY, seed=3)

    def layers(x, weights):
        for i in range(ref.cfg.layers):
            w = weights(i)
            x = ref.attention_block(x, w)
            x = x + ref.swiglu(ref.norm(x, w["ffn_norm/scale"]), w["w_gate_proj"], w["w_up_proj"], w["w_down_proj"])
        return x
    assert ref.got == pytest.approx(ref.loss(layers), rel=1e-5)
