"""The Llama-3 family against closed forms, Meta's published sizes and JAX itself (an
imported flax Llama of the same shape: `tests/backends/test_third_party_models.py`)."""

from __future__ import annotations

import numpy as np
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


def test_llama_forward_equals_the_same_model_in_jax():
    """The built-in graph lowered to JAX against a direct jax.numpy Llama on the same
    weights: the loss to float32 rounding (RoPE, GQA, RMSNorm, SwiGLU all checked)."""
    import jax
    import jax.numpy as jnp

    from alpasim.backends import lower_graph, random_leaves

    _, cfg = resolve_model(TINY)
    fwd = forward_graph(TINY)
    leaves = random_leaves(fwd, seed=3, scale=0.5)
    (loss,) = fwd.outputs
    got = float(lower_graph(fwd)(leaves)[loss])
    h, g, r, d = cfg.hidden, cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.hidden // cfg.heads
    p = {t.name: jnp.asarray(leaves[t.name]) for t in fwd.params}
    ids, labels = leaves["token_ids"], leaves["labels"]
    inv = 1.0 / cfg.rope_theta ** (np.arange(d // 2) * 2.0 / d)
    ang = np.outer(np.arange(cfg.seq), inv)
    cos, sin = np.cos(ang), np.sin(ang)

    def norm(x, w):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w

    def rope(x):   # (b, s, ..., d)
        c = cos.reshape((1, cfg.seq) + (1,) * (x.ndim - 3) + (d // 2,))
        s = sin.reshape(c.shape)
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    x = p["embed/wte"][ids]
    mask = np.tril(np.ones((cfg.seq, cfg.seq), bool))
    for i in range(cfg.layers):
        w = {k.split("/", 1)[1]: v for k, v in p.items() if k.startswith(f"layer{i}/")}
        y = norm(x, w["attn_norm/scale"])
        q = rope(jnp.einsum("bsh,hgrd->bsgrd", y, w["w_q"]))
        k = rope(jnp.einsum("bsh,hgd->bsgd", y, w["w_k"]))
        v = jnp.einsum("bsh,hgd->bsgd", y, w["w_v"])
        att = jnp.where(mask, jnp.einsum("bqgrd,bkgd->bgrqk", q, k) / np.sqrt(d), -jnp.inf)
        o = jnp.einsum("bgrqk,bkgd->bqgrd", jax.nn.softmax(att, -1), v)
        x = x + jnp.einsum("bsgrd,grdh->bsh", o, w["w_o"])
        y = norm(x, w["ffn_norm/scale"])
        x = x + (jax.nn.silu(y @ w["w_gate"]) * (y @ w["w_up"])) @ w["w_down"]
    logits = norm(x, p["head/final_norm/scale"]) @ p["head/w_head"]
    logp = jax.nn.log_softmax(logits, -1)
    want = -float(jnp.take_along_axis(logp, labels[..., None], -1).mean())
    assert got == pytest.approx(want, rel=1e-5)
    assert (h, g * r * d) == (64, 64)
