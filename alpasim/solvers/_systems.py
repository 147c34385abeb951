"""System profiles: how each training system ran, so each method is priced as it ran.

A planning method (`_methods.METHODS`) says what part of the search it keeps; the
system it stands for also decides how the same plan runs: whether gradients are reduced
while the backward still runs, what the backward recomputes, which attention kernel
runs, whether optimizer states are sharded. Those choices moved a prediction by up to a
quarter, and a feature added for one system must not become a claim about another
(overlapped gradient reduction once became everyone's default). So each system is one
`SystemProfile` record with a source for every entry, each method names its default
profile, a user's option overrides an entry, and the plan records the profile, what was
overridden, and what the cost model cannot price yet.

Entries:

* `grad_overlap`: weight gradients reduced in buckets during the last backward
  (`costmodels._overlap`), or all after it.
* `param_gather_overlap`: a sharded optimizer's parameter all-gather overlapped with
  the next forward, or after the step.
* `tp_comm_overlap`: tensor-parallel collectives overlapped with their GEMMs.
* `attention`: "explicit" (the (s, s) scores written to memory, a softmax kernel, a
  second batched GEMM) or "fused" (a FlashAttention-style kernel).
* `optimizer_sharding`: "none", "data-parallel" (ZeRO-1: Adam states and master
  weights on 1/dp of the data-parallel group each), "data-parallel-gradients"
  (ZeRO-2, FSDP that keeps the gathered parameters: the gradients on 1/dp too, each
  microbatch's weight gradients reduce-scattered as the backward makes them and
  added into the device's shard) or "searched" (the intra-op ILP chooses, as Alpa's
  does).
* `recompute`: "full" (each layer's forward again in the backward), "selective"
  (attention's core only), "fusible" (`graphs.training_graph`'s policy), "none", or
  "searched" (the method's search chooses).
* `cross_entropy`: "fused" (one pass over the logits each way) or "unfused-fp32"
  (Megatron-LM's vocab-parallel loss on `logits.float()`, a kernel per step,
  `graphs.with_loss_kernel`).
* `kernels`: "per-op" (each op of the graph its own kernel, keeping what its backward
  reads: JAX's autodiff under XLA) or "fused" (norms, activations and RoPE as
  hand-fused kernels that save their inputs and recompute their intermediates in the
  backward: Apex, Megatron's fusions, Transformer Engine; `graphs.training_graph`).
  It changes the stash of a model written op by op (Llama's RMSNorm and SwiGLU), not
  that of one whose norms and activations are single ops (the zoo's GPT).
* `p2p`: "overlapped" (a pipeline stage runs on while its sends are on the wire) or
  "blocking" (each send holds the stage's stream until it lands, as a synchronous
  `torch.distributed.send` or a waited batch of isend/irecv does; the simulator's
  `blocking_sends`).

Beside the entries, a profile may size its overlapped gradient buckets (`GradBuckets`:
Megatron-core's grow with the data-parallel degree); without one, a bucket is PyTorch
DDP's 25 MiB. `--bucket-mb` overrides either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from alpasim.graphs import KERNEL_STASHES, LOSS_KERNELS

# How a pipeline stage's sends run (the `p2p` entry; `simulator.simulate`'s blocking_sends).
P2P_MODES = ("overlapped", "blocking")
# Each entry's values; a bool entry is on or off.
ALLOWED: Mapping[str, tuple[Any, ...]] = MappingProxyType({
    "grad_overlap": (False, True),
    "param_gather_overlap": (False, True),
    "tp_comm_overlap": (False, True),
    "attention": ("explicit", "fused"),
    "optimizer_sharding": ("none", "data-parallel", "data-parallel-gradients", "searched"),
    "recompute": ("full", "selective", "fusible", "none", "searched"),
    "cross_entropy": LOSS_KERNELS,
    "kernels": KERNEL_STASHES,
    "p2p": P2P_MODES,
})
ENTRIES = tuple(ALLOWED)
# The values the cost model prices (all of them now). Any other value is recorded in
# the plan as not priced (what the plan then assumes instead is the first value of the
# entry here): an entry may be added before its pricing.
PRICED: Mapping[str, tuple[Any, ...]] = MappingProxyType(dict(ALLOWED))


class UnknownSystemError(ValueError):
    """A system profile name no record has."""


class OptionConflict(ValueError):
    """A setting the user asked for that cannot apply to the plan asked for: `entry`
    (a profile entry) and why, refused before anything is priced."""

    def __init__(self, entry: str, why: str) -> None:
        super().__init__(f"{entry} {why}")
        self.entry, self.why = entry, why


@dataclass(frozen=True, slots=True)
class GradBuckets:
    """Gradient buckets of max(min_params, params_per_rank x dp) parameters: larger
    data-parallel groups take larger buckets so that their collectives stay
    bandwidth-bound (a ring's latency grows with the group)."""

    min_params: int
    params_per_rank: int
    source: str

    def nbytes(self, dp: int, grad_itemsize: int) -> float:
        """The bucket in bytes of gradients of `grad_itemsize` bytes each (the dtype the
        planner's gradients are reduced in: the precision recipe's accumulator)."""
        return float(max(self.min_params, self.params_per_rank * dp) * grad_itemsize)


MEGATRON_CORE_BUCKETS = GradBuckets(
    40_000_000, 1_000_000,
    "megatron/core/distributed/distributed_data_parallel_config.py (core_r0.7-0.8): bucket_size defaults to "
    "max(40000000, 1000000 * dp_size) parameters")


@dataclass(frozen=True, slots=True)
class SystemProfile:
    """How one training system ran (module doc), each entry with its source."""

    name: str
    summary: str
    grad_overlap: bool
    param_gather_overlap: bool
    tp_comm_overlap: bool
    attention: str
    optimizer_sharding: str
    recompute: str
    cross_entropy: str
    kernels: str
    p2p: str
    sources: Mapping[str, str]
    buckets: GradBuckets | None = None

    def __post_init__(self) -> None:
        for entry, allowed in ALLOWED.items():
            value = getattr(self, entry)
            if isinstance(value, bool) != isinstance(allowed[0], bool) or value not in allowed:
                raise ValueError(f"system {self.name}: {entry} must be one of {', '.join(map(_fmt, allowed))}, "
                                 f"got {value!r}")
        missing = [e for e in ENTRIES if not self.sources.get(e)]
        if missing:
            raise ValueError(f"system {self.name}: no source for {', '.join(missing)}")
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    def settings(self) -> dict[str, Any]:
        return {e: getattr(self, e) for e in ENTRIES}


@dataclass(frozen=True, slots=True)
class SystemRecord:
    """What a plan records of its system: the profile's name, the settings it was priced
    with (the profile's, with the user's overrides), which entries the user overrode
    (entry -> the profile's value), which settings the cost model could not price (entry
    -> the value it priced instead), and which of the settings do not apply to this plan
    and were priced off (entry -> why)."""

    name: str
    settings: dict[str, Any]
    overridden: dict[str, Any]
    unpriced: dict[str, Any]
    inapplicable: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def notes(self) -> tuple[str, ...]:
        """One line each for overrides, unpriced and inapplicable settings (none: nothing to say)."""
        out = []
        if self.overridden:
            out.append(f"system {self.name}: " + ", ".join(
                f"{k} {_fmt(self.settings[k])} (the profile's: {_fmt(v)})" for k, v in self.overridden.items()))
        if self.unpriced:
            out.append(f"system {self.name}: not modelled yet, priced as " + ", ".join(
                f"{k} {_fmt(v)} (it ran {_fmt(self.settings[k])})" for k, v in self.unpriced.items()))
        out += [f"system {self.name}: {k} priced off: it {why}" for k, why in self.inapplicable.items()]
        return tuple(out)

    def without(self, entry: str, why: str) -> SystemRecord:
        """The record with the on/off `entry` priced off because it does not apply (`why`)."""
        return dataclasses.replace(self, settings={**self.settings, entry: False},
                                   overridden={k: v for k, v in self.overridden.items() if k != entry},
                                   unpriced={k: v for k, v in self.unpriced.items() if k != entry},
                                   inapplicable={**self.inapplicable, entry: why})


def _fmt(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def resolve(profile: SystemProfile, **given: Any) -> SystemRecord:
    """The record of `profile` with `given` entries (None: not given) overriding it."""
    unknown = set(given) - set(ENTRIES)
    if unknown:
        raise TypeError(f"unknown system entry {sorted(unknown)[0]!r}; the entries are {', '.join(ENTRIES)}")
    base = profile.settings()
    settings = {**base, **{k: v for k, v in given.items() if v is not None}}
    candidate = dataclasses.replace(profile, **settings)     # validates the overriding values
    settings = candidate.settings()
    overridden = {k: base[k] for k in ENTRIES if settings[k] != base[k]}
    unpriced = {k: PRICED[k][0] for k in ENTRIES if settings[k] not in PRICED[k]}
    return SystemRecord(profile.name, settings, overridden, unpriced)


_MEGATRON_2021 = "Narayanan et al., SC'21, and NVIDIA/Megatron-LM v2.x"
_AFTER_BACKWARD_2021 = (f"{_MEGATRON_2021}: megatron/training.py train_step calls model.allreduce_gradients() after "
                        "forward_backward_func returns (LocalDDP, no buckets)")
_MEGATRON_LOSS = ("megatron/core/tensor_parallel/cross_entropy.py (mpu/cross_entropy.py before core): "
                  "vocab_parallel_cross_entropy(logits.float(), labels), a PyTorch kernel per step")
_MEGATRON_FUSED = ("megatron/model/fused_layer_norm.py (Apex's FusedLayerNormAffineFunction saves input, mean "
                   "and invvar), fused_bias_gelu.py (saves input and bias), fused_softmax.py (saves the softmax "
                   "output)")
_MEGATRON_P2P = ("megatron/p2p_communication.py (core/pipeline_parallel/p2p_communication.py later) "
                 "_communicate: torch.distributed.batch_isend_irecv, then req.wait() on each before the schedule "
                 "runs on (and a torch.cuda.synchronize() in the 2021-22 code)")
_DEEPSPEED_P2P = ("deepspeed/runtime/pipe/p2p.py send and recv: torch.distributed.send/recv ('Doesnt support "
                  "async_op true'), run in order by the pipeline engine's instruction loop")
_EXPLICIT_MEGATRON = ("megatron/model/transformer.py ParallelAttention (v2-v3): baddbmm writes the (b*np, sq, sk) "
                      "scores, FusedScaleMaskSoftmax, bmm with V")

SYSTEMS: Mapping[str, SystemProfile] = MappingProxyType({p.name: p for p in (
    SystemProfile(
        "alpa-osdi22", "Alpa as published (Zheng et al., OSDI'22)",
        grad_overlap=False, param_gather_overlap=False, tp_comm_overlap=False, attention="explicit",
        optimizer_sharding="searched", recompute="full", cross_entropy="fused", kernels="per-op",
        p2p="blocking", sources={
            "grad_overlap": "alpa/pipeline_parallel/apply_grad.py: gradients accumulate over the microbatches and "
                            "their all-reduce runs in the apply-gradient stage after the last backward",
            "param_gather_overlap": "no sharded optimizer step of its own: the ILP's layouts run the update",
            "tp_comm_overlap": "XLA's SPMD partitioner of 2021-22 issues collectives in line with compute",
            "attention": "alpa/model/gpt_model.py (benchmark models): einsum scores, softmax, einsum context",
            "optimizer_sharding": "OSDI'22 sec. 4: the ILP chooses every tensor's layout, optimizer states too",
            "recompute": "benchmark/alpa suites: GPT and MoE cases run with use_remat=True",
            "cross_entropy": "alpa/model/model_util.py cross_entropy_loss: a log-softmax XLA fuses into the step",
            "kernels": "JAX's autodiff keeps every residual the backward reads as a forward output; XLA's "
                       "fusion runs them in fewer kernels but does not drop them",
            "p2p": "alpa-projects/alpa #773 (2022-12, after OSDI'22) first overlapped pipeline communication "
                   "with computation, behind global_config.enable_overlapping, off by default "
                   "(xla_nccl_collective_group.py: use_default_stream = not enable_overlapping)",
        }),
    SystemProfile(
        "megatron-lm-2021", "Megatron-LM as of 2021 (Narayanan et al., SC'21), Alpa's baseline",
        grad_overlap=False, param_gather_overlap=False, tp_comm_overlap=False, attention="explicit",
        optimizer_sharding="none", recompute="full", cross_entropy="unfused-fp32", kernels="fused",
        p2p="blocking", sources={
            "grad_overlap": _AFTER_BACKWARD_2021,
            "param_gather_overlap": f"{_MEGATRON_2021}: no distributed optimizer before v3.0 (2022)",
            "tp_comm_overlap": f"{_MEGATRON_2021}: mpu/mappings.py all-reduces in line with the GEMMs",
            "attention": _EXPLICIT_MEGATRON,
            "optimizer_sharding": f"{_MEGATRON_2021}: every data-parallel rank keeps all Adam states",
            "recompute": "SC'21 sec. 5: all runs use activation recomputation (--checkpoint-activations)",
            "cross_entropy": _MEGATRON_LOSS,
            "kernels": _MEGATRON_FUSED,
            "p2p": _MEGATRON_P2P,
        }),
    SystemProfile(
        "megatron-lm-2022", "Megatron-LM v3 (Korthikanti et al. 2022): sequence parallelism, selective recompute",
        grad_overlap=False, param_gather_overlap=False, tp_comm_overlap=False, attention="explicit",
        optimizer_sharding="none", recompute="selective", cross_entropy="unfused-fp32", kernels="fused",
        p2p="blocking", sources={
            "grad_overlap": "Megatron-LM v3.0 megatron/training.py: grads all-reduced after the backward unless "
                            "--overlap-grad-reduce (added 2023)",
            "param_gather_overlap": "Megatron-LM v3.0: no --overlap-param-gather (added 2023)",
            "tp_comm_overlap": "Korthikanti et al. sec. 4.2.2: reduce-scatter and all-gather run in line",
            "attention": f"{_EXPLICIT_MEGATRON}; Korthikanti et al. sec. 5 does not use FlashAttention",
            "optimizer_sharding": "Korthikanti et al. Table 5 runs: data parallel 1, no distributed optimizer",
            "recompute": "Korthikanti et al. sec. 5: selective recomputation of attention's core",
            "cross_entropy": _MEGATRON_LOSS,
            "kernels": _MEGATRON_FUSED,
            "p2p": _MEGATRON_P2P,
        }),
    SystemProfile(
        "megatron-core-0.8", "Megatron-core r0.8 (2024) with its README's overlap flags",
        grad_overlap=True, param_gather_overlap=True, tp_comm_overlap=True, attention="fused",
        optimizer_sharding="data-parallel", recompute="searched", cross_entropy="unfused-fp32", kernels="fused",
        p2p="blocking", sources={
            "grad_overlap": "NVIDIA/Megatron-LM README (r0.8 weak scaling): --overlap-grad-reduce",
            "param_gather_overlap": "same README: --overlap-param-gather",
            "tp_comm_overlap": "same README: --tp-comm-overlap (Transformer Engine userbuffers: "
                               "transformer_engine/pytorch/module/base.py initialize_ub; priced by "
                               "costmodels._tp_overlap)",
            "attention": "megatron/core/transformer/custom_layers/transformer_engine.py: TEDotProductAttention "
                         "(flash or cuDNN fused attention)",
            "optimizer_sharding": "README: --overlap-param-gather implies --use-distributed-optimizer",
            "recompute": "README does not say; the method's grid searches none, selective and full",
            "cross_entropy": f"{_MEGATRON_LOSS} (--cross-entropy-loss-fusion, core r0.7, is not among the README's "
                             "flags)",
            "kernels": "Transformer Engine's TELayerNormColumnParallelLinear (its RMSNorm and LayerNorm save the "
                       "input and rsigma), megatron/core/fusions/fused_bias_swiglu.py and fused_bias_gelu.py "
                       "(each saves its input), fused RoPE (--apply-rope-fusion: saves the frequencies only)",
            "p2p": "megatron/core/pipeline_parallel/schedules.py, forward_backward_pipelining_without_interleaving: "
                   "send_forward, send_backward and their pairs wait on their requests (p2p_communication."
                   "_communicate, wait_on_reqs); --overlap-p2p-communication applies to interleaving only and is "
                   "not among the README's flags",
        }, buckets=MEGATRON_CORE_BUCKETS),
    SystemProfile(
        "megatron-deepspeed", "Megatron-DeepSpeed as BLOOM-176B ran it (2022)",
        grad_overlap=False, param_gather_overlap=False, tp_comm_overlap=False, attention="explicit",
        optimizer_sharding="data-parallel", recompute="full", cross_entropy="unfused-fp32", kernels="fused",
        p2p="blocking", sources={
            "grad_overlap": "deepspeed/runtime/pipe/schedule.py TrainSchedule: ReduceGrads after the last "
                            "backward, then OptimizerStep",
            "param_gather_overlap": "deepspeed/runtime/bf16_optimizer.py: the updated shards are all-gathered "
                                    "after the step",
            "tp_comm_overlap": "Megatron-DeepSpeed mpu/mappings.py: all-reduces in line",
            "attention": "bigscience tr11 slurm script: no flash attention (2022); Megatron's explicit softmax",
            "optimizer_sharding": "bigscience tr11 slurm script: ZeRO stage 1 (BF16 optimizer)",
            "recompute": "bigscience tr11 slurm script: --checkpoint-activations",
            "cross_entropy": f"{_MEGATRON_LOSS}, Megatron-DeepSpeed's copy of it",
            "kernels": f"{_MEGATRON_FUSED}; Megatron-DeepSpeed keeps Megatron's kernels",
            "p2p": _DEEPSPEED_P2P,
        }),
    SystemProfile(
        "deepspeed", "DeepSpeed ZeRO-1/2 and DeepSpeed-MoE (2021-22 defaults)",
        grad_overlap=False, param_gather_overlap=False, tp_comm_overlap=False, attention="explicit",
        optimizer_sharding="data-parallel", recompute="full", cross_entropy="unfused-fp32", kernels="fused",
        p2p="blocking", sources={
            "grad_overlap": "deepspeed/runtime/zero/config.py: overlap_comm defaults to false below stage 3",
            "param_gather_overlap": "deepspeed/runtime/zero/stage_1_and_2.py: all-gather after the step",
            "tp_comm_overlap": "no tensor parallelism of its own",
            "attention": "the GPT and MoE models of its 2021-22 examples compute explicit scores",
            "optimizer_sharding": "ZeRO (Rajbhandari et al., SC'20): states partitioned over data parallelism",
            "recompute": "DeepSpeed-Megatron examples: --checkpoint-activations",
            "cross_entropy": f"{_MEGATRON_LOSS}: its examples train Megatron's GPT",
            "kernels": f"{_MEGATRON_FUSED}: its examples train Megatron's GPT",
            "p2p": _DEEPSPEED_P2P,
        }),
    SystemProfile(
        "llama3", "Meta's Llama 3 405B pre-training stack (2024)",
        grad_overlap=True, param_gather_overlap=True, tp_comm_overlap=False, attention="fused",
        optimizer_sharding="data-parallel-gradients", recompute="none", cross_entropy="fused", kernels="fused",
        p2p="overlapped", sources={
            "grad_overlap": "Llama 3 paper sec. 3.3.2: FSDP-style sharding over data parallelism, gradients "
                            "reduce-scattered as the backward produces them",
            "param_gather_overlap": "same section: parameters gathered once per step and not resharded after "
                                    "the forward",
            "tp_comm_overlap": "not described in the paper; priced as not overlapped",
            "attention": "assumed: the paper does not name its kernel; every 2024 H100 run uses a fused one",
            "optimizer_sharding": "sec. 3.3.1 and Table 4's notes: FSDP shards the optimizer states and the "
                                  "gradients over data parallelism, and keeps the model whole after the forward "
                                  "(no reshard); sec. 3.3.2: gradients accumulated in FP32 over the microbatches "
                                  "and reduce-scattered in FP32 across the data-parallel workers",
            "recompute": "sec. 3.3.2: no activation checkpointing at 8K context",
            "cross_entropy": "assumed: the paper does not describe its loss kernel; priced as one fused pass",
            "kernels": "assumed: the paper does not name its kernels; sec. 3.3.2 trains 8K sequences without "
                       "checkpointing after memory profiling, and fused RMSNorm, SwiGLU and RoPE kernels are "
                       "what every 2024 H100 stack runs (Transformer Engine, Megatron-core, torchtitan)",
            "p2p": "sec. 3.3.2: asynchronous point-to-point communication in the pipeline",
        }),
)})


def get_system(name: str) -> SystemProfile:
    """The profile called `name`; an unknown name lists the known ones."""
    if name not in SYSTEMS:
        raise UnknownSystemError(f"unknown system {name!r}; choose one of {', '.join(SYSTEMS)}")
    return SYSTEMS[name]
