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
  fixes its layout, and which activations are live at each point of the op order;
  each op that reduces its result over a mesh axis adds a point of its own, the live
  set there plus its unreduced partial result (`<op>:partial`, sized by the strategy's
  collectives; `costmodels` module doc for why).

`evaluate` recomputes a choice's cost from the graph itself, not from these matrices,
so tests can hold the ILP to an independent answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from alpasim.costmodels import CostModel, accumulating_cast, fuse, liveness
from alpasim.graphs import OpGraph, Tensor, is_heavy

from ._mesh import LogicalMesh
from ._resharding import Collective, resharding_collectives, resharding_time_s
from ._spec import ShardingSpec, all_specs
from ._strategies import Strategy, enumerate_strategies, graph_strategies, op_signature

PERSISTENT_ROLES = ("param", "optimizer_state", "grad")
# Light ops that only make or re-lay-out a tensor; on leaves alone they are deferred
# into their reader's group (`build_problem`).
LAYOUT_PRIMS = frozenset({"full", "constant", "iota", "broadcast", "reshape", "convert", "transpose"})


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
    share: int = -1                      # edges of one share group pay each (src, dst) spec pair once


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
    live_sets: list[list[str]]           # activation tensors live at each candidate peak (none inside another)
    loop_backs: list[tuple[str, str]]    # (new value, parameter) pairs
    strategies: dict[str, list[Strategy]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)   # what the builder had to relax, and why
    stash: list[str] = field(default_factory=list)   # activations kept from forward to backward
    partials: dict[str, str] = field(default_factory=dict)   # partial-result name -> the op that makes it
    # tensor_bytes per (node, tensor): the time, memory and dominance programs of one
    # problem all ask for the same arrays.
    _bytes: dict[tuple[int, str], np.ndarray] = field(default_factory=dict, repr=False, compare=False)
    _dominated: list[np.ndarray] | None = field(default=None, repr=False, compare=False)   # `_intra_ilp.dominated`
    # Edges that read one tensor of one node in one phase (`share_groups`).
    shares: list[list[int]] = field(default_factory=list)

    def edge_cost_s(self, choice: Sequence[int], edges: Sequence[int] | None = None) -> float:
        """Resharding seconds of `choice` over `edges` (default all), each share group's
        distinct (stored, needed) spec pairs paid once."""
        total = 0.0
        seen: set[tuple[int, object, object]] = set()
        for k in range(len(self.edges)) if edges is None else edges:
            e = self.edges[k]
            a, b = e.src_spec[choice[e.src]], e.dst_spec[choice[e.dst]]
            if a == b:
                continue
            if e.share >= 0:
                key = (e.share, e.specs[a], e.specs[b])
                if key in seen:
                    continue
                seen.add(key)
            total += float(e.cost[a, b])
        return total

    def tensor_bytes(self, node: int, tensor: str) -> np.ndarray:
        """Per-device bytes of `tensor` under each strategy of `node` (a gradient's
        accumulator at its unreduced size where it is scattered once per iteration; an
        op's unreduced partial result: `partial_bytes` of the op's strategy)."""
        key = (node, tensor)
        cached = self._bytes.get(key)
        if cached is not None:
            return cached
        n = self.nodes[node]
        op = self.partials.get(tensor)
        if op is not None:
            out = np.array([partial_bytes(c[op]) for c in n.choices])
        else:
            t = self.graph.tensors[tensor]
            grad = t.role == "grad"
            out = np.array([t.nbytes / s[tensor].num_shards(self.mesh)
                            * (accumulator_factor(self.graph, self.mesh, n.choices[i].get, tensor)
                               * kept_gradient_factor(self.graph, tensor) if grad else 1.0)
                            for i, s in enumerate(n.specs)])
        out.flags.writeable = False        # shared by every formulation of this problem
        self._bytes[key] = out
        return out


    def full_bytes(self, tensor: str) -> float:
        """Bytes of `tensor` on one device, unsharded (an upper bound, for scaling)."""
        op = self.partials.get(tensor)
        if op is not None:
            return float(sum(self.graph.tensors[t].nbytes for t in self.graph.op_by_name[op].outputs))
        return float(self.graph.tensors[tensor].nbytes)


PARTIAL_SUFFIX = ":partial"
REDUCING_COLLECTIVES = frozenset({"all_reduce", "reduce_scatter"})


def partial_bytes(strategy: Strategy) -> float:
    """Per-device bytes of the unreduced result an op writes before its own collectives
    reduce it over the mesh axes its contracted (or reduced) loops are split on: the
    collectives' input, whose per-device size is exactly each one's `nbytes`
    (`_strategies._finish_outputs`). 0 when the op reduces over no mesh axis."""
    return float(sum(c.nbytes for c in strategy.collectives if c.kind in REDUCING_COLLECTIVES))


def partial_points(graph: OpGraph, live, strategies: Mapping[str, Sequence[Strategy]]
                   ) -> tuple[list[list[str]], dict[str, str]]:
    """The live set at each op that may reduce its result over a mesh axis, with that
    op's partial result added (`costmodels` module doc: a reducing op holds its
    unreduced result next to the collective's output, at that op only)."""
    points: list[list[str]] = []
    partials: dict[str, str] = {}
    for n, i in enumerate(live.order):
        op = graph.ops[i]
        if not any(partial_bytes(s) for s in strategies.get(op.name, ())):
            continue
        name = op.name + PARTIAL_SUFFIX
        partials[name] = op.name
        points.append([t for t, (s, e) in live.intervals.items() if s <= n <= e] + [name])
    return points, partials


def accumulator_factor(graph: OpGraph, mesh: LogicalMesh, strategy_of, grad: str) -> float:
    """How many times larger a gradient's accumulator is than its stored layout. A
    gradient reduce-scattered once per iteration is summed over the microbatches before
    it is scattered, so each device accumulates the whole unreduced tensor (Alpa's
    weight-update sharding); one scattered every microbatch (ZeRO) keeps only its
    slice. Follows the cast into the fp32 accumulator back to the op that made the
    gradient; `strategy_of(op name)` gives the strategy each op runs (None: unknown)."""
    producer = graph.producer
    op = producer.get(grad)
    for _ in range(3):
        if op is None:
            break
        s = strategy_of(op.name)
        if s is not None:
            for c, once in zip(s.collectives, s.sync or (False,) * len(s.collectives)):
                if c.kind == "reduce_scatter" and once:
                    return float(mesh.axis_size(c.axes))
        if op.prim not in ("convert", "elementwise") or not op.inputs:
            break
        op = producer.get(op.inputs[0])
    return 1.0


def kept_gradient_factor(graph: OpGraph, grad: str) -> float:
    """1, or, for an accumulator its 16-bit gradient is added into after the backward
    (`graphs.PrecisionRecipe.accumulation` "after-backward": DeepSpeed's BF16_Optimizer
    keeps `lp.grad` until the next backward), 1 plus that gradient's bytes over the
    accumulator's: the two are laid out alike, the cast being elementwise."""
    op = graph.producer.get(grad)
    if op is None or not accumulating_cast(op):
        return 1.0
    return 1.0 + graph.tensors[op.inputs[0]].itemsize / graph.tensors[grad].itemsize


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
    fusion = fuse(graph)
    # Ops of one signature (an imported model's repeated blocks) share their strategy
    # list (`graph_strategies`) and their followers' choices (`follow`): both depend on
    # nothing else.
    signature = {op.name: op_signature(op, tensors, fusion.of(op.name)) for op in graph.ops}
    strategies, notes = _op_strategies(graph, mesh, cost_model, restrict, fusion, signature, allow_replicated_heavy)
    owned = {t for t, tensor in tensors.items()
             if tensor.role == "optimizer_state" and _is_leaf(graph, t)}
    nodes = _leaf_nodes(graph, mesh, owned, leaf_specs or {})
    node_of = {node.leaf: k for k, node in enumerate(nodes)}
    members, deferred = _groups(graph, restrict)
    followed: dict[tuple, Strategy] = {}

    def follow(op, known: dict[str, ShardingSpec]) -> Strategy:
        key = ((op.name,) if op.name in restrict else signature[op.name]) + tuple(known.get(t) for t in op.inputs)
        if key not in followed:
            followed[key] = _follow(op, strategies[op.name], known, tensors, mesh, with_compute, microbatches)
        return followed[key]

    for root, names in members.items():
        idx = len(nodes)
        nodes.append(_group_node(graph, mesh, root, names, strategies, deferred, owned, follow, with_compute,
                                 microbatches))
        for name in names:
            for t in graph.op_by_name[name].outputs:
                node_of[t] = idx
            for t in graph.op_by_name[name].inputs:
                if t in owned:
                    node_of[t] = idx
    edges, loop_backs = _edges(graph, mesh, nodes, node_of, owned, microbatches)
    edges, shares = share_groups(graph, edges)
    persistent = [t for t, tensor in tensors.items()
                  if tensor.role in PERSISTENT_ROLES and t in node_of and not t.endswith(":new")
                  and (tensor.role != "param" or _is_leaf(graph, t))]
    # Activation lifetimes by the stage-memory rules (`costmodels.liveness`): the live
    # sets are the ILP's candidate peaks, the stash what each further microbatch in
    # flight holds.
    # An op that reduces its result over a mesh axis adds a candidate peak of its own:
    # the live set there plus its unreduced partial, whose layout its group fixes.
    live = liveness(graph)
    points, partials = partial_points(graph, live, strategies)
    for name, op in partials.items():
        node_of[name] = node_of[graph.op_by_name[op].outputs[0]]
    return IntraOpProblem(graph, mesh, with_compute, microbatches, nodes, edges, node_of, persistent,
                          maximal_live_sets(live.live_sets() + points), loop_backs, strategies, notes, live.stash(),
                          partials, shares=shares)


def _op_strategies(graph: OpGraph, mesh: LogicalMesh, cost_model: CostModel, restrict: Mapping[str, Sequence[Strategy]],
                   fusion, signature: Mapping[str, tuple], allow_replicated_heavy: bool
                   ) -> tuple[dict[str, list[Strategy]], list[str]]:
    """Each op's strategies (a restricted op: its given ones), and a note for each op
    with no even split over every mesh axis, which then may replicate."""
    strategies: dict[str, list[Strategy]] = {}
    notes: list[str] = []
    for op in graph.ops:
        if op.name in restrict:
            strategies[op.name] = list(restrict[op.name])
        else:
            strategies[op.name] = graph_strategies(op, graph, mesh, cost_model, signature=signature[op.name],
                                                   allow_replicated_heavy=allow_replicated_heavy)
        if not strategies[op.name]:
            # No even split of this op uses every mesh axis (e.g. a 1x3 mesh and
            # power-of-two dimensions): let it replicate rather than fail, and say so.
            strategies[op.name] = enumerate_strategies(op, graph.tensors, mesh, cost_model,
                                                       allow_replicated_heavy=True, access=fusion.of(op.name))
            notes.append(f"{op.name}: no even split over every axis of the {mesh} mesh; "
                         f"it may run replicated on some axes")
    return strategies, notes


def _leaf_nodes(graph: OpGraph, mesh: LogicalMesh, owned: set[str],
                leaf_specs: Mapping[str, Sequence[ShardingSpec]]) -> list[Node]:
    """A node per leaf (parameter or stage input) an op reads, in first-read order: one
    choice per layout it may take (`leaf_specs` narrows them)."""
    nodes = []
    for t in dict.fromkeys(t for op in graph.ops for t in op.inputs):
        if not _is_leaf(graph, t) or t in owned:
            continue
        specs = list(leaf_specs.get(t, all_specs(graph.tensors[t].shape, mesh)))
        nodes.append(Node(f"leaf:{t}", t, (), np.zeros(len(specs)), [{} for _ in specs],
                          [{t: s} for s in specs], [[] for _ in specs]))
    return nodes


def _groups(graph: OpGraph, restrict: Mapping[str, Sequence[Strategy]]) -> tuple[dict[str, list[str]], set[str]]:
    """Root op -> the ops of its group (module doc), and the deferred layout ops among them."""
    depth = _depths(graph)
    root_of: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    deferred: list = []
    for op in graph.ops:
        produced = [graph.producer[t] for t in op.inputs
                    if not _is_leaf(graph, t) and graph.producer[t].name in root_of]
        if (not produced and op.prim in LAYOUT_PRIMS and op.name not in restrict
                and graph.consumers.get(op.outputs[0])):
            deferred.append(op)
            continue
        if is_heavy(op) or not produced or op.name in restrict:
            root_of[op.name] = op.name
            members[op.name] = [op.name]
            continue
        leader = max(produced, key=lambda p: (depth[p.name], graph.op_index[p.name]))
        root = root_of[leader.name]
        root_of[op.name] = root
        members[root].append(op.name)
    # A layout op on leaves only (a constant, a broadcast norm scale) joins the group of
    # its first reader, after it, in the layout that reader needs: making it costs
    # nothing in any layout, so it needs no decision (and no edge) of its own.
    for op in reversed(deferred):
        root = root_of[graph.consumers[op.outputs[0]][0].name]
        root_of[op.name] = root
        members[root].append(op.name)
    return members, {op.name for op in deferred}


def _group_node(graph: OpGraph, mesh: LogicalMesh, root: str, names: Sequence[str],
                strategies: Mapping[str, list[Strategy]], deferred: set[str], owned: set[str], follow,
                with_compute: bool, microbatches: int) -> Node:
    """The node of the group `root` leads: one choice per root strategy, each member
    following it (`follow`), with the group's compute and inner resharding as its cost."""
    tensors = graph.tensors
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
            elif name in deferred:
                # Its readers in the group came first and found no spec for it: pick
                # its layout for them, and charge any resharding to theirs now.
                t = op.outputs[0]
                reads = _group_reads(t, choices[i], graph, microbatches)
                s = _lead(strategies[name], reads, tensors[t].nbytes, mesh, with_compute, microbatches)
                for spec, rscale in reads:
                    for c in resharding_collectives(s.out_specs[0], spec, tensors[t].nbytes, mesh):
                        inner[i].append((t, c))
                        cost[i] += c.time_s(mesh) * rscale
            else:
                s = follow(op, specs[i])
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
    return Node(f"group:{root}", None, tuple(names), cost, choices, specs, inner)


def _edges(graph: OpGraph, mesh: LogicalMesh, nodes: Sequence[Node], node_of: Mapping[str, int], owned: set[str],
           microbatches: int) -> tuple[list[Edge], list[tuple[str, str]]]:
    """An edge per tensor read across nodes (and per leaf read inside its group), and
    one per Adam update back to its parameter's leaf (the loop-back), with those pairs."""
    tensors = graph.tensors
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
    return edges, loop_backs


def reshard_key(graph: OpGraph, tensor: str, consumer: str) -> tuple[str, str]:
    """What one resharding of `tensor` for `consumer` can be shared by: readers of the
    same tensor in the same phase that need the same spec get one collective (XLA
    merges identical collectives; Megatron-LM gathers a sequence-parallel norm's output
    once for Q, K and V). A forward and a backward read pay separately: the stash holds
    the stored layout, and the backward gathers it again."""
    op = graph.op_by_name.get(consumer)
    return tensor, (op.phase if op is not None else consumer)


def share_groups(graph: OpGraph, edges: list[Edge]) -> tuple[list[Edge], list[list[int]]]:
    """(`edges` with `share` set on those that share a producer node and `reshard_key`,
    the edge indices of each share group)."""
    groups: dict[tuple, list[int]] = {}
    for k, e in enumerate(edges):
        groups.setdefault((e.src, *reshard_key(graph, e.tensor, e.consumer)), []).append(k)
    out = list(edges)
    shares = [members for members in groups.values() if len(members) > 1]
    for g, members in enumerate(shares):
        for k in members:
            out[k] = dataclasses.replace(edges[k], share=g)
    return out, shares


def maximal_live_sets(live_sets: Sequence[Sequence[str]]) -> list[Sequence[str]]:
    """The candidate peaks that are not contained in another one (of equal ones, the
    first). Every tensor's memory is >= 0, so a live set inside another can never be
    the larger: the peak and the ILP's memory rows are the same without it, with about
    40 % fewer rows on GPT and MoE layers, which is what the memory-budgeted
    relaxations spend their time on."""
    sets = [frozenset(live) for live in live_sets]
    return [live_sets[i] for i, a in enumerate(sets)
            if not any(a < b or (a == b and j < i) for j, b in enumerate(sets) if j != i)]


def _group_reads(tensor: str, chosen: Mapping[str, Strategy], graph: OpGraph,
                 microbatches: int) -> list[tuple[ShardingSpec, float]]:
    """(layout, cost scale) of every read of `tensor` by the group's chosen ops (an
    update reads once per iteration: its resharding counts 1/B per microbatch)."""
    return [(spec, 1.0 / microbatches if reader.phase == "update" else 1.0)
            for reader in graph.consumers[tensor] if reader.name in chosen
            for t, spec in zip(reader.inputs, chosen[reader.name].in_specs) if t == tensor]


def _lead(options: list[Strategy], reads: Sequence[tuple[ShardingSpec, float]], nbytes: float,
          mesh: LogicalMesh, with_compute: bool, microbatches: int) -> Strategy:
    """A deferred layout op's strategy: the cheapest given the layouts its readers in
    the group (already chosen) read its output in."""
    best, best_cost = options[0], float("inf")
    for s in options:
        cost = s.cost_s(with_compute, microbatches) + sum(
            resharding_time_s(s.out_specs[0], need, nbytes, mesh) * scale for need, scale in reads)
        if cost < best_cost - 1e-15:
            best, best_cost = s, cost
    return best


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
