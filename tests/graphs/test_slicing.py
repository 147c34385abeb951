"""Stage graphs: every layer's, sliced in one pass, is the layer range's own."""

from __future__ import annotations

import pytest

from alpasim import graphs as gr


@pytest.mark.parametrize("spec, remat", [
    ("llama:hidden=256,layers=3,heads=4,kv_heads=2,ffn=512,seq=64,vocab=512,batch=4", False),
    ("gpt3:hidden=64,layers=2,heads=4,seq=32,vocab=96,batch=12", True),
])
def test_every_layers_graph_in_one_pass_is_its_range_graph(spec, remat):
    """`layer_stage_graphs` against `stage_graph(l, l)`, which reads the whole graph per
    layer: the same ops, inputs, outputs (what another layer reads), tensors and meta."""
    g = gr.training_graph(gr.forward_graph(spec), remat=remat)
    together = gr.layer_stage_graphs(g)
    assert len(together) == g.num_layers > 1
    for layer, x in enumerate(together):
        y = gr.stage_graph(g, layer, layer)
        assert (x.name, x.ops, x.inputs, x.outputs, x.tensors, x.meta) == \
            (y.name, y.ops, y.inputs, y.outputs, y.tensors, y.meta)
        assert x.outputs          # every layer hands something on
