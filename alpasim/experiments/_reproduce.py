"""The paper's figures and tables in simulation: `reproduce("fig7a")` and friends.

A figure is a list of `Point`s (model x GPUs x method, or a cross-mesh variant) and a
summary: named ratios computed from the results, each next to the paper's value. The
points run through `run_points` (cached on disk, in parallel), so a warm rerun takes
seconds. `reproduce` writes `<out>/<name>.csv`, `.png` and `.md` (see `_report`).

Every figure uses the paper's testbed, `aws-p3.16xlarge` cut to the GPU count
(`paper_cluster`), and the weak-scaling pairing of Table 4 (`graphs.PAPER_GPUS`).
Throughput is the simulated one (1F1B simulator), never the planner's own estimate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path

from alpasim.graphs import PAPER_GPUS

from ._points import Point, Result, paper_cluster, run_points
from ._report import Figure, Report, series_of, write_report

# ---------------------------------------------------------------- paper numbers
# Figure 7a (GPT-3): "Alpa matches or slightly exceeds Megatron-LM" at every scale; the
# figure shows the two curves on top of each other, so the ratio is about 1.
PAPER_ALPA_OVER_MEGATRON = 1.0
# Figure 7b (MoE), text of §8.1: "3.5x speedup on 2 nodes and 9.7x on 4 nodes".
PAPER_ALPA_OVER_DEEPSPEED_16 = 3.5
PAPER_ALPA_OVER_DEEPSPEED_32 = 9.7
# Figure 7b: "Inter-op only" runs out of memory at 32 and 64 GPUs (§8.1).
PAPER_MOE_INTER_ONLY_FIRST_OOM_GPUS = 32
# Figure 7c (Wide-ResNet), §8.1: "80% linear scaling efficiency at 32 GPUs".
PAPER_WRESNET_SCALING_EFFICIENCY_32 = 0.80
# Figure 7c: PP-DP and inter-op only run out of memory at large scale (PP-DP at 32 GPUs).
PAPER_PP_DP_FIRST_OOM_GPUS = 32
# Figure 8a (GPT, 8 GPUs): ILP ~0.55 PFLOPS, heuristic ~0.45, ZeRO-2 ~0.35 (read off the figure).
PAPER_ILP_OVER_ZERO2_GPT_8 = 0.55 / 0.35
PAPER_ILP_OVER_HEURISTIC_GPT_8 = 0.55 / 0.45
# Figure 8b (MoE, 8 GPUs): ILP ~0.38 PFLOPS vs heuristic ~0.22 (read off the figure).
PAPER_ILP_OVER_HEURISTIC_MOE_8 = 0.38 / 0.22
# Figure 9a (GPT-3): equal layer performs the same as the DP (homogeneous layers).
PAPER_GPT3_DP_OVER_EQUAL_LAYER = 1.0
# Figure 9b (Wide-ResNet, 32 GPUs): DP beats equal layer 1.6x and equal operator 2.6x.
PAPER_WRESNET_DP_OVER_EQUAL_LAYER_32 = 1.6
PAPER_WRESNET_DP_OVER_EQUAL_OPERATOR_32 = 2.6
# Figure 11 (Wide-ResNet, 32 GPUs): local all-gather 2.0x over send/recv.
PAPER_ALL_GATHER_OVER_SEND_RECV_32 = 2.0
# Table 5: GPT-3 39B on 64 GPUs compiles (XLA compilation + profiling + DP) in 2,393 s.
PAPER_PLAN_S_GPT3_39B_64 = 2393.0
# Figure 10: compilation time of the GPT-3 points, ~1,000 s at 2 GPUs to ~2,000 s at 64.
PAPER_PLAN_S_GPT3_2 = 1000.0
PAPER_PLAN_S_GPT3_64 = 2000.0

CROSS_MESH_VARIANTS = ("send_recv", "local_all_gather", "signal")


# --------------------------------------------------------------- ratio helpers
def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing (out of memory) or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def throughput(results: Iterable[Result], *, gpus: int, series: str, model_prefix: str = "") -> float | None:
    """The simulated PFLOPS of the one result at (gpus, series[, model family])."""
    for r in results:
        if r.gpus == gpus and series_of(r) == series and r.model.startswith(model_prefix):
            return r.throughput_pflops if r.feasible else None
    return None


def scaling_efficiency(results: list[Result], *, gpus: int, series: str, model_prefix: str = "") -> float | None:
    """(throughput at N / N) / (throughput at 1 / 1): weak-scaling efficiency."""
    one = throughput(results, gpus=1, series=series, model_prefix=model_prefix)
    n = throughput(results, gpus=gpus, series=series, model_prefix=model_prefix)
    return ratio(None if n is None else n / gpus, one)


def gpu_counts(results: Iterable[Result]) -> list[int]:
    return sorted({r.gpus for r in results})


def first_oom_gpus(results: list[Result], series: str) -> float | None:
    """The smallest GPU count at which `series` runs out of memory (None: never)."""
    oom = [r.gpus for r in results if series_of(r) == series and not r.feasible]
    return float(min(oom)) if oom else None


# --------------------------------------------------------------------- figures
def _paper_points(families: tuple[str, ...], gpus: tuple[int, ...]) -> list[tuple[str, int]]:
    """(model, GPUs) of the weak-scaling pairing in `families` at the given GPU counts."""
    return [(n, g) for n, g in PAPER_GPUS.items() if n.split("-")[0] in families and g in gpus]


def _weak_scaling(family: str, methods: tuple[str, ...]) -> list[Point]:
    return [Point(n, paper_cluster(g), m) for n, g in _paper_points((family,), tuple(PAPER_GPUS.values()))
            for m in methods]


FIG7A_METHODS = ("alpa", "megatron", "intra_only", "inter_only")
FIG7B_METHODS = ("alpa", "deepspeed_moe", "intra_only", "inter_only")
FIG7C_METHODS = ("alpa", "pp_dp", "intra_only", "inter_only")
FIG8_METHODS = ("data_parallel", "zero2", "zero3", "heuristic", "intra_only")
FIG9_METHODS = ("alpa", "equal_layer", "equal_operator")


def _fig7a_summary(rs: list[Result]) -> dict[str, float | None]:
    s: dict[str, float | None] = {}
    for g in gpu_counts(rs):
        s[f"alpa_over_best_megatron_{g}"] = ratio(throughput(rs, gpus=g, series="alpa"),
                                                  throughput(rs, gpus=g, series="megatron"))
    for g in gpu_counts(rs):
        s[f"intra_only_over_alpa_{g}"] = ratio(throughput(rs, gpus=g, series="intra_only"),
                                               throughput(rs, gpus=g, series="alpa"))
    for g in gpu_counts(rs):
        s[f"inter_only_over_alpa_{g}"] = ratio(throughput(rs, gpus=g, series="inter_only"),
                                               throughput(rs, gpus=g, series="alpa"))
    top = max(gpu_counts(rs), default=1)
    s[f"alpa_scaling_efficiency_{top}"] = scaling_efficiency(rs, gpus=top, series="alpa")
    return s


def _fig7b_summary(rs: list[Result]) -> dict[str, float | None]:
    s: dict[str, float | None] = {}
    for g in gpu_counts(rs):
        s[f"alpa_over_deepspeed_{g}"] = ratio(throughput(rs, gpus=g, series="alpa"),
                                              throughput(rs, gpus=g, series="deepspeed_moe"))
    # DeepSpeed's collapse across nodes: per-GPU throughput relative to one node's.
    node = throughput(rs, gpus=8, series="deepspeed_moe")
    for g in (16, 32, 64):
        ds = throughput(rs, gpus=g, series="deepspeed_moe")
        s[f"deepspeed_per_gpu_{g}_over_8"] = ratio(None if ds is None else ds / g, None if node is None else node / 8)
    for g in gpu_counts(rs):
        if g > 1:
            s[f"alpa_scaling_efficiency_{g}"] = scaling_efficiency(rs, gpus=g, series="alpa")
    s["inter_only_first_oom_gpus"] = first_oom_gpus(rs, "inter_only")
    return s


def _fig7c_summary(rs: list[Result]) -> dict[str, float | None]:
    s: dict[str, float | None] = {}
    for g in gpu_counts(rs):
        if g > 1:
            s[f"wresnet_scaling_efficiency_{g}"] = scaling_efficiency(rs, gpus=g, series="alpa")
    for g in gpu_counts(rs):
        s[f"alpa_over_pp_dp_{g}"] = ratio(throughput(rs, gpus=g, series="alpa"),
                                          throughput(rs, gpus=g, series="pp_dp"))
    s["pp_dp_first_oom_gpus"] = first_oom_gpus(rs, "pp_dp")
    s["inter_only_first_oom_gpus"] = first_oom_gpus(rs, "inter_only")
    return s


def _fig8_summary(rs: list[Result]) -> dict[str, float | None]:
    s: dict[str, float | None] = {}
    for fam in ("gpt3", "moe", "wresnet"):
        for g in gpu_counts(rs):
            ilp = throughput(rs, gpus=g, series="intra_only", model_prefix=fam)
            for base in ("zero2", "zero3", "heuristic"):
                s[f"ilp_over_{base}_{fam}_{g}"] = ratio(ilp, throughput(rs, gpus=g, series=base, model_prefix=fam))
        s[f"data_parallel_first_oom_gpus_{fam}"] = first_oom_gpus([r for r in rs if r.model.startswith(fam)],
                                                                  "data_parallel")
    return s


def _fig9_summary(rs: list[Result]) -> dict[str, float | None]:
    s: dict[str, float | None] = {}
    for fam in ("gpt3", "wresnet"):
        for g in gpu_counts(rs):
            dp = throughput(rs, gpus=g, series="alpa", model_prefix=fam)
            for base in ("equal_layer", "equal_operator"):
                s[f"{fam}_dp_over_{base}_{g}"] = ratio(dp, throughput(rs, gpus=g, series=base, model_prefix=fam))
    return s


def _fig11_points() -> list[Point]:
    return [Point(n, paper_cluster(g), "alpa", cross_mesh=v, label=v)
            for n, g in _paper_points(("wresnet",), (16, 32)) for v in CROSS_MESH_VARIANTS]


def _fig11_summary(rs: list[Result]) -> dict[str, float | None]:
    s: dict[str, float | None] = {}
    for g in gpu_counts(rs):
        gather = throughput(rs, gpus=g, series="local_all_gather")
        s[f"all_gather_over_send_recv_{g}"] = ratio(gather, throughput(rs, gpus=g, series="send_recv"))
        s[f"signal_over_all_gather_{g}"] = ratio(throughput(rs, gpus=g, series="signal"), gather)
    return s


def _table5_summary(rs: list[Result]) -> dict[str, float | None]:
    s: dict[str, float | None] = {}
    for r in sorted(rs, key=lambda r: r.gpus):
        s[f"plan_s_{r.model}_{r.gpus}"] = r.plan_s
    s["plan_s_total"] = sum(r.plan_s for r in rs)
    return s


FIGURES: dict[str, Figure] = {
    "fig7a": Figure(
        "fig7a", "Figure 7a: GPT-3 weak scaling (aws-p3.16xlarge)",
        lambda: _weak_scaling("gpt3", FIG7A_METHODS), _fig7a_summary,
        {f"alpa_over_best_megatron_{g}": PAPER_ALPA_OVER_MEGATRON for g in (1, 2, 4, 8, 16, 32, 64)},
        FIG7A_METHODS, panels=("gpt3",)),
    "fig7b": Figure(
        "fig7b", "Figure 7b: GShard MoE weak scaling (aws-p3.16xlarge)",
        lambda: _weak_scaling("moe", FIG7B_METHODS), _fig7b_summary,
        {"alpa_over_deepspeed_16": PAPER_ALPA_OVER_DEEPSPEED_16, "alpa_over_deepspeed_32": PAPER_ALPA_OVER_DEEPSPEED_32,
         "inter_only_first_oom_gpus": float(PAPER_MOE_INTER_ONLY_FIRST_OOM_GPUS)},
        FIG7B_METHODS, panels=("moe",)),
    "fig7c": Figure(
        "fig7c", "Figure 7c: Wide-ResNet weak scaling (aws-p3.16xlarge)",
        lambda: _weak_scaling("wresnet", FIG7C_METHODS), _fig7c_summary,
        {"wresnet_scaling_efficiency_32": PAPER_WRESNET_SCALING_EFFICIENCY_32,
         "pp_dp_first_oom_gpus": float(PAPER_PP_DP_FIRST_OOM_GPUS)},
        FIG7C_METHODS, panels=("wresnet",)),
    "fig8": Figure(
        "fig8", "Figure 8: intra-op ablation on one node (ILP = intra_only)",
        lambda: [Point(n, paper_cluster(g), m) for n, g in PAPER_GPUS.items() if g <= 8 for m in FIG8_METHODS],
        _fig8_summary,
        {"ilp_over_zero2_gpt3_8": PAPER_ILP_OVER_ZERO2_GPT_8,
         "ilp_over_heuristic_gpt3_8": PAPER_ILP_OVER_HEURISTIC_GPT_8,
         "ilp_over_heuristic_moe_8": PAPER_ILP_OVER_HEURISTIC_MOE_8},
        FIG8_METHODS, panels=("gpt3", "moe", "wresnet"),
        notes="The paper sizes Figure 8's models larger (and batches smaller) than Table 4 to stress memory on "
              "one node; here the Table 4 weak-scaling points up to 8 GPUs are used."),
    "fig9": Figure(
        "fig9", "Figure 9: inter-op ablation (DP = alpa vs equal layer vs equal operator)",
        lambda: [Point(n, paper_cluster(g), m) for n, g in _paper_points(("gpt3", "wresnet"), (16, 32))
                 for m in FIG9_METHODS],
        _fig9_summary,
        {"gpt3_dp_over_equal_layer_16": PAPER_GPT3_DP_OVER_EQUAL_LAYER,
         "gpt3_dp_over_equal_layer_32": PAPER_GPT3_DP_OVER_EQUAL_LAYER,
         "wresnet_dp_over_equal_layer_32": PAPER_WRESNET_DP_OVER_EQUAL_LAYER_32,
         "wresnet_dp_over_equal_operator_32": PAPER_WRESNET_DP_OVER_EQUAL_OPERATOR_32},
        FIG9_METHODS, kind="bars", panels=("gpt3", "wresnet")),
    "fig11": Figure(
        "fig11", "Figure 11: cross-mesh resharding on Wide-ResNet (same Alpa plan, three transfers)",
        _fig11_points, _fig11_summary,
        {"all_gather_over_send_recv_32": PAPER_ALL_GATHER_OVER_SEND_RECV_32},
        CROSS_MESH_VARIANTS, kind="bars", panels=("wresnet",)),
    "table5": Figure(
        "table5", "Table 5 / Figure 10: planning time of the GPT-3 points (Alpa)",
        lambda: _weak_scaling("gpt3", ("alpa",)), _table5_summary,
        {"plan_s_gpt3-39b_64": PAPER_PLAN_S_GPT3_39B_64, "plan_s_gpt3-760m_2": PAPER_PLAN_S_GPT3_2},
        ("alpa",), kind="plan_time", panels=("gpt3",),
        notes="Planning time is the wall time of the first (uncached) plan of each point, with the other "
              "workers of the run sharing the machine; Alpa's includes XLA compilation and profiling on the "
              "cluster, ours prices operators analytically."),
}


def figure_points(name: str, max_gpus: int | None = None) -> list[Point]:
    """The points of figure `name`, cut to `max_gpus` GPUs when given."""
    pts = FIGURES[name].points()
    return [p for p in pts if max_gpus is None or p.gpus <= max_gpus]


def reproduce(name: str, out_dir: str | Path | None = "out/reproduce", *, workers: int | None = 2,
              cache: bool = True, max_gpus: int | None = None,
              map_fn: Callable[[Callable, Iterable], Iterable] | None = None,
              progress: Callable[[int, int, Result], None] | None = None,
              points: list[Point] | None = None) -> Report:
    """Run figure `name` (its points, or `points` instead), summarise it and, when
    `out_dir` is given, write `<out_dir>/<name>.csv`, `.png` and `.md`."""
    if name not in FIGURES:
        raise KeyError(f"unknown figure {name!r}; choose one of {', '.join(FIGURES)}")
    fig = FIGURES[name]
    pts = points if points is not None else figure_points(name, max_gpus)
    t0 = time.perf_counter()
    results = run_points(pts, cache=cache, workers=workers, map_fn=map_fn, progress=progress)
    report = Report(name, fig.title, results, fig.summary(results), dict(fig.paper),
                    wall_s=time.perf_counter() - t0)
    if out_dir is not None:
        report.files = write_report(report, fig, Path(out_dir))
    return report
