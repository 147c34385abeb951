"""Published GPT configurations that trained on A100-80GB, priced by alpasim's memory model.

Rows: Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Table 1: weak scaling on Selene, V = 51200, s = 2048,
full activation recomputation) up to the 39.1B row (512 GPUs), and Korthikanti et al.
2022 ("Reducing Activation Recomputation", Table 3: 22B on 8 GPUs with a microbatch of
4, 175B on 64 with 1, full recomputation as their baseline). Table 1 gives no
microbatch size, so each row is priced at several. Every configuration trained, so
every one must fit in 80 GB; the script prints alpasim's per-device memory of the most
loaded stage, its terms, the predicted throughput next to the published one, and the
time each plan took, in seconds and in reference units (seconds / the reference loop's,
`_reference`, timed before the first plan and again at the end).

    .venv/bin/python benchmarks/bench_memory_published.py [--rows 1.7B,22B] [--precision mixed]
"""

from __future__ import annotations

import argparse
import os
import time

from alpasim.costmodels import get_cluster
from alpasim.solvers import DiskCache, MegatronConfig, plan_with_method

try:
    from _reference import in_ref, print_reference
except ModuleNotFoundError:  # run as `python -m benchmarks.bench_memory_published` from the repository root
    from benchmarks._reference import in_ref, print_reference

GIB = 2 ** 30
# name: (heads, hidden, layers, tp, pp, gpus, global batch, microbatch sizes, published TFLOP/s per GPU)
ROWS = {
    "1.7B": (24, 2304, 24, 1, 1, 32, 512, (1, 4, 8, 16), 137),
    "3.6B": (32, 3072, 30, 2, 1, 64, 512, (1, 4, 8), 138),
    "7.5B": (32, 4096, 36, 4, 1, 128, 512, (1, 4), 142),
    "18.4B": (48, 6144, 40, 8, 1, 256, 1024, (1, 4), 135),
    "39.1B": (64, 8192, 48, 8, 2, 512, 1536, (1, 2), 138),
    "22B": (64, 6144, 48, 8, 1, 8, 4, (4,), None),
    "175B": (96, 12288, 96, 8, 8, 64, 64, (1,), None),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
    ap.add_argument("--precision", default="mixed-fp32grad")
    args = ap.parse_args()
    cache = DiskCache(enabled=os.environ.get("ALPASIM_BENCH_CACHE", "1") != "0")
    ref_s = print_reference()
    print(f"precision {args.precision}; per device, the most loaded stage; A100-SXM-80GB "
          f"(load average {os.getloadavg()[0]:.2f})")
    print(f"{'row':>6} {'tp':>2} {'pp':>2} {'dp':>3} {'mbs':>3}  {'memory':>9}  {'fits':>4}  {'states':>8} "
          f"{'stash x w':>13} {'working':>8}  {'TFLOP/s':>7} {'paper':>5}  {'plan s':>6} {'plan ref':>8}")
    for name in args.rows.split(","):
        heads, hidden, layers, tp, pp, gpus, batch, sizes, paper = ROWS[name]
        dp = gpus // (tp * pp)
        model = f"gpt3:hidden={hidden},layers={layers},heads={heads},seq=2048,vocab=51200,batch={batch}"
        cluster = get_cluster("dgx-a100", nodes=max(1, gpus // 8), devices_per_node=min(8, gpus))
        for mbs in sizes:
            if batch % (mbs * dp):
                continue
            t0 = time.perf_counter()
            plan = plan_with_method("megatron", model, cluster, megatron=MegatronConfig(tp, pp, dp, mbs),
                                    remat=True, precision=args.precision, cache=cache)
            took = time.perf_counter() - t0
            if not plan.feasible:
                print(f"{name:>6} {tp:>2} {pp:>2} {dp:>3} {mbs:>3}  does not fit: {'; '.join(plan.notes)}")
                continue
            st = max(plan.stages, key=lambda s: s.memory_bytes)
            m = st.memory
            states = m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]
            tflops = plan.predicted.tflops_per_device
            print(f"{name:>6} {tp:>2} {pp:>2} {dp:>3} {mbs:>3}  {st.memory_bytes / GIB:6.1f} GiB  "
                  f"{'yes' if st.memory_bytes <= 80e9 else 'NO':>4}  {states / GIB:5.1f} GiB "
                  f"{m['stash_bytes'] / GIB:6.2f} x {m['inflight']:<3} {m['transient_bytes'] / GIB:5.2f} GiB  "
                  f"{tflops:7.1f} {paper if paper else '-':>5}  {took:6.1f} {in_ref(took, ref_s):>8}", flush=True)
    print_reference("at the end")


if __name__ == "__main__":
    main()
