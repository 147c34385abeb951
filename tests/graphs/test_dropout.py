"""Dropout in the GPT graph, as Megatron-LM runs it (`GraphBuilder.dropout`).

The stash is checked against Korthikanti et al. 2022's closed form (sec. 4.1: a
layer without recomputation keeps 34 sbh + 5 a s^2 b bytes in fp16, dropout masks of
one byte an element included), selective recomputation against the paper's "only
the attention core again" (no (s, s) tensor kept, the hidden masks kept), and the
mask's bits against what dropout must be: the rate, the same bits on any sharding and
for a microbatch's rows as for the whole batch's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpasim.backends import LOWERINGS
from alpasim.graphs import ModelSpecError, forward_graph, model_from_json, model_to_json, resolve_model, training_graph
from alpasim.graphs._recompute import recompute_fusible

S, B, H, A = 128, 2, 64, 4


def _kept(graph, layer: int = 1) -> dict[str, int]:
    """Forward values the backward of `layer` reads, with their bytes."""
    fwd = {o for op in graph.ops if op.phase == "forward" for o in op.outputs}
    return {x: graph.tensors[x].nbytes for op in graph.ops if op.phase == "backward" and op.layer == layer
            for x in op.inputs if x in fwd}


def _gpt(dropout: float):
    return forward_graph(f"gpt3:hidden={H},layers=3,heads={A},seq={S},vocab=128,batch={B},dtype=fp16,"
                         f"dropout={dropout}")


def test_a_layer_without_recomputation_keeps_korthikantis_34sbh_plus_5as2b():
    """With dropout, exactly the paper's count; without it, less its three masks'
    and the dropped probabilities' bytes: 2 sbh + a s^2 b (masks) + 2 a s^2 b."""
    with_dropout = sum(_kept(training_graph(_gpt(0.1))).values())
    assert with_dropout == 34 * S * B * H + 5 * A * S * S * B
    without = sum(_kept(training_graph(_gpt(0.0))).values())
    assert without == with_dropout - 2 * S * B * H - 3 * A * S * S * B


def test_selective_recomputation_draws_the_probabilities_mask_again_and_keeps_the_hidden_ones():
    kept = _kept(recompute_fusible(training_graph(_gpt(0.1)), selective=True))
    g = _gpt(0.1)
    square = [x for x in kept if g.tensors.get(x) is not None and g.tensors[x].shape[-2:] == (S, S)]
    assert square == []
    masks = {x: n for x, n in kept.items() if x.endswith("_mask")}
    assert masks == {"layer1/attn_dropout_mask": S * B * H, "layer1/ffn_dropout_mask": S * B * H}
    # Korthikanti's selective count: 34 sbh, the (s, s) terms gone.
    assert sum(kept.values()) == 34 * S * B * H


def _mask_of(rows, shape, rate=0.1, seed=7):
    return LOWERINGS["dropout_mask"]({"shape": shape, "rate": rate, "seed": seed}, rows)


_mask = jax.jit(_mask_of, static_argnums=(1, 2, 3))   # one program, not one per jax.numpy call


def test_the_mask_keeps_one_minus_the_rate_and_differs_by_row_and_seed():
    rows = jnp.arange(64, dtype=jnp.int32)
    for rate in (0.1, 0.5):
        keep = np.asarray(_mask(rows, (64, 32, 128), rate))
        assert keep.dtype == np.bool_ and abs(keep.mean() - (1 - rate)) < 0.01
    m = np.asarray(_mask(rows, (64, 32, 128)))
    assert not np.array_equal(m[0], m[1])
    assert not np.array_equal(m, np.asarray(_mask(rows, (64, 32, 128), seed=8)))


def test_a_microbatch_and_any_sharding_draw_the_whole_batchs_bits():
    rows = jnp.asarray(np.random.default_rng(0).integers(0, 2**31 - 1, 8), jnp.int32)
    whole = np.asarray(_mask(rows, (8, 4, 16, 16)))
    np.testing.assert_array_equal(np.asarray(_mask(rows[2:4], (2, 4, 16, 16))), whole[2:4])
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    sharded = jax.jit(lambda r: _mask_of(r, (8, 4, 16, 16)),
                      out_shardings=NamedSharding(mesh, PartitionSpec("x", "y")))(rows)
    np.testing.assert_array_equal(np.asarray(sharded), whole)


def test_the_spec_takes_a_rate_and_refuses_what_is_not_one():
    _, cfg = resolve_model("gpt3:hidden=64,layers=2,heads=4,dropout=0.1")
    assert cfg.dropout == 0.1 and model_from_json(model_to_json(cfg)) == cfg
    for bad, says in (("1.5", "probability"), ("x", "needs a number")):
        with pytest.raises(ModelSpecError, match=says):
            resolve_model(f"gpt3:hidden=64,layers=2,heads=4,dropout={bad}")


def test_the_graph_drops_the_rate_and_scales_what_it_keeps():
    """Evaluated: the dropped probabilities are softmax * mask / (1 - rate), about half
    of them zero at rate 0.5, and the loss moves off the dropout-free model's."""
    from alpasim.backends import lower_graph, random_leaves

    spec = "gpt3:hidden=64,layers=2,heads=4,seq=32,vocab=128,batch=4,dtype=fp32"
    g = forward_graph(spec + ",dropout=0.5")
    leaves = random_leaves(g, seed=1)
    out = jax.jit(lower_graph(g))(leaves)
    probs, dropped, mask = (np.asarray(out[f"layer0/{t}"]) for t in ("softmax", "probs_dropout",
                                                                       "probs_dropout_mask"))
    np.testing.assert_allclose(dropped, np.where(mask, probs / 0.5, 0.0), rtol=1e-6)
    assert abs(mask.mean() - 0.5) < 0.02
    plain = forward_graph(spec)
    plain_leaves = {k: v for k, v in leaves.items() if k in plain.tensors}
    loss = jax.jit(lower_graph(plain, plain.outputs))(plain_leaves)[plain.outputs[0]]
    assert abs(float(out[g.outputs[0]]) - float(loss)) > 1e-4


def test_layers_of_one_kind_share_a_plan_though_their_masks_differ():
    """Each layer draws its own mask (its seed), and the planner still solves one layer
    kind once: the seed changes values, not cost (`_layer_options.VALUE_ONLY_PARAMS`)."""
    from alpasim.solvers._stage_costs import layer_graphs
    from alpasim.solvers._layer_options import canonical_key

    layers = layer_graphs(training_graph(forward_graph(
        "gpt3:hidden=64,layers=4,heads=4,seq=32,vocab=128,batch=2,dropout=0.1")))
    seeds = [{op.param("seed") for op in g.ops if op.prim == "dropout_mask"} for g in layers[1:3]]
    assert seeds[0] and seeds[0].isdisjoint(seeds[1])
    assert canonical_key(layers[1]) == canonical_key(layers[2])


def test_rows_far_apart_draw_different_masks():
    """A row's offset is hashed, not its id times the row's size, which wraps mod 2^32:
    rows 2^22 apart of a (4, 16, 16) row once drew the same mask."""
    rows = jnp.asarray([5, 5 + 2**22, 5 + 2**27], jnp.int32)
    m = np.asarray(_mask(rows, (3, 4, 16, 16), rate=0.5))
    assert not np.array_equal(m[0], m[1]) and not np.array_equal(m[0], m[2])
