"""Third-party JAX models as users write them, for the importer's acceptance tests.

* `FlaxLlama` (flax.linen): a Llama-shaped decoder - token embedding, a layer stack
  under `nn.scan`, each layer RMSNorm, grouped-query attention (4 query heads sharing
  2 key/value heads, `jnp.repeat`) with rotary embeddings whose cos/sin tables are
  numpy constants captured by the function (interleaved pairs: strided slices and
  `jnp.stack`), a causal mask (another captured constant), a SwiGLU MLP and dropout;
  the loss is optax's integer-label cross-entropy (`take_along_axis`).
* `NnxNet` (flax.nnx): embedding, two SwiGLU blocks held in an `nnx.List`, a biased head;
  its parameters are the `nnx.State` that `nnx.split` gives.
* `EqxNet` (equinox): `eqx.nn.Embedding`, `Linear`, `RMSNorm` and `Dropout` applied
  per token under `jax.vmap` (the embedding becomes a two-index gather).
* Hugging Face's Flax causal LMs (`hf_problem`: Llama, Mistral, GPT-2 of transformers 4.x),
  built from their own config classes: RoPE rows gathered from a cached sin/cos table by
  position ids, GQA by `jnp.repeat`, causal (and sliding-window) masks sliced from a
  cached one.

Each `*_problem()` returns (loss_fn, params, batch) at global batch 8.
"""

from __future__ import annotations

import numpy as np

V, D, H, KV, T, F, L = 128, 64, 4, 2, 16, 128, 2


def rope_tables(seq: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (10000 ** (np.arange(0, head_dim, 2) / head_dim))
    angles = np.outer(np.arange(seq), inv)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def flax_llama_problem(dropout: bool = False, batch_size: int = 8):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    cos, sin = rope_tables(T, D // H)
    causal = np.tril(np.ones((T, T), bool))

    def rope(x):                      # (batch, seq, heads, head_dim), interleaved pairs
        x1, x2 = x[..., ::2], x[..., 1::2]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).reshape(x.shape)

    class Block(nn.Module):
        deterministic: bool = True

        @nn.compact
        def __call__(self, x, _):
            hd = D // H
            h = nn.RMSNorm()(x)
            q = rope(nn.DenseGeneral((H, hd), use_bias=False)(h))
            k = rope(nn.DenseGeneral((KV, hd), use_bias=False)(h))
            v = nn.DenseGeneral((KV, hd), use_bias=False)(h)
            k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
            att = jax.nn.softmax(jnp.where(causal, att, -1e9), -1)
            o = jnp.einsum("bhqk,bkhd->bqhd", att, v)
            x = x + nn.DenseGeneral(D, axis=(-2, -1), use_bias=False)(o)
            h = nn.RMSNorm()(x)
            y = nn.Dense(D, use_bias=False)(nn.silu(nn.Dense(F, use_bias=False)(h)) * nn.Dense(F, use_bias=False)(h))
            return x + nn.Dropout(0.1, deterministic=self.deterministic)(y), None

    class FlaxLlama(nn.Module):
        deterministic: bool = True

        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(V, D)(ids)
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                            length=L)
            x, _ = stack(self.deterministic)(x, None)
            return nn.Dense(V, use_bias=False)(nn.RMSNorm()(x))

    model = FlaxLlama(deterministic=not dropout)
    key = jax.random.PRNGKey(7)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["ids"], rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    ids = jnp.zeros((batch_size, T), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids)["params"])
    return loss_fn, params, {"ids": ids, "labels": ids}


def nnx_problem(batch_size: int = 8):
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class SwiGLU(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.RMSNorm(D, rngs=rngs)
            self.gate = nnx.Linear(D, F, use_bias=False, rngs=rngs)
            self.up = nnx.Linear(D, F, use_bias=False, rngs=rngs)
            self.down = nnx.Linear(F, D, use_bias=False, rngs=rngs)

        def __call__(self, x):
            h = self.norm(x)
            return x + self.down(nnx.silu(self.gate(h)) * self.up(h))

    class NnxNet(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(V, D, rngs=rngs)
            self.blocks = nnx.List([SwiGLU(rngs) for _ in range(2)])
            self.head = nnx.Linear(D, V, rngs=rngs)

        def __call__(self, ids):
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    graphdef, params = nnx.split(NnxNet(nnx.Rngs(0)))

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    ids = jnp.zeros((batch_size, T), jnp.int32)
    return loss_fn, params, {"ids": ids, "labels": ids}


def equinox_problem(batch_size: int = 8):
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    class EqxNet(eqx.Module):
        emb: eqx.nn.Embedding
        mlp: eqx.nn.Linear
        norm: eqx.nn.RMSNorm
        head: eqx.nn.Linear
        drop: eqx.nn.Dropout

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.emb, self.mlp = eqx.nn.Embedding(V, D, key=k1), eqx.nn.Linear(D, D, key=k2)
            self.norm, self.head = eqx.nn.RMSNorm(D), eqx.nn.Linear(D, V, key=k3)
            self.drop = eqx.nn.Dropout(0.1, inference=True)

        def __call__(self, ids):
            x = jax.vmap(self.emb)(ids)
            x = x + jax.vmap(self.drop)(jax.nn.silu(jax.vmap(self.mlp)(jax.vmap(self.norm)(x))))
            return jax.vmap(self.head)(x)

    params, static = eqx.partition(EqxNet(jax.random.PRNGKey(0)), eqx.is_array)

    def loss_fn(params, batch):
        logits = jax.vmap(eqx.combine(params, static))(batch["ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    ids = jnp.zeros((batch_size, T), jnp.int32)
    return loss_fn, params, {"ids": ids, "labels": ids}


def flax_gpt_problem(hidden: int = 64, layers: int = 2, heads: int = 4, seq: int = 16, vocab: int = 128,
                     batch_size: int = 8, dtype: str = "float32"):
    """A GPT written in flax.linen with the layout of the built-in `gpt3` family
    (`graphs._transformer`): learned positions, pre-LN blocks with biased Q/K/V
    projections into heads, a causal softmax, GeLU MLP of 4x hidden, a final LayerNorm
    and the head tied to the token embedding (`Embed.attend`); optax's integer-label
    cross-entropy. `gpt3:hidden=...,layers=...` of the same numbers is the same model."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    dt = jnp.dtype(dtype)
    d = hidden // heads
    causal = np.tril(np.ones((seq, seq), bool))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm(epsilon=1e-5, dtype=dt, param_dtype=dt)(x)
            qkv = nn.DenseGeneral((3, heads, d), dtype=dt, param_dtype=dt)(h)       # one fused QKV, as built in
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            att = jnp.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(d).astype(dt)
            att = jax.nn.softmax(jnp.where(causal, att, jnp.finfo(dt).min), -1)
            o = jnp.einsum("bnqk,bknd->bqnd", att, v)
            x = x + nn.DenseGeneral(hidden, axis=(-2, -1), dtype=dt, param_dtype=dt)(o)
            h = nn.LayerNorm(epsilon=1e-5, dtype=dt, param_dtype=dt)(x)
            h = nn.Dense(4 * hidden, dtype=dt, param_dtype=dt)(h)
            return x + nn.Dense(hidden, dtype=dt, param_dtype=dt)(nn.gelu(h))

    class FlaxGPT(nn.Module):
        @nn.compact
        def __call__(self, ids):
            wte = nn.Embed(vocab, hidden, dtype=dt, param_dtype=dt)
            wpe = self.param("wpe", nn.initializers.normal(0.02), (seq, hidden), dt)
            x = wte(ids) + wpe[None]
            for _ in range(layers):
                x = Block()(x)
            return wte.attend(nn.LayerNorm(epsilon=1e-5, dtype=dt, param_dtype=dt)(x))

    return linen_lm_problem(FlaxGPT(), batch_size, seq)


def flax_llama3_problem(hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int = 96,
                        seq: int = 16, vocab: int = 128, batch_size: int = 8, rope_theta: float = 500000.0):
    """A Llama-3-style decoder written in flax.linen with the layout of the built-in
    `llama` family (`graphs._llama`): RMSNorm, grouped-query attention (`kv_heads` key
    and value heads, each shared by heads / kv_heads query heads), half-split RoPE on
    queries and keys, a causal softmax, SwiGLU, a final RMSNorm and an untied head;
    optax's integer-label cross-entropy. `llama:hidden=...` of the same numbers is the
    same model."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    d, r = hidden // heads, heads // kv_heads
    inv = 1.0 / rope_theta ** (np.arange(d // 2) * 2.0 / d)
    angles = np.outer(np.arange(seq), inv)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    causal = np.tril(np.ones((seq, seq), bool))

    def rope(x):                      # (batch, seq, ..., head_dim), the two halves rotated
        c = cos.reshape((1, seq) + (1,) * (x.ndim - 3) + (d // 2,))
        s = sin.reshape(c.shape)
        x1, x2 = x[..., :d // 2], x[..., d // 2:]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.RMSNorm(epsilon=1e-5)(x)
            q = rope(nn.DenseGeneral((kv_heads, r, d), use_bias=False)(h))      # (b, s, g, r, d)
            k = rope(nn.DenseGeneral((kv_heads, d), use_bias=False)(h))         # (b, s, g, d)
            v = nn.DenseGeneral((kv_heads, d), use_bias=False)(h)
            att = jnp.einsum("bqgrd,bkgd->bgrqk", q, k) / np.sqrt(d)
            att = jax.nn.softmax(jnp.where(causal, att, -1e9), -1)
            o = jnp.einsum("bgrqk,bkgd->bqgrd", att, v)
            x = x + nn.DenseGeneral(hidden, axis=(-3, -2, -1), use_bias=False)(o)
            h = nn.RMSNorm(epsilon=1e-5)(x)
            gate, up = nn.Dense(ffn, use_bias=False)(h), nn.Dense(ffn, use_bias=False)(h)
            return x + nn.Dense(hidden, use_bias=False)(nn.silu(gate) * up)

    class FlaxLlama3(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(vocab, hidden)(ids)
            for _ in range(layers):
                x = Block()(x)
            return nn.Dense(vocab, use_bias=False)(nn.RMSNorm(epsilon=1e-5)(x))

    return linen_lm_problem(FlaxLlama3(), batch_size, seq)


HF_KINDS = ("llama", "mistral", "gpt2")


def hf_problem(kind: str, batch_size: int = 8, seq: int = T):
    """(loss_fn, abstract params, batch) of Hugging Face's Flax causal LM `kind` (one of
    `HF_KINDS`) at a tiny configuration: hidden D, L layers, H heads, vocabulary V.

    * "llama": `FlaxLlamaForCausalLM`, KV key/value heads (GQA by `jnp.repeat`), RoPE whose
      sin/cos rows `sincos[position_ids]` are a gather from a (positions, 1, 2 x head_dim)
      table, SwiGLU of F, RMSNorm, an untied head.
    * "mistral": `FlaxMistralForCausalLM`, the same with a sliding window of seq / 4, so
      the window masks keys the causal mask alone would keep.
    * "gpt2": `FlaxGPT2LMHeadModel`, learned positions looked up by position ids, the
      head tied to the token embedding.

    The loss is next-token cross-entropy of the logits (optax's integer-label form). The
    parameters are only traced: nothing is downloaded, nothing initialised. transformers
    reads HF_HOME when first imported: set it (and HF_HUB_OFFLINE) before the first call."""
    import jax.numpy as jnp
    import optax

    model = _hf_model(kind, batch_size, seq)

    def loss_fn(params, batch):
        logits = model(batch["ids"], params=params, train=False).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["ids"][:, 1:]).mean()

    return loss_fn, model.params_shape_tree, {"ids": jnp.zeros((batch_size, seq), jnp.int32)}


def _hf_model(kind: str, batch_size: int, seq: int):
    """The transformers model of `hf_problem`, its weights left uninitialised."""
    import transformers as hf

    shape = {"input_shape": (batch_size, seq), "_do_init": False}
    if kind == "gpt2":
        return hf.FlaxGPT2LMHeadModel(hf.GPT2Config(vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=seq),
                                      **shape)
    # HF's Flax sin/cos table keeps only max_position_embeddings of its 2 x head_dim
    # columns (`out[:, :, :num_pos]`): fewer positions than that would cut the table.
    common = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                  num_key_value_heads=KV, max_position_embeddings=max(seq, 2 * D // H))
    if kind == "llama":
        return hf.FlaxLlamaForCausalLM(hf.LlamaConfig(**common), **shape)
    if kind == "mistral":
        return hf.FlaxMistralForCausalLM(hf.MistralConfig(**common, sliding_window=seq // 4), **shape)
    raise ValueError(f"unknown Hugging Face model {kind!r}; expected one of {HF_KINDS}")


def linen_lm_problem(model, batch_size: int, seq: int):
    """(loss_fn, abstract params, batch) of a flax.linen language model taking token ids:
    optax's integer-label cross-entropy of its logits, the parameters only traced."""
    import jax
    import jax.numpy as jnp
    import optax

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["ids"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    ids = jnp.zeros((batch_size, seq), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids)["params"])
    return loss_fn, params, {"ids": ids, "labels": ids}


class LlamaReference:
    """The built-in `llama` / `topk-moe` families' pieces written in jax.numpy, as an
    independent check of the graphs: RMSNorm, half-split RoPE, grouped-query attention
    on one layer's weights (`w` keyed by the names under `layer{i}/`) and SwiGLU.

    Both sides run as one jitted program each: op by op, every jax.numpy call of the
    reference and every op of the graph would compile a program of its own."""

    def __init__(self, spec: str, seed: int):
        """The built-in graph of model `spec` on random weights (`seed`): its loss
        lowered to JAX (`self.got`), the weights (`self.params`), the token ids whose
        embeddings the reference starts from, and the labels."""
        import jax

        from alpasim.backends import lower_graph, random_leaves
        from alpasim.graphs import forward_graph, resolve_model

        _, cfg = resolve_model(spec)
        fwd = forward_graph(spec)
        leaves = random_leaves(fwd, seed=seed, scale=0.5)
        (loss,) = fwd.outputs
        self.cfg, self.labels = cfg, leaves["labels"]
        self.got = float(jax.jit(lower_graph(fwd, [loss]))(leaves)[loss])
        self.params = {t.name: leaves[t.name] for t in fwd.params}
        self.token_ids = leaves["token_ids"]
        self.seq, self.d = cfg.seq, cfg.hidden // cfg.heads
        inv = 1.0 / cfg.rope_theta ** (np.arange(self.d // 2) * 2.0 / self.d)
        angles = np.outer(np.arange(cfg.seq), inv)
        self.cos, self.sin = np.cos(angles), np.sin(angles)
        self.mask = np.tril(np.ones((cfg.seq, cfg.seq), bool))

    @staticmethod
    def norm(x, w):
        import jax
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w

    def rope(self, x):                    # (batch, seq, ..., head_dim)
        import jax.numpy as jnp
        half = self.d // 2
        c = self.cos.reshape((1, self.seq) + (1,) * (x.ndim - 3) + (half,))
        s = self.sin.reshape(c.shape)
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def attention_block(self, x, w):
        """x plus the attention of the layer's normalised x."""
        import jax
        import jax.numpy as jnp
        y = self.norm(x, w["attn_norm/scale"])
        q = self.rope(jnp.einsum("bsh,hgrd->bsgrd", y, w["w_q"]))
        k = self.rope(jnp.einsum("bsh,hgd->bsgd", y, w["w_k"]))
        v = jnp.einsum("bsh,hgd->bsgd", y, w["w_v"])
        att = jnp.where(self.mask, jnp.einsum("bqgrd,bkgd->bgrqk", q, k) / np.sqrt(self.d), -jnp.inf)
        o = jnp.einsum("bgrqk,bkgd->bqgrd", jax.nn.softmax(att, -1), v)
        return x + jnp.einsum("bsgrd,grdh->bsh", o, w["w_o"])

    @staticmethod
    def swiglu(x, gate, up, down):
        import jax
        return (jax.nn.silu(x @ gate) * (x @ up)) @ down

    @staticmethod
    def layer_weights(params: dict, i: int) -> dict:
        """Layer i's weights (`w` above) among `params`."""
        return {k.split("/", 1)[1]: v for k, v in params.items() if k.startswith(f"layer{i}/")}

    def loss(self, layers) -> float:
        """The mean cross-entropy of the head on `layers(x, weights)`, where x is the
        embedded tokens and weights(i) gives layer i's (`layer_weights`)."""
        import functools

        import jax
        import jax.numpy as jnp

        def loss_of(params):
            x = layers(params["embed/wte"][self.token_ids], functools.partial(self.layer_weights, params))
            logits = self.norm(x, params["head/final_norm/scale"]) @ params["head/w_head"]
            logp = jax.nn.log_softmax(logits, -1)
            return -jnp.take_along_axis(logp, self.labels[..., None], -1).mean()
        return float(jax.jit(loss_of)(self.params))
