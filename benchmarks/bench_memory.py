"""Predicted vs measured per-device stage memory, for GPT, MoE and Wide-ResNet, with and without remat.

    .venv/bin/python benchmarks/bench_memory.py [--models gpt,moe,wresnet] [--microbatches 2]
        [--fence op|layer|none] [--xla-default-scheduler]

Plans each tiny model (the backend tests' sizes, so each plan and run takes seconds)
on 8 virtual CPU devices (submeshes of 2 and 4 devices viewed as 1x2 and 2x2, at most
3 stages), with remat and without, runs one step on the local runtime
(`alpasim.backends.run_local`) and prints one line per stage: the plan's predicted
`memory_bytes`, the measured figure (`alpasim.backends.measured_memory`: XLA's memory
analysis of the compiled stage programs, composed as the stage runs under 1F1B),
their ratio, and both breakdowns — state (params + grads + optimizer), stash per
microbatch x in flight, transient (temporaries + boundary buffers). The predicted
breakdown is the plan's `stages[i].memory` where the planner writes one, else the
older fields (`params_bytes` = persistent, `stash_bytes`, `activation_bytes`).
Memory figures do not move with the machine's load: one run each is enough. The
seconds each model's plan and run took are also given in reference units (seconds / the
reference loop's, `_reference`, timed before the first plan and again at the end).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from alpasim.backends import _executable, check_numerics, measured_memory, reference_step, run_local  # noqa: E402
from alpasim.costmodels import get_cluster  # noqa: E402
from alpasim.solvers import PlanOptions, SearchSpace, plan_pipeline  # noqa: E402

try:
    from _reference import in_ref, print_reference  # noqa: E402
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_memory` from the repository root
    from benchmarks._reference import in_ref, print_reference  # noqa: E402

MODELS = {
    "gpt": "gpt3:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,dtype=fp32",
    "moe": "moe:hidden=64,layers=2,heads=4,seq=16,vocab=128,batch=8,experts=4,group_size=32,dtype=fp32",
    "wresnet": "wresnet:channels=8,width=1,image=64,classes=16,batch=8,dtype=fp32",
}
VIEWS = {2: [(1, 2)], 4: [(2, 2)]}
KIB = 2 ** 10


def predicted_breakdown(st) -> tuple[float | None, float | None, int, float | None]:
    """(state, stash per microbatch, inflight, transient) bytes of the plan's stage."""
    mem = getattr(st, "memory", None)
    if mem is not None and not isinstance(mem, dict):
        mem = mem.to_json() if hasattr(mem, "to_json") else dict(vars(mem))
    if mem:
        state = sum(mem.get(k, 0.0) for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))
        return state, mem.get("stash_bytes"), int(mem.get("inflight", st.inflight_microbatches)), \
            mem.get("transient_bytes", 0.0) + mem.get("buffer_bytes", 0.0)
    return st.params_bytes, st.stash_bytes, st.inflight_microbatches, st.activation_bytes


def kib(x: float | None) -> str:
    return "-" if x is None else f"{x / KIB:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--fence", choices=("op", "layer", "none"), default="op",
                    help="how a stage's backward is held to the plan's op order: each layer and weight gradient "
                         "(the backend's), layers only, or not at all (XLA orders it freely)")
    ap.add_argument("--xla-default-scheduler", action="store_true",
                    help="compile with XLA:CPU's default scheduler instead of the memory-minimising one")
    args = ap.parse_args()
    if args.xla_default_scheduler:
        _executable.compiler_options = lambda mesh: None
    cluster = get_cluster("aws-p3.16xlarge", nodes=1)
    ref_s = print_reference()
    print("KiB per device; state = params+grads+optimizer; stash per microbatch x inflight; "
          "transient = temporaries + boundary buffers of the peak program (the update's holds no stash); "
          f"ratio = predicted / measured (load average {os.getloadavg()[0]:.2f})")
    print(f"{'model':8} {'remat':5} {'stage':5} {'mesh':4} {'predicted':>10} {'measured':>10} {'ratio':>6}  "
          f"{'state p/m':>17} {'stash p/m x n':>20} {'transient p/m':>17}  measured peak program")
    for family in args.models.split(","):
        for remat in (True, False):
            t0 = time.perf_counter()
            plan = plan_pipeline(MODELS[family], cluster,
                                 SearchSpace(microbatches=args.microbatches, pareto=False,
                                             shape_ok=lambda sh: sh.size in VIEWS, views_of=lambda sh: VIEWS[sh.size],
                                             max_stages=3), PlanOptions(remat=remat))
            result = run_local(plan, steps=1, fence=None if args.fence == "none" else args.fence)
            ok = check_numerics(result.losses[0], result.grads, reference_step(plan))["numerics_ok"]
            for k, (st, stage) in enumerate(zip(plan.stages, result.stages, strict=True)):
                m = measured_memory(stage, st.inflight_microbatches)
                p_state, p_stash, p_n, p_trans = predicted_breakdown(st)
                upd = (st.memory or {}).get("update_bytes", 0.0)
                ratio = st.memory_bytes / m.total_bytes
                print(f"{family:8} {str(remat):5} {k:5} {'x'.join(map(str, st.logical_mesh)):4} "
                      f"{kib(st.memory_bytes):>10} {kib(m.total_bytes):>10} {ratio:6.2f}  "
                      f"{kib(p_state):>8}/{kib(m.state_bytes):<8} "
                      f"{kib(p_stash):>7}/{kib(m.stash_bytes):<7}x{p_n}/{m.inflight:<2} "
                      f"{kib(p_trans):>8}/{kib(m.temp_bytes + m.buffer_bytes):<8}  "
                      f"{m.peak_program} (temp {kib(m.temp_bytes)}, buffers {kib(m.buffer_bytes)}; "
                      f"update p/m {kib(upd)}/{kib(m.programs['update'].temp_bytes)}; "
                      f"params {kib(m.params_bytes)} grads {kib(m.grads_bytes)} opt {kib(m.optimizer_bytes)})")
            took = time.perf_counter() - t0
            print(f"# {family} remat={remat}: {len(plan.stages)} stages, numerics {'ok' if ok else 'MISMATCH'}, "
                  f"{took:.1f} s ({in_ref(took, ref_s)} ref)", flush=True)
    print_reference("at the end")


if __name__ == "__main__":
    main()
