"""The planner's interleaved search (`solvers._interleave`): the DP over S x v chunks on
a table with a known answer, and the planner choosing interleaving where it pays and
refusing it where the memory its order holds does not fit."""

from __future__ import annotations

import re

import numpy as np
import pytest

from alpasim.costmodels import StageMemory, get_cluster
from alpasim.simulator import simulate
from alpasim.solvers import plan_pipeline
from alpasim.solvers._interleave import interleaved_dp
from alpasim.solvers import PlanOptions, SearchSpace

GIB = 2 ** 30


def uniform_table(layers: int, t: float, depth: int) -> np.ndarray:
    """cost[k, i, 0, s] = (i - k + 1) t: every layer takes t, whatever the depth."""
    k, i = np.indices((layers, layers))
    cost = np.where(i >= k, (i - k + 1) * t, np.inf)
    return np.repeat(cost[:, :, None, None], depth, axis=3)


def per_layer_memory(params: float, stash: float, peak: float):
    def memory(choice, depth):
        n = choice.last - choice.first + 1
        return StageMemory(n * params, 0.0, 0.0, n * stash, 1, n * (peak - stash), 0.0,
                           n * (params + peak))
    return memory


@pytest.mark.parametrize("S, v, B", [(2, 2, 4), (2, 4, 2), (4, 2, 8), (3, 2, 6)])
def test_uniform_layers_split_evenly_at_megatrons_time(S, v, B):
    """L = 2 S v layers of t: each chunk takes two layers, and the plan's latency is
    B v (2t) + (S - 1)(2t) when B >= S (the ramp of one chunk per mesh), or the orders'
    own makespan below that, which a balanced 1F1B of S stages (B + S - 1) 2 v t bounds."""
    t, L = 1.0, 2 * S * v
    r = interleaved_dp(uniform_table(L, t, 8), 0, S, v, B, chunk_memory=per_layer_memory(1.0, 1.0, 2.0),
                       memory_limit=np.inf)
    assert [(c.first, c.last) for c in r.stages] == [(2 * j, 2 * j + 1) for j in range(S * v)]
    if B >= S:
        assert r.latency_s == pytest.approx(B * v * 2 * t + (S - 1) * 2 * t)
    assert r.latency_s <= (B + S - 1) * 2 * v * t


def test_a_mesh_must_hold_all_of_its_chunks():
    """S = 2, v = 2, B = 4, two layers a chunk, each layer 1 byte of state, 1 of stash and
    2 at its peak: mesh 0 holds its two chunks' 4 bytes of state, and at its peak (the
    warm-up of 2(S - 1) + (v - 1) S = 4 chunk forwards, then one more running) 4 stashes
    of 2 and one chunk at its peak of 4: 4 + 8 + 4 = 16 bytes. A limit of 16 takes that
    even split; one byte less takes a slower, uneven one that fits; and under 5 bytes
    (a mesh holds at least a quarter of the 8 layers' state and of their stash) none fits."""
    table = uniform_table(8, 1.0, 8)
    memory = per_layer_memory(1.0, 1.0, 2.0)
    even = interleaved_dp(table, 0, 2, 2, 4, chunk_memory=memory, memory_limit=16.0)
    assert [(c.first, c.last) for c in even.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert max(even.mesh_bytes) == pytest.approx(16.0)
    tight = interleaved_dp(table, 0, 2, 2, 4, chunk_memory=memory, memory_limit=15.0)
    assert max(tight.mesh_bytes) <= 15.0 and tight.latency_s > even.latency_s
    assert interleaved_dp(table, 0, 2, 2, 4, chunk_memory=memory, memory_limit=5.0) is None


MODEL = "gpt3:hidden=256,layers=16,heads=4,seq=128,vocab=512,batch=16"


@pytest.mark.slow
def test_the_planner_interleaves_where_it_pays_and_not_where_memory_forbids():
    """Sixteen blocks on 8 devices at B = 16: interleaving 2 chunks on 8 meshes predicts
    and simulates faster than 1F1B, so "auto" takes it. It holds more activations (each
    mesh warms up 2(S - 1 - k) + S chunk forwards), so on a device with room for the
    1F1B plan but not for it, "auto" keeps 1F1B: the interleaved plans that still fit
    (fewer, larger meshes) are slower."""
    cluster = get_cluster("aws-p3.16xlarge", nodes=1)
    space = SearchSpace(microbatches=16, pareto=False)
    one = plan_pipeline(MODEL, cluster, space, PlanOptions(remat=False))
    auto = plan_pipeline(MODEL, cluster, space, PlanOptions(remat=False, schedule="auto"))
    assert auto.schedule == "interleaved" and auto.chunks >= 2 and len(auto.stages) == auto.chunks * auto.num_meshes
    assert simulate(auto).iteration_s < simulate(one).iteration_s
    peak = max(simulate(auto).peak_mesh_memory_bytes())
    assert peak == pytest.approx(auto.predicted.peak_memory_bytes, rel=0.05)

    # Room for 1F1B's peak, not for the interleaved plan's.
    limit = (max(s.memory_bytes for s in one.stages) + auto.predicted.peak_memory_bytes) / 2
    assert max(s.memory_bytes for s in one.stages) < limit < auto.predicted.peak_memory_bytes
    tight = cluster.with_overrides(memory_gb=limit / GIB)
    kept = plan_pipeline(MODEL, tight, space, PlanOptions(remat=False, schedule="auto"))
    assert kept.schedule == "1f1b" and kept.chunks == 1, kept.notes
    forced = plan_pipeline(MODEL, tight, space, PlanOptions(remat=False, schedule="interleaved"))
    assert forced.predicted.peak_memory_bytes <= limit
    assert max(simulate(forced).peak_mesh_memory_bytes()) <= limit * 1.05
    assert forced.predicted.iteration_s > kept.predicted.iteration_s


def _shortfall(note: str) -> tuple[float, float, float]:
    """(needed, states, activations) bytes from a refusal's "needs X on mesh k: ..."."""
    units = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": GIB, "TiB": 2 ** 40}
    found = re.search(r"needs ([\d.]+) (\w+) on mesh \d+: ([\d.]+) (\w+) of states, (?:[\d.]+ \w+ of buffers, )?"
                      r"([\d.]+) (\w+) of activations", note)
    assert found, note
    g = found.groups()
    return tuple(float(g[i]) * units[g[i + 1]] for i in (0, 2, 4))


def test_megatron_runs_interleaved_1f1b_at_its_own_degrees(cli):
    """Megatron-LM's interleaved schedule (Narayanan et al. 2021, sec. 2.2) at an explicit
    configuration: pp meshes of tp x dp devices, pp x v chunks of equal blocks dealt
    round-robin, and with few microbatches a smaller bubble than its 1F1B plan, by about
    the closed form's (pp - 1) / v. With just too little memory the plan is infeasible
    and says what it needs, by term; a configuration that cannot interleave is refused
    in one line."""
    from alpasim import solvers as sv

    cluster = get_cluster("dgx-a100", nodes=1, devices_per_node=8)
    model, config = "gpt3-1.3b:batch=8,layers=8", sv.MegatronConfig(2, 4, 1, 2)
    plain = sv.plan_model(model, cluster, "megatron", megatron=config)
    woven = sv.plan_model(model, cluster, "megatron", megatron=config, schedule="interleaved", chunk_options=(2,))
    assert (woven.schedule, woven.chunks, woven.num_meshes, len(woven.stages)) == ("interleaved", 2, 4, 8)
    assert [s.layers[1] - s.layers[0] + 1 for s in woven.stages] == [1] * 8
    assert all(len(s.devices) == 2 and tuple(s.logical_mesh) == (1, 2) for s in woven.stages)
    assert woven.microbatches == plain.microbatches == 4
    t_plain = simulate(plain, plain.schedule).iteration_s
    t_woven = simulate(woven, woven.schedule, chunks=2).iteration_s
    # Balanced stages of t per microbatch: (B + pp - 1) t against (B + (pp - 1) / v) t,
    # 21 % less; the embedding and head make the end stages heavier and each chunk
    # boundary is a transfer, so less is saved, but never more than the closed form.
    closed_form = (4 + 3 / 2) / (4 + 3)
    assert t_plain * closed_form * 0.95 < t_woven < t_plain * 0.95
    shown = cli.json("plan", "--model", model, "--cluster", "dgx-a100", "--nodes", "1", "--method", "megatron",
                     "--tp", "2", "--pp", "4", "--dp", "1", "--microbatch-size", "2", "--schedule", "interleaved",
                     "--chunks", "2")
    assert shown["chunks"] == 2 and shown["predicted"]["iteration_s"] == pytest.approx(woven.predicted.iteration_s)
    # Just too little memory: the refusal names what the plan needs, by term.
    tight = cluster.with_overrides(memory_gb=woven.predicted.peak_memory_bytes * 0.99 / GIB)
    short = sv.plan_model(model, tight, "megatron", megatron=config, schedule="interleaved", chunk_options=(2,))
    assert not short.feasible
    need, states, acts = _shortfall(short.notes[0])
    assert short.predicted.iteration_s is None
    assert short.predicted.needed_memory_bytes == pytest.approx(need, rel=2e-3)
    assert need == pytest.approx(woven.predicted.peak_memory_bytes, rel=2e-3)
    assert states + acts == pytest.approx(need, rel=2e-3) and states > 0 and acts > 0
    refused = cli("plan", "--model", model, "--cluster", "dgx-a100", "--nodes", "1", "--method", "megatron",
                  "--tp", "8", "--pp", "1", "--dp", "1", "--microbatch-size", "2", "--schedule", "interleaved")
    assert refused.returncode == 2 and refused.lines == [
        "alpasim: error: Megatron tp=8 pp=1 dp=1 mbs=2: interleaving needs at least 2 pipeline stages"]


def test_megatron_counts_the_embedding_and_the_head_as_layers_where_asked(cli):
    """Megatron-core's --account-for-embedding-in-pipeline-split and
    --account-for-loss-in-pipeline-split (Llama 3's layout, whose first chunk holds only
    the embedding and whose last only the head and loss): a GPT of 2 blocks is 4 layers
    then, so pp 2 x 2 chunks cut it one layer a chunk, the embedding alone first and the
    head alone last; counted with the end blocks, as Megatron-LM does by default, 2
    blocks cannot make 4 virtual stages and the refusal names the blocks; past 4 layers
    it names the layers."""
    from alpasim import solvers as sv
    from alpasim.solvers._planning_graph import planning_graph

    cluster = get_cluster("aws-p3.16xlarge", nodes=1, devices_per_node=4)
    model = "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,dtype=fp32"
    ends = sv.MegatronConfig(2, 2, 1, 2, ends_as_layers=True)
    plan = sv.plan_model(model, cluster, "megatron", megatron=ends, schedule="interleaved", chunk_options=(2,))
    assert plan.feasible and plan.chunks == 2 and plan.search.megatron["ends_as_layers"] is True
    assert [s.layers for s in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    graph = planning_graph(plan.model)
    first = {tag for op in graph.ops if op.layer == 0 for tag in op.tags}
    last = {tag for op in graph.ops if op.layer == 3 for tag in op.tags}
    assert "embedding" in first and "head" in last and "embedding" not in last
    # The embedding's chunk is a lookup: far less work than a block's.
    assert plan.stages[0].forward_s < plan.stages[1].forward_s / 2
    with pytest.raises(ValueError, match="2 stages x 2 chunks is more virtual stages than .*'s 2 blocks$"):
        sv.plan_model(model, cluster, "megatron", megatron=sv.MegatronConfig(2, 2, 1, 2), schedule="interleaved",
                      chunk_options=(2,))
    with pytest.raises(ValueError, match=r"'s 4 layers \(2 blocks, the embedding and the head\)$"):
        sv.plan_model(model, cluster, "megatron", megatron=ends, schedule="interleaved", chunk_options=(3,))
    args = ("plan", "--model", model, "--cluster", "aws-p3.16xlarge", "--nodes", "1", "--devices-per-node", "4",
            "--method", "megatron", "--tp", "2", "--pp", "2", "--dp", "1", "--microbatch-size", "2")
    shown = cli.json(*args, "--schedule", "interleaved", "--chunks", "2", "--ends-as-layers")
    assert shown["search"]["megatron"]["ends_as_layers"] is True
    assert [s["layers"] for s in shown["stages"]] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    refused = cli("plan", "--model", model, "--method", "megatron", "--ends-as-layers")
    assert refused.returncode == 2 and refused.lines == [
        "alpasim: error: --ends-as-layers applies to an explicit Megatron configuration (--tp, --pp, --dp and "
        "--microbatch-size)"]


def test_meshes_of_whole_nodes_price_their_crossings_over_all_their_cards(monkeypatch):
    """The interleaved search prices the crossings between meshes of 2 whole nodes each
    with both nodes' cards (`stage_boundary_s(..., nodes=2)`), as the stage boundary's
    own test holds it; a plan's makespan with them is below the one-node price's."""
    from alpasim import solvers as sv
    from alpasim.solvers import _inter_op

    asked = []
    real = _inter_op.stage_boundary_s

    def spy(graph, cluster, nodes=1):
        asked.append(nodes)
        return real(graph, cluster, nodes)

    monkeypatch.setattr(_inter_op, "stage_boundary_s", spy)
    cluster = get_cluster("dgx-h100", nodes=4)
    config = sv.MegatronConfig(8, 2, 2, 1, ends_as_layers=True)
    model = "gpt3:hidden=512,layers=2,heads=8,seq=1024,vocab=1024,batch=8"
    plan = sv.plan_model(model, cluster, "megatron", megatron=config, schedule="interleaved", chunk_options=(2,))
    assert plan.feasible and plan.chunks == 2 and 2 in asked
    wide = plan.predicted.iteration_s
    monkeypatch.setattr(_inter_op, "stage_boundary_s", lambda graph, cluster, nodes=1: real(graph, cluster))
    narrow = sv.plan_model(model, cluster, "megatron", megatron=config, schedule="interleaved", chunk_options=(2,))
    assert narrow.predicted.iteration_s > wide
