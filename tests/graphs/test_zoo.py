"""Model zoo against closed forms written out independently of the graph builder."""

from __future__ import annotations

import math

import pytest

from alpasim.graphs import (
    get_recipe,
    ZOO,
    GPTConfig,
    MoEConfig,
    ModelSpecError,
    UnknownModelError,
    WResNetConfig,
    build_training_graph,
    flops_by_kind,
    forward_graph,
    resolve_model,
)

GPT_NAMES = [n for n in ZOO if n.startswith("gpt3")]
MOE_NAMES = [n for n in ZOO if n.startswith("moe")]
WRN_NAMES = [n for n in ZOO if n.startswith("wresnet")]


# ----------------------------------------------------------------------- GPT-3
def gpt_params_closed_form(c: GPTConfig) -> float:
    """Megatron-LM: 12 l h^2 (1 + 13/(12h)) + (V + s) h (final layer norm ignored)."""
    l, h = c.layers, c.hidden
    return 12 * l * h * h * (1 + 13 / (12 * h)) + (c.vocab + c.seq) * h


def gpt_flops_closed_form(c: GPTConfig, remat: bool) -> float:
    """Narayanan et al. 2021, eq. 3: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)); with full
    recomputation the layers run forward twice: 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    b, s, l, h, v = c.batch, c.seq, c.layers, c.hidden, c.vocab
    if remat:
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


@pytest.mark.parametrize("name", GPT_NAMES)
def test_gpt_params_and_flops_match_megatron(name):
    _, cfg = resolve_model(name)
    for remat in (False, True):
        built = build_training_graph(name, remat=remat)
        assert built.graph.num_params() == pytest.approx(gpt_params_closed_form(cfg), rel=0.01)
        einsum = flops_by_kind(built.graph)["einsum"]
        assert einsum == pytest.approx(gpt_flops_closed_form(cfg, remat), rel=0.02)


def test_gpt_zoo_sizes_are_what_the_names_say():
    for name in GPT_NAMES:
        billions = float(name.split("-")[1].rstrip("bm")) * (1e-3 if name.endswith("m") else 1)
        assert forward_graph(name).num_params() / 1e9 == pytest.approx(billions, rel=0.03)


# ------------------------------------------------------------------------- MoE
def moe_params_closed_form(c: MoEConfig) -> int:
    """Per layer: attention 4h^2 + 4h, two layer norms 4h. Dense FFN (odd layers) with
    f = 8h: 2hf + f + h. MoE FFN (even layers): gate hE + experts 2Efh (no biases, as
    in Alpa's benchmark model). Tied token embedding Vh, positions sh, final norm 2h."""
    h, f, e = c.hidden, c.ffn_mult * c.hidden, c.experts
    n_moe = (c.layers + 1) // 2
    n_dense = c.layers - n_moe
    per_layer = 4 * h * h + 8 * h
    return (c.layers * per_layer + n_dense * (2 * h * f + f + h) + n_moe * (h * e + 2 * e * f * h)
            + c.vocab * h + c.seq * h + 2 * h)


def moe_einsum_flops_closed_form(c: MoEConfig, remat: bool) -> float:
    """Forward, T = B s tokens in G groups of S, capacity C:
    attention 8Th^2 + 4Tsh; dense FFN 4Thf; MoE FFN gate 2ThE, dispatch 2TECh,
    experts 4(GEC)hf, combine 2TECh; head 2ThV. Backward is twice the forward for every
    contraction except dispatch, whose mask operand takes no gradient (once, not twice).
    Full remat recomputes every layer's forward again, but not the head."""
    t, s, h, f, e, v = c.batch * c.seq, c.seq, c.hidden, c.ffn_mult * c.hidden, c.experts, c.vocab
    g, cap = t // c.tokens_per_group, c.capacity
    n_moe = (c.layers + 1) // 2
    n_dense = c.layers - n_moe
    attention = c.layers * (8 * t * h * h + 4 * t * s * h)
    dense = n_dense * 4 * t * h * f
    dispatch = n_moe * 2 * t * e * cap * h
    moe_rest = n_moe * (2 * t * h * e + 4 * g * e * cap * h * f + 2 * t * e * cap * h)
    head = 2 * t * h * v
    forward_layers = attention + dense + dispatch + moe_rest
    total = 3 * (forward_layers + head) - dispatch
    return total + (forward_layers if remat else 0)


@pytest.mark.parametrize("name", MOE_NAMES)
def test_moe_params_and_flops_closed_form(name):
    _, cfg = resolve_model(name)
    assert forward_graph(name).num_params() == moe_params_closed_form(cfg)
    for remat in (False, True):
        einsum = flops_by_kind(build_training_graph(name, remat=remat).graph)["einsum"]
        assert einsum == pytest.approx(moe_einsum_flops_closed_form(cfg, remat), rel=1e-9)


def test_moe_sizes_are_what_the_names_say():
    for name in MOE_NAMES:
        billions = float(name.split("-")[1].rstrip("bm")) * (1e-3 if name.endswith("m") else 1)
        assert forward_graph(name).num_params() / 1e9 == pytest.approx(billions, rel=0.05)


def test_moe_capacity_is_two_tokens_per_expert_share():
    cfg = MoEConfig(hidden=64, layers=2, heads=4, experts=8, seq=16, batch=4, group_size=2048)
    assert cfg.tokens_per_group == 64  # only 64 tokens in the batch
    assert cfg.capacity == 2 * 64 // 8


# ----------------------------------------------------------------- Wide-ResNet
def _wrn_layers(c: WResNetConfig):
    """(kernel, c_in, c_out, stride, input spatial size) of every convolution."""
    convs = [(7, 3, c.channels, 2, c.image)]
    size = (c.image + 6 - 7) // 2 + 1          # stem conv, pad 3
    size = (size + 2 - 3) // 2 + 1             # 3x3/2 max pool, pad 1
    cin = c.channels
    for stage, n in enumerate(c.blocks):
        f = c.channels * 2 ** stage
        for j in range(n):
            stride = 2 if stage > 0 and j == 0 else 1
            convs.append((1, cin, f, 1, size))
            convs.append((3, f, f * c.width, stride, size))
            out = (size + 2 - 3) // stride + 1
            convs.append((1, f * c.width, 4 * f, 1, out))
            if cin != 4 * f or stride != 1:
                convs.append((1, cin, 4 * f, stride, size))
            cin, size = 4 * f, out
    return convs, cin


def wrn_params_closed_form(c: WResNetConfig) -> int:
    """Convolutions K^2 Cin Cout (no bias), batch norm 2 Cout each, dense 4C*8 -> classes."""
    convs, final = _wrn_layers(c)
    return sum(k * k * ci * co + 2 * co for k, ci, co, _, _ in convs) + final * c.classes + c.classes


def wrn_conv_flops_closed_form(c: WResNetConfig) -> float:
    """Forward 2 N Ho Wo Cout K^2 Cin per convolution; training = 3x, except that the
    stem's input gradient (w.r.t. the images) is never computed."""
    convs, _ = _wrn_layers(c)
    fwd = []
    for k, ci, co, stride, size in convs:
        pad = k // 2
        out = (size + 2 * pad - k) // stride + 1
        fwd.append(2 * c.batch * out * out * co * k * k * ci)
    return 3 * sum(fwd) - fwd[0]


@pytest.mark.parametrize("name", [*WRN_NAMES, "wresnet:channels=8,width=1,image=64,classes=16,batch=8,depth=26"])
def test_wresnet_params_and_flops_closed_form(name):
    _, cfg = resolve_model(name)
    assert forward_graph(name).num_params() == wrn_params_closed_form(cfg)
    flops = flops_by_kind(build_training_graph(name).graph)
    assert flops["conv"] == pytest.approx(wrn_conv_flops_closed_form(cfg), rel=1e-12)
    _, final = _wrn_layers(cfg)
    assert flops["einsum"] == pytest.approx(3 * 2 * cfg.batch * final * cfg.classes, rel=1e-12)


def test_wresnet_sizes_are_what_the_names_say():
    for name in WRN_NAMES:
        billions = float(name.split("-")[1].rstrip("bm")) * (1e-3 if name.endswith("m") else 1)
        assert forward_graph(name).num_params() / 1e9 == pytest.approx(billions, rel=0.05)


# ------------------------------------------------------------ specs and errors
def test_spec_string_builds_the_described_model():
    _, cfg = resolve_model("gpt3:hidden=4096,layers=32,heads=32,seq=1024,vocab=51200,batch=1024")
    assert cfg == resolve_model("gpt3-6.7b")[1]
    _, cfg = resolve_model("GPT3-1.3B:batch=8,layers=2")
    assert (cfg.batch, cfg.layers, cfg.hidden) == (8, 2, 2048)
    _, cfg = resolve_model("wresnet:channels=16,width=2,image=32,batch=4,dtype=fp16")
    assert cfg.dtype == "float16" and cfg.image == 32


@pytest.mark.parametrize("spec, fragment", [
    ("gpt3:hidden=64,layrs=2", "'layrs'"),
    ("gpt3:hidden=sixty", "'hidden'"),
    ("moe:hidden=64,experts", "key=value"),
    ("gpt3:hidden=65,heads=4", "not divisible"),
    ("wresnet:depth=42", "depth"),
    ("gpt3:hidden=0", "hidden"),
])
def test_malformed_spec_names_the_bad_key(spec, fragment):
    with pytest.raises(ModelSpecError, match=fragment):
        resolve_model(spec)


def test_unknown_model_lists_valid_names():
    with pytest.raises(UnknownModelError) as e:
        resolve_model("gpt5-1t")
    assert "gpt3-1.3b" in str(e.value) and "wresnet-2b" in str(e.value)


def test_model_json_file(tmp_path):
    p = tmp_path / "m.json"
    p.write_text('{"family": "moe", "hidden": 64, "layers": 2, "heads": 4, "experts": 4, "seq": 16, "batch": 2}')
    name, cfg = resolve_model(str(p))
    assert isinstance(cfg, MoEConfig) and cfg.experts == 4 and name == "m"
    p.write_text('{"family": "moe", "hidden": "big"}')
    with pytest.raises(ModelSpecError, match="'hidden'"):
        resolve_model(str(p))
    p.write_text('{"family": "mlp"}')
    with pytest.raises(ModelSpecError, match="'family'"):
        resolve_model(str(p))
    p.write_text("{not json")
    with pytest.raises(ModelSpecError, match="not valid JSON"):
        resolve_model(str(p))


def test_every_training_op_has_a_layer_and_a_phase():
    for name in ("gpt3-350m", "moe-380m", "wresnet-250m"):
        g = build_training_graph(name, remat=True).graph
        n_layers = g.num_layers
        assert n_layers == forward_graph(name).num_layers
        for op in g.ops:
            assert 0 <= op.layer < n_layers, op
            assert op.phase in ("forward", "backward", "update")
            if op.phase != "forward":
                origin = g.op_by_name[op.origin]
                assert origin.phase == "forward" and origin.layer == op.layer, op


@pytest.mark.parametrize("precision, per_param, grad_bytes", [
    ("mixed-fp32grad", 18, 4),   # Megatron-LM's default: fp16 weight, fp32 main_grad, master, m, v
    ("mixed", 16, 2),            # ZeRO's accounting: fp16 weight and grad, fp32 master, m, v
    ("fp32", 16, 4),             # single precision: weight, grad, m, v
])
def test_precision_recipes_keep_their_bytes_per_parameter(precision, per_param, grad_bytes):
    dtype = ",dtype=float32" if precision == "fp32" else ""
    g = build_training_graph(f"gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=2{dtype}",
                             precision=precision).graph
    params = g.params
    states = [t for t in g.tensors_with_role("optimizer_state") if t.name not in g.producer]
    assert all(t.dtype == ("float32" if precision == "fp32" else "float16") for t in params)
    assert len(states) == (2 if precision == "fp32" else 3) * len(params)
    assert all(t.dtype == "float32" for t in states)
    n = g.num_params()
    grads = [t for t in g.tensors.values() if t.role == "grad"]
    assert len(grads) == len(params)
    assert sum(t.nbytes for t in params + states + grads) == per_param * n
    assert math.isclose(sum(t.nbytes for t in grads), grad_bytes * n)
    assert get_recipe(precision).bytes_per_param("float32" if precision == "fp32" else "float16") == per_param
    # Adam reads the accumulator's dtype: the gradient it updates from is the recipe's.
    for op in g.ops:
        if op.prim == "adam":
            assert g.tensors[op.inputs[1]].dtype == ("float16" if precision == "mixed" else "float32")


def test_fp32_recipe_on_a_half_precision_model_is_a_clear_error():
    with pytest.raises(ValueError, match="build the model with dtype=float32"):
        build_training_graph("gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=2", precision="fp32")


def test_gradient_primitive_in_a_forward_graph_is_a_clear_error():
    from alpasim.graphs import AutodiffError, GraphBuilder, training_graph

    b = GraphBuilder("second_order")
    x = b.param("x", (4, 8))
    y = b.one("softmax", [x], axis=-1)
    g = b.one("softmax_grad", [y, y], axis=-1)
    loss = b.one("reduce", [g], kind="sum", axes=(0, 1))
    with pytest.raises(AutodiffError, match="'softmax_grad' cannot be differentiated"):
        training_graph(b.build([loss]))


@pytest.mark.parametrize("spec", ["gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=2",
                                  "wresnet:depth=26,width=1,channels=4,image=32,classes=8,batch=2",
                                  "topk-moe:hidden=64,layers=3,heads=4,kv_heads=2,experts=4,top_k=2,expert_ffn=48,"
                                  "dense_layers=1,dense_ffn=96,seq=16,vocab=128,batch=2,group_size=16"])
def test_an_ops_dimension_map_is_built_once_per_distinct_op_and_equals_a_fresh_one(spec):
    """`op_dims` keeps each distinct (primitive, parameters, shapes, dtypes) map: every
    op of a training graph gets the map its primitive builds afresh, the layers'
    identical ops share one, and an op of other shapes or dtypes gets its own."""
    from alpasim.graphs import build_training_graph, op_dims, op_flops
    from alpasim.graphs._primitives import primitive

    g = build_training_graph(spec).graph
    seen = {}
    for op in g.ops:
        dims = op_dims(op, g.tensors)
        fresh = primitive(op.prim).dims(op.attrs, [g.tensors[t] for t in op.inputs],
                                        [g.tensors[t] for t in op.outputs])
        assert dims == fresh, op
        ins, outs = [g.tensors[t] for t in op.inputs], [g.tensors[t] for t in op.outputs]
        assert op_flops(op, g.tensors) == float(primitive(op.prim).flops(op.attrs, ins, outs)), op
        key = (op.prim, op.params, tuple((g.tensors[t].shape, g.tensors[t].dtype) for t in op.inputs),
               tuple((g.tensors[t].shape, g.tensors[t].dtype) for t in op.outputs))
        assert seen.setdefault(key, dims) is dims, op
    assert len(seen) < len(g.ops)


@pytest.mark.parametrize("src, dst, kept", [((2, 4, 1, 8, 16), (2, 4, 8, 16), {3: 2}),
                                            ((2, 4, 8, 16), (2, 4, 1, 8, 16), {2: 3}),
                                            ((2, 1, 6), (2, 6, 1), {2: 1})])
def test_a_reshape_passes_a_unit_axis_over_and_keeps_the_layout_of_the_next(src, dst, kept):
    """Dropping or adding an axis of extent 1 moves no data: the axis after it keeps its
    letter on both sides, and stays shardable (the fused QKV's q, k and v are cut out as
    (b, s, 1, n, d) and squeezed to (b, s, n, d) with the heads split)."""
    from alpasim.graphs import GraphBuilder, op_dims

    b = GraphBuilder("g")
    y = b.one("reshape", [b.input("x", src)], name="r", shape=dst)
    g = b.build([y])
    (op,) = g.ops
    dm = op_dims(op, g.tensors)
    for i, j in kept.items():
        letter = dm.inputs[0][i]
        assert dm.outputs[0][j] == letter and letter not in dm.unshardable, dm


# ------------------------------------------------------ tensor-parallel tags
TAGGED = ["gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8",
          "moe:hidden=64,layers=2,heads=4,experts=4,seq=16,vocab=128,batch=8,group_size=32",
          "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,seq=16,vocab=128,batch=8",
          "topk-moe:hidden=64,layers=2,heads=4,kv_heads=2,experts=4,top_k=2,expert_ffn=48,shared_experts=1,"
          "dense_layers=1,dense_ffn=96,seq=16,vocab=128,batch=8,group_size=32",
          "wresnet:channels=8,width=1,depth=17,image=32,classes=16,batch=8"]


@pytest.mark.parametrize("spec", TAGGED)
def test_every_zoo_parameter_is_tagged_with_the_split_its_einsum_implies(spec):
    """Each builder tags every parameter with how tensor parallelism splits it, and the
    tag agrees with how the parameter is used, read off the graph itself: a column-
    parallel weight's dimension is one its einsum writes out (an output feature), a
    row-parallel one's is contracted away, a vocabulary dimension is the vocabulary,
    an expert weight's dim 0 the experts."""
    from alpasim.graphs import model_source, parse_einsum, param_split

    source = model_source(spec)
    graph = source.forward(8, "float32")
    cfg = source.config
    params = {t.name for t in graph.params}
    tags = {p: param_split(graph, p) for p in params}
    assert all(tag is not None for tag in tags.values()), [p for p, tag in tags.items() if tag is None]
    splits = {tag["split"] for tag in tags.values()}
    assert splits == {"replicated"} if spec.startswith("wresnet") else {"column", "row", "vocabulary"} <= splits
    for op in graph.ops:
        if op.prim != "einsum":
            continue
        (a, b), out = parse_einsum(op.param("equation"))
        for letters, name in ((a, op.inputs[0]), (b, op.inputs[1])):
            tag = tags.get(name)
            if tag is None or tag["split"] in ("replicated", "vocabulary"):
                continue
            letter = letters[tag["dim"]]
            assert (letter in out) == (tag["split"] == "column"), (op.name, name, tag)
    for p, tag in tags.items():
        shape = graph.tensors[p].shape
        if tag["split"] == "vocabulary":
            assert shape[tag["dim"]] == cfg.vocab
        if tag["expert"]:
            assert shape[0] == cfg.experts


def test_an_imported_graph_has_no_tensor_parallel_tags_and_megatron_says_so():
    from alpasim.graphs import GraphBuilder, GraphError, param_split

    b = GraphBuilder("imported")
    x = b.input("x", (4, 8))
    w = b.param("w", (8, 8))
    graph = b.build([b.einsum("bh,hf->bf", x, w)])
    with pytest.raises(ValueError, match="imported carries no tensor-parallel tags"):
        param_split(graph, w)
    for tag in (("column", 2), "column", ("column", None), ("replicated", 0), ("diagonal", 1)):
        with pytest.raises(GraphError, match="tensor-parallel tag"):
            GraphBuilder("bad").param("w", (8, 8), tp=tag)


# Megatron-LM's split dimension of each parameter (Shoeybi et al. 2019, Narayanan et al.
# 2021), written out independently of the builders: QKV's heads, the MLP's hidden
# features, Llama's KV-head groups, experts' hidden features, the vocabulary.
MEGATRON_DIMS = {"w_qkv": 2, "b_qkv": 1, "w_o": 0, "w_fc1": 1, "b_fc1": 0, "w_fc2": 0, "wte": 0, "w_head": 1,
                 "w_q": 1, "w_k": 1, "w_v": 1, "w_gate_proj": 1, "w_up_proj": 1, "w_down_proj": 0,
                 "shared_w_gate_proj": 1, "shared_w_up_proj": 1, "shared_w_down_proj": 0,
                 "w_expert_in": 2, "w_expert_out": 1, "w_expert_gate": 2, "w_expert_up": 2, "w_expert_down": 1}


@pytest.mark.parametrize("spec", TAGGED)
def test_the_tags_split_each_weight_where_megatron_does(spec):
    from alpasim.graphs import model_source, param_split

    graph = model_source(spec).forward(8, "float32")
    for t in graph.params:
        base = t.name.rsplit("/", 1)[-1]
        tag = param_split(graph, t.name)
        assert tag["dim"] == MEGATRON_DIMS.get(base), (t.name, tag)
        assert tag["expert"] == base.startswith("w_expert_"), (t.name, tag)
