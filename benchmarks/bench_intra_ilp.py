"""Size and solve time of the intra-op ILP on paper-scale stages: HiGHS against CBC.

Prints, per formulation: nodes, edges, binary variables, continuous variables and
constraints; the time to build the problem and its formulation; the solve time of
HiGHS and of CBC (each given the same matrices; CBC through PuLP); and whether both
reach the same objective.
Stages are one layer of the training graph (forward, backward and Adam) at microbatch
8 on aws-p3.16xlarge meshes, with the device's memory as the budget, as the inter-op
pass would call it. CBC gets a time limit; a row that hits it says so.
The reference loop (`_reference`) is timed before the table and again after it; a
second table gives the build, HiGHS and CBC times in reference units (seconds / the
first reference loop's).

    .venv/bin/python benchmarks/bench_intra_ilp.py [--time-limit 60]
"""

from __future__ import annotations

import argparse
import time

from alpasim.costmodels import AnalyticCostModel, get_cluster
from alpasim.graphs import build_training_graph, stage_graph
from alpasim.solvers import LogicalMesh, build_problem, formulate, solve_ilp

try:
    from _reference import in_ref, print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_intra_ilp` from the repository root
    from benchmarks._reference import in_ref, print_reference

CLUSTER = "aws-p3.16xlarge"
# (label, model, layer, mesh shape): a middle layer of each model; layer 8 of
# moe-2.4b is an MoE layer (experts every other layer), of wresnet-2b a plain block.
CASES = [
    ("gpt3-1.3b L12", "gpt3-1.3b:batch=8", 12, (1, 8)),
    ("gpt3-1.3b L12", "gpt3-1.3b:batch=8", 12, (2, 4)),
    ("gpt3-1.3b L12", "gpt3-1.3b:batch=8", 12, (4, 2)),
    ("moe-2.4b L8", "moe-2.4b:batch=8", 8, (2, 4)),
    ("wresnet-2b L8", "wresnet-2b:batch=8", 8, (2, 4)),
]
SAME_RTOL = 1e-6


def main(time_limit_s: float) -> None:
    cluster = get_cluster(CLUSTER)
    cost_model = AnalyticCostModel(cluster)
    budget = cluster.device.memory_bytes
    graphs = {}
    ref_s = print_reference()
    in_units = []
    print(f"{'stage':<15}{'mesh':>5}{'ops':>5}{'nodes':>6}{'edges':>6}{'binary':>7}{'cont':>6}{'rows':>6}"
          f"{'build s':>9}{'HiGHS s':>9}{'CBC s':>12}  same objective")
    for label, model, layer, shape in CASES:
        if model not in graphs:
            graphs[model] = build_training_graph(model).graph
        stage = stage_graph(graphs[model], layer, layer)
        mesh = LogicalMesh.on_cluster(cluster, shape)
        t0 = time.perf_counter()
        problem = build_problem(stage, mesh, cost_model)
        form = formulate(problem, budget)
        build_s = time.perf_counter() - t0
        binary = form.num_integer
        highs = solve_ilp(form, "highs")
        cbc = solve_ilp(form, "cbc", time_limit_s)
        cbc_s = {"optimal": f"{cbc.wall_s:.2f}", "time_limit": "time limit"}.get(cbc.status, cbc.status)
        if highs.objective_s is None or cbc.objective_s is None:
            same = "n/a"
        else:
            gap = abs(highs.objective_s - cbc.objective_s) / max(abs(highs.objective_s), 1e-30)
            same = f"{'yes' if gap <= SAME_RTOL else 'NO'} ({highs.objective_s * 1e3:.4f} ms, rel diff {gap:.1e})"
        print(f"{label:<15}{str(mesh):>5}{len(stage.ops):>5}{len(problem.nodes):>6}{len(problem.edges):>6}"
              f"{binary:>7}{form.num_cols - binary:>6}{form.num_rows:>6}{build_s:>9.2f}"
              f"{highs.wall_s:>9.2f}{cbc_s:>12}  {same}", flush=True)
        cbc_ref = in_ref(cbc.wall_s, ref_s) if cbc.status == "optimal" else cbc_s
        in_units.append(f"{label:<15}{str(mesh):>5}{in_ref(build_s, ref_s):>9}{in_ref(highs.wall_s, ref_s):>9}"
                        f"{cbc_ref:>12}")
    print_reference("at the end")
    print("in reference units (seconds / the first reference loop):")
    print(f"{'stage':<15}{'mesh':>5}{'build':>9}{'HiGHS':>9}{'CBC':>12}")
    print("\n".join(in_units))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=60.0, help="CBC time limit in seconds")
    main(parser.parse_args().time_limit)
