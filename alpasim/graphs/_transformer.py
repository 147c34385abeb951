"""Forward graphs of the paper's language models: GPT-3 and GShard MoE.

Both are pre-LN transformer stacks written the way Megatron-LM computes them, one op
per kernel that matters:

* attention: separate Q, K, V projections into heads (``bsh,hnd->bsnd``) so that
  sharding the head letter ``n`` is Megatron's tensor parallelism (the bias is added
  before the transpose to (b, n, s, d)); scores ``bnqd,bnkd->bnqk``; a fused
  scale-(causal mask)-softmax; context ``bnqk,bnkd->bnqd``; output projection ``bnsd,ndh->bsh``;
* MLP: ``bsh,hf->bsf``, GeLU, ``bsf,fh->bsh`` with biases;
* MoE feed-forward (GShard, as in Alpa's benchmark model): tokens grouped into
  G groups of S, gate ``GSM,ME->GSE`` + softmax, top-2 gating with capacity
  C = 2S/E, dispatch ``GSEC,GSM->EGCM``, experts ``EGCM,EMH->EGCH`` / ``EGCH,EHM->GECM``
  with ReLU, combine ``GSEC,GECM->GSM``; every other layer (even indices) is MoE;
* the language-model head reuses the token embedding (tied weights) and ends in a
  softmax cross-entropy. Head ops are tagged ``keep``: Megatron's activation
  checkpointing covers transformer layers only;
* with ``dropout`` p > 0 (GPT only), dropout where Megatron-LM's GPT applies it
  (`--hidden-dropout`, `--attention-dropout`, both 0.1 by default in its arguments.py):
  on the embedding's output, on the explicit attention probabilities, and on each
  block's attention and MLP output before its residual add (Megatron's fused
  bias-dropout-add). With the fused attention kernel the probabilities' dropout runs
  inside it (FlashAttention draws it from its RNG in both passes) and is not an op.

Layer labels: layer i is transformer block i; the embedding joins block 0 and the
final norm and head join the last block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._builder import GraphBuilder
from ._prims_attention import attention_core, check_attention_kernel
from ._types import OpGraph


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """GPT-3 family (Megatron-LM layout). `batch` is the global batch per iteration."""

    hidden: int
    layers: int
    heads: int
    seq: int = 1024
    vocab: int = 51200
    batch: int = 1024
    ffn_mult: int = 4
    dtype: str = "float16"
    attention: str = "explicit"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _check_transformer(self)
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"gpt3: dropout must be a probability in [0, 1), got {self.dropout!r}")

    @property
    def family(self) -> str:
        return "gpt3"


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """GShard MoE family: an MoE feed-forward in every other layer."""

    hidden: int
    layers: int
    heads: int
    experts: int
    seq: int = 1024
    vocab: int = 32000
    batch: int = 1024
    group_size: int = 2048
    ffn_mult: int = 8
    dtype: str = "float16"
    attention: str = "explicit"

    def __post_init__(self) -> None:
        _check_transformer(self)
        if self.experts < 2:
            raise ValueError(f"moe: experts must be >= 2, got {self.experts}")
        if self.group_size < 1:
            raise ValueError(f"moe: group_size must be positive, got {self.group_size}")

    @property
    def family(self) -> str:
        return "moe"

    @property
    def tokens_per_group(self) -> int:
        """S: the expert group size, shrunk (to a divisor) when the batch has fewer tokens."""
        return routing_group_size(self.batch * self.seq, self.group_size)

    @property
    def capacity(self) -> int:
        """C = 2S/E: each expert takes up to twice its fair share of a group (top-2)."""
        return max(1, 2 * self.tokens_per_group // self.experts)


def routing_group_size(tokens: int, group_size: int) -> int:
    """The tokens an MoE routes together: `group_size`, or the largest divisor of the
    batch's tokens below it (every group the same size)."""
    s = min(group_size, tokens)
    while tokens % s:
        s -= 1
    return s


def _check_transformer(cfg) -> None:
    for key in ("hidden", "layers", "heads", "seq", "vocab", "batch", "ffn_mult"):
        v = getattr(cfg, key)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{cfg.family}: {key} must be a positive integer, got {v!r}")
    if cfg.hidden % cfg.heads:
        raise ValueError(f"{cfg.family}: hidden={cfg.hidden} is not divisible by heads={cfg.heads}")
    if cfg.dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"{cfg.family}: dtype must be float16, bfloat16 or float32, got {cfg.dtype!r}")
    check_attention_kernel(cfg)


def _attention(b: GraphBuilder, x: str, cfg, causal: bool) -> str:
    """Self-attention with one fused QKV projection, as Megatron-LM's ColumnParallelLinear
    of 3h outputs (`linear_qkv`) and Alpa's benchmark GPT (`qkv_combined`, a Dense of 3h)
    run it: one GEMM, whose data gradient is one partial sum to reduce, not three."""
    h, n = cfg.hidden, cfg.heads
    d = h // n
    dt = cfg.dtype
    bsz, s = cfg.batch, cfg.seq
    with b.scope(tags=("attention",)):
        y = b.einsum("bsh,hcnd->bscnd", x, b.param("w_qkv", (h, 3, n, d), dt, tp=("column", 2)), name="qkv_proj")
        y = b.one("bias_add", [y, b.param("b_qkv", (3, n, d), dt, tp=("column", 1))], name="qkv_bias")
        heads = []
        for i, which in enumerate("qkv"):
            part = b.one("slice", [y], name=f"{which}_split", start=(0, 0, i, 0, 0), limit=(bsz, s, i + 1, n, d))
            part = b.one("reshape", [part], name=f"{which}_squeeze", shape=(bsz, s, n, d))
            heads.append(b.one("transpose", [part], name=f"{which}_heads", perm=(0, 2, 1, 3)))  # (b, n, s, d)
        q, k, v = heads
        ctx = attention_core(b, cfg.attention, "bnqd,bnkd,bnkd->bnqd", q, k, v, scores="bnqk",
                             scale=1.0 / math.sqrt(d), causal=causal, dropout=_rate(cfg))
        w_o = b.param("w_o", (n, d, h), dt, tp=("row", 0))
        out = b.einsum("bnsd,ndh->bsh", ctx, w_o, name="out_proj")
        return b.one("bias_add", [out, b.param("b_o", (h,), dt, tp="replicated")], name="out_bias")


def _mlp(b: GraphBuilder, x: str, cfg) -> str:
    h, f, dt = cfg.hidden, cfg.ffn_mult * cfg.hidden, cfg.dtype
    with b.scope(tags=("mlp",)):
        y = b.einsum("bsh,hf->bsf", x, b.param("w_fc1", (h, f), dt, tp=("column", 1)), name="fc1")
        y = b.one("bias_add", [y, b.param("b_fc1", (f,), dt, tp=("column", 0))], name="fc1_bias")
        y = b.ew("gelu", y)
        y = b.einsum("bsf,fh->bsh", y, b.param("w_fc2", (f, h), dt, tp=("row", 0)), name="fc2")
        return b.one("bias_add", [y, b.param("b_fc2", (h,), dt, tp="replicated")], name="fc2_bias")


def _moe_ffn(b: GraphBuilder, x: str, cfg: MoEConfig) -> str:
    h, f, e, dt = cfg.hidden, cfg.ffn_mult * cfg.hidden, cfg.experts, cfg.dtype
    s, c = cfg.tokens_per_group, cfg.capacity
    g = cfg.batch * cfg.seq // s
    with b.scope(tags=("moe",)):
        tokens = b.one("reshape", [x], name="group_tokens", shape=(g, s, h))
        logits = b.einsum("GSM,ME->GSE", tokens, b.param("w_gate", (h, e), dt, tp="replicated"), name="gate")
        gates = b.one("softmax", [logits], name="gate_softmax", axis=-1)
        combine, dispatch = b.apply("top2_gating", [gates], name="top2_gating", out_names=["combine", "dispatch"],
                                    capacity=c)
        xe = b.einsum("GSEC,GSM->EGCM", dispatch, tokens, name="dispatch")
        w_in = b.param("w_expert_in", (e, h, f), dt, tp=("column", 2), expert=True)
        he = b.einsum("EGCM,EMH->EGCH", xe, w_in, name="expert_in")
        he = b.ew("relu", he)
        w_out = b.param("w_expert_out", (e, f, h), dt, tp=("row", 1), expert=True)
        ye = b.einsum("EGCH,EHM->GECM", he, w_out, name="expert_out")
        y = b.einsum("GSEC,GECM->GSM", combine, ye, name="combine")
        return b.one("reshape", [y], name="ungroup_tokens", shape=(cfg.batch, cfg.seq, h))


def _rate(cfg) -> float:
    return getattr(cfg, "dropout", 0.0)


def _layer_norm(b: GraphBuilder, x: str, h: int, dt: str, name: str) -> str:
    return b.one("layer_norm", [x, b.param(f"{name}_scale", (h,), dt, tp="replicated"),
                                b.param(f"{name}_bias", (h,), dt, tp="replicated")],
                 name=name, eps=1e-5)


def transformer_lm(cfg: GPTConfig | MoEConfig, name: str) -> OpGraph:
    """Forward graph of a GPT-3 or GShard-MoE language model ending in the mean loss."""
    moe = isinstance(cfg, MoEConfig)
    bsz, s, h, dt = cfg.batch, cfg.seq, cfg.hidden, cfg.dtype
    b = GraphBuilder(name)
    ids = b.input("token_ids", (bsz, s), "int32")
    labels = b.input("labels", (bsz, s), "int32")
    with b.scope(layer=0, tags=("embedding",), prefix="embed/"):
        wte = b.param("wte", (cfg.vocab, h), dt, tp=("vocabulary", 0))
        x = b.one("embedding", [wte, ids], name="token_embedding")
        pos = b.one("broadcast", [b.param("wpe", (s, h), dt, tp="replicated")], name="position_embedding",
                    shape=(bsz, s, h), dims=(1, 2))
        x = b.dropout(b.ew("add", x, pos, name="embed_sum"), _rate(cfg), "embed_dropout")
    for i in range(cfg.layers):
        with b.scope(layer=i, prefix=f"layer{i}/"):
            a = _attention(b, _layer_norm(b, x, h, dt, "ln_attn"), cfg, causal=not moe)
            x = b.ew("add", x, b.dropout(a, _rate(cfg), "attn_dropout"), name="residual_attn")
            y = _layer_norm(b, x, h, dt, "ln_ffn")
            y = _moe_ffn(b, y, cfg) if moe and i % 2 == 0 else _mlp(b, y, cfg)
            x = b.ew("add", x, b.dropout(y, _rate(cfg), "ffn_dropout"), name="residual_ffn")
    with b.scope(layer=cfg.layers - 1, tags=("head",), prefix="head/"):
        x = _layer_norm(b, x, h, dt, "ln_final")
        with b.scope(tags=("keep",)):
            logits = b.einsum("bsh,vh->bsv", x, wte, name="logits")
            loss = b.one("softmax_cross_entropy", [logits, labels], name="loss")
    return b.build([loss], meta={"family": cfg.family, "config": _asdict(cfg), "dtype": dt})


def _asdict(cfg) -> dict:
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
