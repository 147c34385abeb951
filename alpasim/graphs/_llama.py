"""Forward graph of a Llama-3-style decoder: what dense training runs use today.

Written with the ops the JAX importer produces for the same model (a plain-JAX or
flax Llama: `tests/graphs/jax_models.py`), so a built-in and an imported Llama of one
shape cost alike (held in `tests/graphs/test_llama.py`):

* RMSNorm in float32: ``x * rsqrt(mean(x^2) + eps) * g`` (convert, square, mean,
  add, rsqrt, broadcast, mul, convert back, mul by the broadcast weight);
* grouped-query attention: ``n = g * r`` query heads in ``g`` groups of ``r``, each
  group sharing one key and value head. The projections are ``bsh,hgrd->bsgrd`` and
  ``bsh,hgd->bsgd``, so sharding ``g`` is Megatron's tensor parallelism over the KV
  heads, and sharding ``r`` with ``g`` whole is its replication of the KV heads when
  the tensor-parallel degree exceeds ``g``; scores ``bqgrd,bkgd->bgrqk``, causal
  softmax, context ``bgrqk,bkgd->bqgrd``, output ``bsgrd,grdh->bsh`` (no transposes
  into heads: the contractions read the projections' layout); no biases;
* rotary position embedding (RoPE, the half-split form of Llama's reference code) on
  queries and keys, its cos/sin tables computed in each layer from iotas
  (``theta^(-2j/d)`` per pair j), so no table crosses a layer or stage boundary;
* SwiGLU feed-forward: ``silu(x W_gate) * (x W_up)`` then ``W_down`` (silu as
  ``x * logistic(x)``, as `jax.nn.silu` traces);
* untied input embedding and output head, softmax cross-entropy.

Layer labels as in `_transformer`: layer i is block i, the embedding joins block 0 and
the final norm and head join the last block; head ops are tagged ``keep`` (activation
checkpointing covers the transformer layers only).

Parameters: ``2 V h + L (2 h n d + 2 h g d + 3 h f + 2 h) + h`` (embedding and head,
Q and O, K and V, the SwiGLU's three matrices, two norms; the final norm) - Llama-3 8B
is 8.03e9. Configurations are Meta's Llama 3 release (Dubey et al. 2024, Table 3).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from ._builder import GraphBuilder
from ._prims_attention import attention_core, check_attention_kernel, check_context_parallel
from ._types import OpGraph


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Llama-3 family. `batch` is the global batch in sequences; `ffn` the SwiGLU's inner size."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int = 8192
    vocab: int = 128256
    batch: int = 512
    rope_theta: int = 500000
    dtype: str = "bfloat16"
    attention: str = "explicit"
    # One rank's view of a context-parallel run (`context_parallel_view`): `seq` is its
    # chunk of each sequence and `batch` counts chunks; attention's keys span
    # `context_parallel` chunks. 1: a whole-sequence model.
    context_parallel: int = 1

    def __post_init__(self) -> None:
        check_decoder(self, ("ffn",))
        check_context_parallel(self)

    @property
    def family(self) -> str:
        return "llama"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


RMS_EPS = 1e-5
DECODER_FIELDS = ("hidden", "layers", "heads", "kv_heads", "seq", "vocab", "batch", "rope_theta")


def check_decoder(cfg, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """The checks of a `decoder_lm` config: `DECODER_FIELDS` and `positive` positive
    integers, `non_negative` integers >= 0, heads dividing hidden and KV heads dividing
    heads, an even head size (RoPE rotates pairs), a floating dtype."""
    for key in (*DECODER_FIELDS, *positive, *non_negative):
        v, least = getattr(cfg, key), 0 if key in non_negative else 1
        if not isinstance(v, int) or v < least:
            raise ValueError(f"{cfg.family}: {key} must be a {'non-negative' if least == 0 else 'positive'} "
                             f"integer, got {v!r}")
    if cfg.hidden % cfg.heads:
        raise ValueError(f"{cfg.family}: hidden={cfg.hidden} is not divisible by heads={cfg.heads}")
    if cfg.heads % cfg.kv_heads:
        raise ValueError(f"{cfg.family}: heads={cfg.heads} is not divisible by kv_heads={cfg.kv_heads}")
    if (cfg.hidden // cfg.heads) % 2:
        raise ValueError(f"{cfg.family}: the head size {cfg.hidden // cfg.heads} must be even (RoPE rotates pairs)")
    if cfg.dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"{cfg.family}: dtype must be float16, bfloat16 or float32, got {cfg.dtype!r}")
    check_attention_kernel(cfg)


def rms_norm(b: GraphBuilder, x: str, dt: str, name: str) -> str:
    """RMSNorm over the last axis, computed in float32 and cast back."""
    shape = b.shape(x)
    axis = len(shape) - 1
    with b.scope(prefix=f"{b.prefix}{name}/"):
        xf = b.one("convert", [x], name="upcast", dtype="float32") if dt != "float32" else x
        ms = b.one("reduce", [b.ew("square", xf, name="square")], name="mean_square", kind="mean", axes=(axis,))
        inv = b.ew("rsqrt", b.ew("add", ms, name="eps", scalar=RMS_EPS), name="rsqrt")
        y = b.ew("mul", xf, b.one("broadcast", [inv], name="inv_b", shape=shape, dims=tuple(range(axis))),
                 name="normed")
        y = b.one("convert", [y], name="downcast", dtype=dt) if dt != "float32" else y
        g = b.param("scale", (shape[-1],), dt, tp="replicated")
        return b.ew("mul", y, b.one("broadcast", [g], name="scale_b", shape=shape, dims=(axis,)), name="scaled")


def _rope_tables(b: GraphBuilder, cfg) -> tuple[str, str]:
    """cos and sin of the rotation angles, (seq, head_dim / 2), from iotas."""
    half = cfg.head_dim // 2
    shape = (cfg.seq, half)
    pos = b.one("iota", [], name="rope_pos", shape=shape, dtype="float32", dimension=0)
    j = b.one("iota", [], name="rope_pair", shape=shape, dtype="float32", dimension=1)
    # theta^(-2j/d) = exp(j * (-2 ln(theta) / d))
    freq = b.ew("exp", b.ew("mul", j, name="rope_exponent", scalar=-2.0 * math.log(cfg.rope_theta) / cfg.head_dim),
                name="rope_freq")
    angle = b.ew("mul", pos, freq, name="rope_angle")
    return b.ew("cos", angle, name="rope_cos"), b.ew("sin", angle, name="rope_sin")


def _rope(b: GraphBuilder, x: str, cos: str, sin: str, name: str) -> str:
    """Rotate each (x1, x2) pair of the head's halves of x (batch, seq, ..., head_dim):
    (x1 c - x2 s, x2 c + x1 s)."""
    shape, dt = b.shape(x), b.dtype(x)
    rank, half = len(shape), shape[-1] // 2
    with b.scope(prefix=f"{b.prefix}{name}/"):
        start, mid, end = (0,) * rank, (*shape[:-1], half), shape
        x1 = b.one("slice", [x], name="x1", start=start, limit=mid)
        x2 = b.one("slice", [x], name="x2", start=(0,) * (rank - 1) + (half,), limit=end)
        hshape = (*shape[:-1], half)

        def table(t: str, tag: str) -> str:
            t = b.one("convert", [t], name=f"{tag}_cast", dtype=dt) if dt != "float32" else t
            return b.one("broadcast", [t], name=f"{tag}_b", shape=hshape, dims=(1, rank - 1))

        c, s = table(cos, "cos"), table(sin, "sin")
        y1 = b.ew("sub", b.ew("mul", x1, c, name="x1c"), b.ew("mul", x2, s, name="x2s"), name="y1")
        y2 = b.ew("add", b.ew("mul", x2, c, name="x2c"), b.ew("mul", x1, s, name="x1s"), name="y2")
        return b.one("concatenate", [y1, y2], name="rotated", axis=rank - 1)


def gqa_attention(b: GraphBuilder, x: str, cfg) -> str:
    """Grouped-query attention with RoPE (module doc); `cfg` has hidden, heads, kv_heads,
    head_dim, seq, rope_theta and dtype."""
    h, g, d, dt = cfg.hidden, cfg.kv_heads, cfg.head_dim, cfg.dtype
    r = cfg.heads // g
    with b.scope(tags=("attention",)):
        cos, sin = _rope_tables(b, cfg)
        q = b.einsum("bsh,hgrd->bsgrd", x, b.param("w_q", (h, g, r, d), dt, tp=("column", 1)), name="q_proj")
        k = b.einsum("bsh,hgd->bsgd", x, b.param("w_k", (h, g, d), dt, tp=("column", 1)), name="k_proj")
        v = b.einsum("bsh,hgd->bsgd", x, b.param("w_v", (h, g, d), dt, tp=("column", 1)), name="v_proj")
        q, k = _rope(b, q, cos, sin, "q_rope"), _rope(b, k, cos, sin, "k_rope")
        ctx = attention_core(b, cfg.attention, "bqgrd,bkgd,bkgd->bqgrd", q, k, v, scores="bgrqk",
                             scale=1.0 / math.sqrt(d), causal=True,
                             context_parallel=getattr(cfg, "context_parallel", 1))
        return b.einsum("bsgrd,grdh->bsh", ctx, b.param("w_o", (g, r, d, h), dt, tp=("row", 0)), name="out_proj")


def swiglu(b: GraphBuilder, x: str, ffn: int, dt: str, prefix: str = "") -> str:
    """silu(x W_gate) * (x W_up), then W_down, on (batch, seq, hidden) activations. The
    weights are `w_gate_proj`, `w_up_proj` and `w_down_proj` (Llama's names; plain
    `w_gate` is GShard MoE's router)."""
    h = b.shape(x)[-1]
    with b.scope(tags=("mlp",)):
        w_gate = b.param(f"{prefix}w_gate_proj", (h, ffn), dt, tp=("column", 1))
        gate = b.einsum("bsh,hf->bsf", x, w_gate, name=f"{prefix}gate_proj")
        w_up = b.param(f"{prefix}w_up_proj", (h, ffn), dt, tp=("column", 1))
        up = b.einsum("bsh,hf->bsf", x, w_up, name=f"{prefix}up_proj")
        act = silu_mul(b, gate, up)
        w_down = b.param(f"{prefix}w_down_proj", (ffn, h), dt, tp=("row", 0))
        return b.einsum("bsf,fh->bsh", act, w_down, name=f"{prefix}down_proj")


def silu_mul(b: GraphBuilder, gate: str, up: str) -> str:
    """silu(gate) * up, silu as `jax.nn.silu` traces: gate * logistic(gate)."""
    silu = b.ew("mul", gate, b.ew("logistic", gate, name="sigmoid"), name="silu")
    return b.ew("mul", silu, up, name="swiglu")


def llama_lm(cfg: LlamaConfig, name: str) -> OpGraph:
    """Forward graph of a Llama-3-style language model ending in the mean loss."""
    return decoder_lm(cfg, name, lambda b, x, i: swiglu(b, x, cfg.ffn, cfg.dtype))


def decoder_lm(cfg, name: str, feed_forward: Callable[[GraphBuilder, str, int], str]) -> OpGraph:
    """A pre-norm decoder of `gqa_attention` and `feed_forward(b, x, layer)` blocks between
    an untied embedding and head; `cfg` as `gqa_attention`'s plus layers, vocab, batch."""
    bsz, s, h, dt = cfg.batch, cfg.seq, cfg.hidden, cfg.dtype
    b = GraphBuilder(name)
    ids = b.input("token_ids", (bsz, s), "int32")
    labels = b.input("labels", (bsz, s), "int32")
    with b.scope(layer=0, tags=("embedding",), prefix="embed/"):
        x = b.one("embedding", [b.param("wte", (cfg.vocab, h), dt, tp=("vocabulary", 0)), ids], name="token_embedding")
    for i in range(cfg.layers):
        with b.scope(layer=i, prefix=f"layer{i}/"):
            x = b.ew("add", x, gqa_attention(b, rms_norm(b, x, dt, "attn_norm"), cfg), name="residual_attn")
            x = b.ew("add", x, feed_forward(b, rms_norm(b, x, dt, "ffn_norm"), i), name="residual_ffn")
    with b.scope(layer=cfg.layers - 1, tags=("head",), prefix="head/"):
        x = rms_norm(b, x, dt, "final_norm")
        with b.scope(tags=("keep",)):
            w_head = b.param("w_head", (h, cfg.vocab), dt, tp=("vocabulary", 1))
            logits = b.einsum("bsh,hv->bsv", x, w_head, name="logits")
            loss = b.one("softmax_cross_entropy", [logits, labels], name="loss")
    return b.build([loss], meta={"family": cfg.family, "dtype": dt, "config": dataclasses.asdict(cfg)})
