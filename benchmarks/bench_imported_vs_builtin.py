"""A GPT written in flax against the built-in gpt3 of the same shape: priced alike?

Prints, per recompute policy, the predicted training-step time and memory of the whole
model as one stage (the intra-op ILP's plan on a 1x1 and a 2x2 mesh of the cluster,
compute in the objective) for the imported graph and the built-in one, and their
ratio; then, with `--plan`, the wall time of `plan_pipeline` for each (no cache, one
process), in seconds and in reference units, and its ratio. The reference loop
(`_reference`) is timed first and, with `--plan`, again at the end; a plan's wall time in
reference units is its seconds / the first loop's. The flax model is
`tests/graphs/jax_models.flax_gpt_problem`.

    .venv/bin/python benchmarks/bench_imported_vs_builtin.py --plan
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "graphs"))

from alpasim import costmodels as cm  # noqa: E402
from alpasim import graphs as gr  # noqa: E402
from alpasim import solvers as sv  # noqa: E402
from alpasim.solvers import RunOptions  # noqa: E402

try:
    from _reference import in_ref, print_reference  # noqa: E402
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_imported_vs_builtin` from the repository root
    from benchmarks._reference import in_ref, print_reference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cluster", default="aws-p3.16xlarge")
    ap.add_argument("--plan", action="store_true", help="also time plan_pipeline on one node of 4 devices")
    a = ap.parse_args()
    ref_s = print_reference()

    from jax_models import flax_gpt_problem

    fn, params, batch = flax_gpt_problem(a.hidden, a.layers, a.heads, a.seq, a.vocab, a.batch, a.dtype)
    imported = gr.from_jax(fn, params, batch, name="flax-gpt")
    spec = (f"gpt3:hidden={a.hidden},layers={a.layers},heads={a.heads},seq={a.seq},vocab={a.vocab},"
            f"batch={a.batch},dtype={a.dtype}")
    builtin = gr.forward_graph(spec)
    cluster = cm.PRESETS[a.cluster]
    model = cm.AnalyticCostModel(cluster)
    print(f"{spec} on {a.cluster}; imported graph {len(imported.ops)} forward ops, built-in {len(builtin.ops)}")
    print(f"{'recompute':9s} {'mesh':4s} {'':9s} {'step time':>10s} {'memory':>10s} {'stash':>10s}")
    for policy in gr.RECOMPUTE_POLICIES:
        for shape in ((1, 1), (2, 2)):
            mesh = sv.LogicalMesh.on_cluster(cluster, shape)
            row = {}
            for label, fwd in (("imported", imported), ("built-in", builtin)):
                g = gr.build_training_graph(fwd, recompute=policy).graph
                stage = gr.stage_graph(g, 0, g.num_layers - 1)
                r = sv.solve_intra_op(stage, mesh, model, with_compute=True).plan
                row[label] = (r.compute_s + r.communication_s + r.sync_s + r.update_s, r.memory.total_bytes,
                              r.memory.stash_bytes)
                t, m, s = row[label]
                print(f"{policy:9s} {shape[0]}x{shape[1]}  {label:9s} {t * 1e3:8.3f} ms {m / 2**20:6.1f} MiB "
                      f"{s / 2**20:6.1f} MiB")
            (ti, mi, si), (tb, mb, sb) = row["imported"], row["built-in"]
            print(f"{policy:9s} {shape[0]}x{shape[1]}  {'ratio':9s} {ti / tb:8.3f}    {mi / mb:8.3f}   {si / sb:8.3f}")
    if a.plan:
        node = cluster.with_overrides(nodes=1, devices_per_node=4)
        walls = {}
        for label, source in (("imported", imported), ("built-in", spec)):
            t0 = time.perf_counter()
            p = sv.plan_pipeline(source if isinstance(source, str) else gr.model_source(source), node,
                                 run=RunOptions(cache=sv.DiskCache(enabled=False)))
            walls[label] = time.perf_counter() - t0
            print(f"plan {label:9s} {walls[label]:6.1f} s, {p.model.layers} layers, "
                  f"{p.search.ilp_solves} ILP jobs, predicted {p.predicted.iteration_s * 1e3:.2f} ms; "
                  f"wall {in_ref(walls[label], ref_s)} ref", flush=True)
        print(f"plan time ratio imported / built-in {walls['imported'] / walls['built-in']:.2f} "
              f"(load average {os.getloadavg()[0]:.2f})")
        print_reference("at the end")


if __name__ == "__main__":
    main()
