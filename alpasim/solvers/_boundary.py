"""What a pipeline stage pays to receive its inputs: the stage DP's boundary term.

Eq. 2 prices a stage by its intra-op time alone, yet every microbatch's activations
enter a stage from its predecessor and their gradients go back, and under 1F1B each
of those messages sits on the critical path of a round trip. The simulator charges
them; without this term the DP cannot see that a deep pipeline whose boundaries cross
the 25 Gb/s network loses to a shallower one (the paper's Figure 9 at 32 GPUs).

`cut_bytes` counts, per layer boundary k (between layers k-1 and k), the bytes that
cross it per microbatch in each direction; `stage_boundary_s` turns them into seconds
for a stage that starts at layer k, both ways: from a predecessor on the same node
(the intra-node link) and from one on another node (one node's network cards). The
stage DP decides which neighbours share a node (`_stage_dp`, runs).
"""

from __future__ import annotations

import numpy as np

from alpasim.costmodels import Cluster
from alpasim.graphs import OpGraph

from ._stage_dp import StageBoundary


def cut_bytes(graph: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) bytes crossing each layer boundary per microbatch.

    A tensor produced in layer a and read in later layers crosses every boundary up to
    its last reader; one read in earlier layers (a cotangent) crosses back down to its
    first reader. Tensors whose cross-layer reads only feed parameter gradients or
    updates move once per iteration (`stage_transfers`) and are left out."""
    num_layers = graph.num_layers
    forward, backward = np.zeros(num_layers), np.zeros(num_layers)
    producer_layer = {t: op.layer for op in graph.ops for t in op.outputs}
    reads: dict[str, list[tuple[int, bool]]] = {}
    for op in graph.ops:
        to_grad = op.phase == "update" or all(graph.tensors[o].role == "grad" for o in op.outputs)
        for t in op.inputs:
            if t in producer_layer and producer_layer[t] != op.layer:
                reads.setdefault(t, []).append((op.layer, to_grad))
    tied = set(graph.meta.get("tied_grads", ()))       # summed into a gradient: once per iteration
    for t, rs in reads.items():
        if graph.tensors[t].role != "activation" or all(g for _, g in rs) or t in tied:
            continue
        a, nbytes = producer_layer[t], graph.tensors[t].nbytes
        later = [r for r, _ in rs if r > a]
        earlier = [r for r, _ in rs if r < a]
        if later:
            forward[a + 1:max(later) + 1] += nbytes
        if earlier:
            backward[min(earlier) + 1:a + 1] += nbytes
    return forward, backward


def stage_boundary_s(graph: OpGraph, cluster: Cluster, nodes: int = 1) -> StageBoundary:
    """Seconds per microbatch a stage starting at layer k spends receiving activations and
    returning their gradients: over the intra-node link when its predecessor shares its
    node, over the network cards otherwise: one node's, or, for stages of `nodes` whole
    nodes each, all of theirs at once (each node exchanges its devices' share with the
    matching node of the neighbour: a 512-GPU Llama 3 stage moves its 64 sequences'
    activations over 64 nodes' cards, not one's; a layout that needs the whole tensor on
    every node would move more). Zero for the first layer."""
    forward, backward = cut_bytes(graph)
    span = max(1, nodes)
    cards = min(cluster.nics_per_node, cluster.devices_per_node) * span

    def seconds(bytes_per_s: float, latency_s: float) -> np.ndarray:
        out = (forward + backward) / bytes_per_s + latency_s * ((forward > 0).astype(float) + (backward > 0))
        out[0] = 0.0
        return out

    # Between neighbouring stages (placed side by side): their nodes' cards at once, or
    # the spine uplinks of the leaves the stage spans when the neighbour's first node
    # sits on another leaf (`Cluster.route`).
    across = cluster.inter_node.bytes_per_s * cards
    if cluster.nodes > span and cluster.leaf_of(0) != cluster.leaf_of(span):
        leaves = max(1, span // cluster.spine.nodes_per_leaf)
        across = min(across, cluster.spine_uplink().bytes_per_s * leaves)
    return StageBoundary(seconds(cluster.intra_node.bytes_per_s, cluster.intra_node.latency_s),
                         seconds(across, cluster.inter_node.latency_s))


def whole_nodes(devices: int, cluster: Cluster) -> int:
    """The whole nodes a mesh of `devices` spans (1 for a mesh inside a node): the nodes
    whose cards carry its crossings (`stage_boundary_s`)."""
    return max(1, devices // cluster.devices_per_node)
