"""The intra-op problem as a named structure: nodes, strategies, edges, memory terms.

Built from a (stage) graph, a logical mesh and a cost model, before any solver sees it:

* **Leaf nodes**: each parameter or stage input the stage reads, with one strategy per
  valid spec of it (storing it costs nothing; using it in another spec pays resharding).
  Optimizer states are not nodes: they are stored in whatever layout their update op
  runs in.
* **Groups** (seed 3.4.5 simplification): every heavy op roots a group; a light op
  joins the group of its deepest operand produced inside the stage and, for each of
  that group's strategies, takes its own cheapest strategy given the leader operand's
  spec. A light op with only leaf operands roots its own group. A group's strategy
  count is its root's, so a GPT layer's problem stays a few dozen nodes.
* **Edges**: a tensor produced (or stored) by one node and read by another, with a
  resharding cost per (producer spec, consumer spec) pair.
* **Costs per microbatch**: with B microbatches of gradient accumulation, weight-gradient
  synchronisation, optimizer ops and resharding for them happen once per iteration,
  everything else B times; costs are per microbatch with the former divided by B. An update op writing a new
  parameter value adds the edge back to the parameter's leaf (Adam updates in place,
  so the new value must end up in the stored layout).
* **Memory terms**: bytes per device of each tensor under each strategy of the node that
  fixes its layout, and which activations are live at each point of the op order.

`evaluate` recomputes a choice's cost from the graph itself, not from these matrices,
so tests can hold the ILP to an independent answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from alpasim.costmodels import CostModel, liveness
from alpasim.graphs import OpGraph, Tensor, is_heavy

from ._mesh import LogicalMesh
from ._resharding import Collective, resharding_collectives, resharding_time_s
from ._spec import ShardingSpec, all_specs
from ._strategies import Strategy, enumerate_strategies

PERSISTENT_ROLES = ("param", "optimizer_state", "grad")


@dataclass
class Node:
    """One decision of the ILP: a leaf tensor's layout or a group's strategy index."""

    name: str
    leaf: str | None                     # the tensor, for a leaf node
    ops: tuple[str, ...]                 # member ops, root first, for a group
    cost: np.ndarray                     # (k,) own cost per strategy (comm [+ compute] + in-group resharding)
    # Per strategy: the strategy of every member op (groups) and the spec of every
    # tensor whose layout this node fixes (outputs of members, owned states, the leaf).
    choices: list[dict[str, Strategy]]
    specs: list[dict[str, ShardingSpec]]
    inner: list[list[tuple[str, Collective]]]  # per strategy: in-group resharding collectives

    @property
    def k(self) -> int:
        return len(self.cost)


@dataclass
class Edge:
    """Tensor `tensor` stored by node `src` in one spec, needed by node `dst` in another."""

    src: int
    dst: int
    tensor: str
    consumer: str                        # op that reads it (or "loop-back:<param>")
    specs: list[ShardingSpec]            # distinct specs on either side
    src_spec: np.ndarray                 # (k_src,) index into specs per src strategy
    dst_spec: np.ndarray                 # (k_dst,) index into specs per dst strategy
    cost: np.ndarray                     # (len(specs), len(specs)) resharding seconds


@dataclass
class IntraOpProblem:
    graph: OpGraph
    mesh: LogicalMesh
    with_compute: bool
    microbatches: int                    # once-per-iteration costs are divided by this
    nodes: list[Node]
    edges: list[Edge]
    node_of_tensor: dict[str, int]       # which node fixes each tensor's layout
    persistent: list[str]                # tensors held for the whole step
    live_sets: list[list[str]]           # activation tensors live at each checked point
    loop_backs: list[tuple[str, str]]    # (new value, parameter) pairs
    strategies: dict[str, list[Strategy]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)   # what the builder had to relax, and why
    stash: list[str] = field(default_factory=list)   # activations kept from forward to backward

    def tensor_bytes(self, node: int, tensor: str) -> np.ndarray:
        """Per-device bytes of `tensor` under each strategy of `node`."""
        t = self.graph.tensors[tensor]
        return np.array([t.nbytes / s[tensor].num_shards(self.mesh) for s in self.nodes[node].specs])


def _depths(graph: OpGraph) -> dict[str, int]:
    depth: dict[str, int] = {}
    for op in graph.ops:
        d = 0
        for t in op.inputs:
            p = graph.producer.get(t)
            if p is not None:
                d = max(d, depth[p.name] + 1)
        depth[op.name] = d
    return depth


def _is_leaf(graph: OpGraph, t: str) -> bool:
    return t not in graph.producer


def build_problem(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel, *, with_compute: bool = False,
                  microbatches: int = 1, allow_replicated_heavy: bool = False,
                  restrict: Mapping[str, Sequence[Strategy]] | None = None,
                  leaf_specs: Mapping[str, Sequence[ShardingSpec]] | None = None) -> IntraOpProblem:
    """Turn a graph into nodes and edges (module doc). `restrict` and `leaf_specs`
    narrow the choices of named ops and leaves (how baselines are expressed)."""
    tensors = graph.tensors
    restrict = restrict or {}
    leaf_specs = leaf_specs or {}
    strategies: dict[str, list[Strategy]] = {}
    notes: list[str] = []
    for op in graph.ops:
        if op.name in restrict:
            strategies[op.name] = list(restrict[op.name])
        else:
            strategies[op.name] = enumerate_strategies(op, tensors, mesh, cost_model,
                                                       allow_replicated_heavy=allow_replicated_heavy)
        if not strategies[op.name]:
            # No even split of this op uses every mesh axis (e.g. a 1x3 mesh and
            # power-of-two dimensions): let it replicate rather than fail, and say so.
            strategies[op.name] = enumerate_strategies(op, tensors, mesh, cost_model, allow_replicated_heavy=True)
            notes.append(f"{op.name}: no even split over every axis of the {mesh} mesh; "
                         f"it may run replicated on some axes")

    owned = {t for t, tensor in tensors.items()
             if tensor.role == "optimizer_state" and _is_leaf(graph, t)}
    nodes: list[Node] = []
    node_of: dict[str, int] = {}

    # Leaves: parameters and stage inputs.
    for t in dict.fromkeys(t for op in graph.ops for t in op.inputs):
        if not _is_leaf(graph, t) or t in owned:
            continue
        specs = list(leaf_specs.get(t, all_specs(tensors[t].shape, mesh)))
        node_of[t] = len(nodes)
        nodes.append(Node(f"leaf:{t}", t, (), np.zeros(len(specs)), [{} for _ in specs],
                          [{t: s} for s in specs], [[] for _ in specs]))

    # Groups.
    depth = _depths(graph)
    root_of: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    for op in graph.ops:
        produced = [graph.producer[t] for t in op.inputs if not _is_leaf(graph, t)]
        if is_heavy(op) or not produced or op.name in restrict:
            root_of[op.name] = op.name
            members[op.name] = [op.name]
            continue
        leader = max(produced, key=lambda p: (depth[p.name], graph.op_index[p.name]))
        root = root_of[leader.name]
        root_of[op.name] = root
        members[root].append(op.name)

    for root, names in members.items():
        n = len(strategies[root])
        cost = np.zeros(n)
        choices: list[dict[str, Strategy]] = [{} for _ in range(n)]
        specs: list[dict[str, ShardingSpec]] = [{} for _ in range(n)]
        inner: list[list[tuple[str, Collective]]] = [[] for _ in range(n)]
        for i in range(n):
            for name in names:
                op = graph.op_by_name[name]
                if name == root:
                    s = strategies[name][i]
                else:
                    s = _follow(op, strategies[name], specs[i], tensors, mesh, with_compute, microbatches)
                choices[i][name] = s
                cost[i] += s.cost_s(with_compute, microbatches)
                scale = 1.0 / microbatches if op.phase == "update" else 1.0
                for t, spec in zip(op.inputs, s.in_specs):
                    if t in specs[i]:  # produced earlier in this group: reshard inside it
                        for c in resharding_collectives(specs[i][t], spec, tensors[t].nbytes, mesh):
                            inner[i].append((t, c))
                            cost[i] += c.time_s(mesh) * scale
                    elif t in owned:
                        specs[i][t] = spec
                for t, spec in zip(op.outputs, s.out_specs):
                    specs[i][t] = spec
        idx = len(nodes)
        nodes.append(Node(f"group:{root}", None, tuple(names), cost, choices, specs, inner))
        for name in names:
            for t in graph.op_by_name[name].outputs:
                node_of[t] = idx
            for t in graph.op_by_name[name].inputs:
                if t in owned:
                    node_of[t] = idx

    edges: list[Edge] = []
    loop_backs: list[tuple[str, str]] = []
    for op in graph.ops:
        dst = node_of[op.outputs[0]]
        for pos, t in enumerate(op.inputs):
            if t in owned:
                continue
            src = node_of[t]
            if src == dst and not _is_leaf(graph, t):
                continue  # resharding inside the group is part of its cost
            edges.append(_edge(nodes, src, dst, t, op.name, lambda i, name=op.name, pos=pos, d=dst:
                               nodes[d].choices[i][name].in_specs[pos], tensors, mesh,
                               1.0 / microbatches if op.phase == "update" else 1.0))
        if op.prim == "adam":
            param, new = op.inputs[0], op.outputs[0]
            if param in node_of and nodes[node_of[param]].leaf == param:
                loop_backs.append((new, param))
                edges.append(_edge(nodes, dst, node_of[param], new, f"loop-back:{param}",
                                   lambda i, p=param, n=node_of[param]: nodes[n].specs[i][p], tensors, mesh,
                                   1.0 / microbatches))

    persistent = [t for t, tensor in tensors.items()
                  if tensor.role in PERSISTENT_ROLES and t in node_of and not t.endswith(":new")
                  and (tensor.role != "param" or _is_leaf(graph, t))]
    # Activation lifetimes by the stage-memory rules (`costmodels.liveness`): the live
    # sets are the ILP's candidate peaks, the stash what each further microbatch in
    # flight holds.
    live = liveness(graph)
    return IntraOpProblem(graph, mesh, with_compute, microbatches, nodes, edges, node_of, persistent,
                          live.live_sets(), loop_backs, strategies, notes, live.stash())


def _follow(op, options: list[Strategy], known: dict[str, ShardingSpec], tensors: Mapping[str, Tensor],
            mesh: LogicalMesh, with_compute: bool, microbatches: int) -> Strategy:
    """A follower's cheapest strategy given the specs its group already fixed."""
    best, best_cost = options[0], float("inf")
    scale = 1.0 / microbatches if op.phase == "update" else 1.0
    for s in options:
        cost = s.cost_s(with_compute, microbatches)
        for t, spec in zip(op.inputs, s.in_specs):
            if t in known:
                cost += resharding_time_s(known[t], spec, tensors[t].nbytes, mesh) * scale
        if cost < best_cost - 1e-15:
            best, best_cost = s, cost
    return best


def _edge(nodes: list[Node], src: int, dst: int, tensor: str, consumer: str, dst_spec_of, tensors,
          mesh: LogicalMesh, scale: float = 1.0) -> Edge:
    src_specs = [nodes[src].specs[i][tensor] for i in range(nodes[src].k)]
    dst_specs = [dst_spec_of(i) for i in range(nodes[dst].k)]
    distinct = list(dict.fromkeys(src_specs + dst_specs))
    index = {s: i for i, s in enumerate(distinct)}
    nbytes = tensors[tensor].nbytes
    cost = np.zeros((len(distinct), len(distinct)))
    for a in dict.fromkeys(src_specs):
        for b in dict.fromkeys(dst_specs):
            cost[index[a], index[b]] = resharding_time_s(a, b, nbytes, mesh) * scale
    return Edge(src, dst, tensor, consumer, distinct, np.array([index[s] for s in src_specs]),
                np.array([index[s] for s in dst_specs]), cost)
