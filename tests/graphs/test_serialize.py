"""JSON round trip of graphs, and rejection of malformed files with file and field."""

from __future__ import annotations

import json

import pytest

from alpasim.graphs import (
    GraphFormatError,
    build_training_graph,
    forward_graph,
    graph_from_json,
    graph_to_json,
    load_forward,
    load_graph,
    model_source,
    save_graph,
)


@pytest.mark.parametrize("model", ["gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=2",
                                   "moe:hidden=64,layers=2,heads=4,experts=4,seq=16,batch=2",
                                   "wresnet:channels=8,width=2,image=32,batch=2,classes=10"])
def test_round_trip_is_exact(tmp_path, model):
    for graph in (forward_graph(model), build_training_graph(model, remat=True).graph):
        path = tmp_path / "g.json"
        save_graph(graph, path)
        back = load_graph(path)
        assert back == graph
        assert [op.params for op in back.ops] == [op.params for op in graph.ops]
        assert graph_to_json(back) == graph_to_json(graph)


def test_saved_forward_graph_is_a_model(tmp_path):
    g = forward_graph("gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=2")
    save_graph(g, tmp_path / "fwd.json")
    assert load_forward(str(tmp_path / "fwd.json")) == g


ZOO_SPECS = ["gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=2",
             "moe:hidden=64,layers=2,heads=4,experts=4,seq=16,batch=2",
             "wresnet:channels=8,width=2,image=32,batch=2,classes=10",
             "llama:hidden=64,layers=2,heads=4,kv_heads=2,ffn=96,seq=16,vocab=128,batch=4",
             "topk-moe:hidden=64,layers=3,heads=4,kv_heads=2,experts=4,top_k=2,expert_ffn=48,shared_experts=1,"
             "dense_layers=1,dense_ffn=96,seq=16,vocab=128,batch=8,group_size=32"]


@pytest.mark.parametrize("spec", ZOO_SPECS)
def test_a_saved_zoo_graph_is_that_zoo_model(tmp_path, spec):
    """The file `graph --save` writes is the zoo model itself: the same source, so the
    same graph at every other microbatch size (where a saved graph alone could not be
    resized) and the same plan record."""
    path = tmp_path / "g.json"
    save_graph(forward_graph(spec), path)
    source, zoo = model_source(str(path)), model_source(spec)
    assert source.config == zoo.config and source.name == zoo.name and source.record() == zoo.record()
    assert graph_to_json(source.forward(1)) == graph_to_json(zoo.forward(1))


def test_a_zoo_graph_saved_before_the_tensor_parallel_tags_is_still_that_model(tmp_path):
    """A file written before the builders tagged their parameters has no
    `meta["tensor_parallel"]`: it is the same model, planned as the zoo's (with the
    tags), while a file whose tags differ from the zoo's is a graph of its own."""
    spec = ZOO_SPECS[3]
    doc = graph_to_json(forward_graph(spec))
    tags = doc["meta"].pop("tensor_parallel")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    source = model_source(str(path))
    assert source.config == model_source(spec).config
    assert source.forward(1).meta["tensor_parallel"] == tags
    doc["meta"]["tensor_parallel"] = {**tags, "w_q": {"split": "row", "dim": 0, "expert": False}}
    path.write_text(json.dumps(doc))
    assert model_source(str(path)).config is None


def test_an_edited_zoo_graph_plans_as_a_graph_of_its_own(tmp_path):
    """One op's layer label changed after saving: no longer the zoo's model, so it is
    planned as the graph it is (its own batch only, its edit kept), never silently as
    the zoo model its metadata names."""
    spec = ZOO_SPECS[0]
    doc = graph_to_json(forward_graph(spec))
    doc["ops"][3]["layer"] = doc["ops"][3]["layer"] + 1
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc))
    source = model_source(str(path))
    assert source.config is None and source.graph.ops[3].layer == doc["ops"][3]["layer"]
    assert not source.resizable


def test_a_saved_training_graph_says_what_to_save_instead(tmp_path):
    path = tmp_path / "t.json"
    save_graph(build_training_graph(ZOO_SPECS[0]).graph, path)
    with pytest.raises(GraphFormatError, match="is a training graph; plan the model it was built from"):
        model_source(str(path))


def _doc():
    return graph_to_json(forward_graph("gpt3:hidden=32,layers=1,heads=2,seq=8,vocab=64,batch=2"))


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d.update(schema="alpasim.graph/9"), "'schema'"),
    (lambda d: d.pop("tensors"), "'tensors'"),
    (lambda d: d["tensors"][0].update(shape=[2, "x"]), r"tensors\[0\]: field 'shape'"),
    (lambda d: d["tensors"][0].update(dtype="float8"), r"tensors\[0\]: .*dtype"),
    (lambda d: d["tensors"][1].update(role="weights"), r"tensors\[1\]: .*role"),
    (lambda d: d["ops"][0].update(prim="fft"), r"ops\[0\]: .*unknown primitive 'fft'"),
    (lambda d: d["ops"][0].update(layer="one"), r"ops\[0\]: field 'layer'"),
    (lambda d: d["ops"][0].update(inputs=["nope"]), r"ops\[0\]: .*unknown tensors"),
    (lambda d: d["ops"][1]["params"].update(shape=[3, 3]), r"ops\[1\]"),
])
def test_malformed_graph_names_file_and_field(tmp_path, mutate, fragment):
    d = _doc()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(GraphFormatError, match=fragment) as e:
        load_graph(path)
    assert str(path) in str(e.value)


def test_not_json_and_not_an_object(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("[1, 2")
    with pytest.raises(GraphFormatError, match="not valid JSON"):
        load_graph(p)
    with pytest.raises(GraphFormatError, match="JSON object"):
        graph_from_json([1, 2], "list.json")
    with pytest.raises(GraphFormatError, match="no such file"):
        load_graph(tmp_path / "missing.json")


def test_out_of_order_ops_are_rejected():
    d = _doc()
    d["ops"] = d["ops"][::-1]
    with pytest.raises(GraphFormatError, match="before it is defined"):
        graph_from_json(d, "rev.json")
