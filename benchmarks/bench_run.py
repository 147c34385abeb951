"""Measured vs predicted step time of real (CPU) runs, for GPT, MoE and Wide-ResNet.

    .venv/bin/python benchmarks/bench_run.py [--profile p.json] [--steps 7] [--tiny] [--runtime ray]

Profiles this machine (`alpasim profile --quick`, unless `--profile` names one), plans
each model with the profiled model on the profile's host (8 virtual CPU devices,
submeshes of 2 and 4 devices viewed as 1x2 and 2x2, B = 2, at most 3 stages), runs it
(local runtime by default) and prints the median step time next to three predictions
(`alpasim.backends.predict_run`): the plan's own, the op-level profile re-pricing
each stage for the one-process runtime, and the stages' compiled programs timed alone
before the run (`profile_iters=5`, Alpa's stage profiling) composed by the simulator
with one executor. The sizes are a little above the tests' tiny ones so
that compute, not per-call dispatch, dominates a step; `--tiny` uses the tests' ones.

Timings on a shared 2-core machine move with whatever else runs: the script prints
each step so the spread is visible, and times the reference loop (`_reference`) before
profiling and again at the end; after the table it gives each family's measured step in
reference units (seconds / the first reference loop's), as it does the profiling time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from alpasim.backends import (  # noqa: E402
    check_numerics,
    host_cluster,
    predict_run,
    profile_backend,
    reference_step,
    run_local,
    run_ray,
)
from alpasim.costmodels import Cluster, Device, Link, ProfiledCostModel  # noqa: E402
from alpasim.solvers import PlanOptions, SearchSpace, plan_pipeline  # noqa: E402

try:
    from _reference import in_ref, print_reference  # noqa: E402
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_run` from the repository root
    from benchmarks._reference import in_ref, print_reference  # noqa: E402

SMALL = {
    "gpt": "gpt3:hidden=256,layers=4,heads=8,seq=64,vocab=512,batch=16,dtype=fp32",
    "moe": "moe:hidden=128,layers=4,heads=4,seq=64,vocab=512,batch=16,experts=8,group_size=128,dtype=fp32",
    "wresnet": "wresnet:channels=16,width=1,image=64,classes=16,batch=16",
}
TINY = {
    "gpt": "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,dtype=fp32",
    "moe": "moe:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,experts=4,group_size=32,dtype=fp32",
    "wresnet": "wresnet:channels=8,width=1,image=64,classes=16,batch=8",
}
VIEWS = {2: [(1, 2)], 4: [(2, 2)]}


def load_profile(path: str | None, ref_s: float) -> ProfiledCostModel:
    if path is None:
        t0 = time.perf_counter()
        model = profile_backend(quick=True)
        took = time.perf_counter() - t0
        print(f"profiled in {took:.1f} s: dispatch {model.meta['dispatch_s'] * 1e6:.0f} us; "
              f"profiling {in_ref(took, ref_s)} ref", file=sys.stderr)
        return model
    stand_in = Cluster("unbound", 1, 8, Device("unbound", {"float32": 1.0}, 1, 1.0), Link("u", 1.0, 0.0),
                       Link("u", 1.0, 0.0))
    model = ProfiledCostModel.load(path, stand_in)
    return model.with_cluster(host_cluster(model, int(model.meta.get("num_devices", 8))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="a profile JSON (default: profile now, quick grid)")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny configurations")
    ap.add_argument("--only", help="comma-separated families")
    ap.add_argument("--runtime", choices=("local", "ray"), default="local")
    args = ap.parse_args()
    ref_s = print_reference()
    model = load_profile(args.profile, ref_s)
    configs = TINY if args.tiny else SMALL
    families = args.only.split(",") if args.only else list(configs)
    print(f"{'family':<8} {'stages':<14} {'measured':>10} {'plan':>10} {'op-prof':>10} {'ratio':>6} "
          f"{'stage-prof':>10} {'ratio':>6}  numerics  steps (ms)")
    measured_steps = {}
    for family in families:
        plan = plan_pipeline(configs[family], model.cluster,
                             SearchSpace(microbatches=2, pareto=False, shape_ok=lambda sh: sh.size in VIEWS,
                                         views_of=lambda sh: VIEWS[sh.size], max_stages=3),
                             PlanOptions(cost_model=model))
        if args.runtime == "ray":
            result = run_ray(plan, steps=args.steps, profile_iters=5)
        else:
            result = run_local(plan, steps=args.steps, profile_iters=5)
        ok = check_numerics(result.losses[0], result.grads, reference_step(plan))["numerics_ok"]
        pred = predict_run(plan, cost_model=model, runtime=args.runtime,
                           intra_plans=[s.intra_plan for s in result.stages] if args.runtime == "local" else None,
                           stage_times=result.stage_profile)
        measured = result.measured_step_s
        measured_steps[family] = measured
        meshes = "+".join("x".join(map(str, s.logical_mesh)) for s in plan.stages)
        steps = " ".join(f"{t * 1e3:.0f}" for t in result.step_times_s)
        print(f"{family:<8} {meshes:<14} {measured * 1e3:8.1f}ms {pred['predicted_step_s_analytic'] * 1e3:8.1f}ms "
              f"{pred['predicted_step_s_profiled'] * 1e3:8.1f}ms {pred['predicted_step_s_profiled'] / measured:6.2f} "
              f"{pred['predicted_step_s_stage_profiled'] * 1e3:8.1f}ms "
              f"{pred['predicted_step_s_stage_profiled'] / measured:6.2f}  "
              f"{'ok' if ok else 'FAIL':<8}  {steps}", flush=True)
    print_reference("at the end")
    print("measured step in reference units (seconds / the first reference loop): "
          + ", ".join(f"{family} {in_ref(s, ref_s)}" for family, s in measured_steps.items()))


if __name__ == "__main__":
    main()
