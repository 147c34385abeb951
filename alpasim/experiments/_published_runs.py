"""Published training runs alpasim's predictions are checked against (`alpasim validate`).

Each row is a fact from its source: the hardware, the model, the parallel layout, and
the measured time per iteration (or throughput, turned into time by the source's own
FLOP count). Nothing here is a target: no constant in the cost model may be chosen to
make a row come out right. Where the source leaves part of the layout unsaid (a
microbatch size, a chunk count), the row says what it assumes and why, in `assumed`.

The four groups:

* Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
  (MLSys 2023, arXiv:2205.05198), Table 5: GPT on Selene's DGX A100 nodes, each model
  with full recomputation and with sequence parallelism plus selective recomputation.
  Their layouts are also in calculon-ai/calculon, validation/seqsel/tab5/.
* BLOOM-176B (BigScience, Megatron-DeepSpeed on Jean Zay):
  bigscience-workshop/bigscience, train/tr11-176B-ml/README.md and its slurm script.
* Megatron-core's weak-scaling table on H100 (NVIDIA/Megatron-LM README.md, r0.8.0).
* Llama 3 405B pre-training (Llama Team, "The Llama 3 Herd of Models", 2024, Table 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import dataclasses

from alpasim.costmodels import Cluster, Link, SpineTier, get_cluster

KORTHIKANTI = "Korthikanti et al. 2022 (arXiv:2205.05198), Table 5"
BLOOM = "BigScience BLOOM-176B, bigscience-workshop/bigscience train/tr11-176B-ml"
MEGATRON_CORE = "NVIDIA/Megatron-LM README (Megatron-core r0.8.0 weak scaling, H100)"
LLAMA3 = "Llama Team 2024, The Llama 3 Herd of Models, Table 4"


# What a row may leave unpublished and `validate --spans` varies: the microbatch size
# (1, 2 and 4 sequences, where they divide a data-parallel rank's share of the batch)
# and the recomputation (none, selective, full).
UNPUBLISHABLE = ("microbatch_size", "recompute")


@dataclass(frozen=True, slots=True)
class PublishedRun:
    """One published run: what ran, on what, in what layout, and what was measured.

    `measured_s` is seconds per iteration. Rows that publish throughput instead carry
    `measured_tflops` (per GPU) and `flops_per_iteration`, the source's own count of the
    FLOPs one iteration does (model FLOPs: the recomputed forward not counted), so that
    seconds = flops_per_iteration / (measured_tflops x GPUs)."""

    id: str
    source: str
    system: str                      # the system profile it ran under (`solvers.SYSTEMS`)
    generation: str                  # A100, H100: the hardware generation MAPE is grouped by
    cluster: Cluster
    model: str                       # a zoo spec string (`graphs.model_source`)
    tp: int | None                   # the layout: None where the method searched its own (`method`)
    pp: int | None
    dp: int | None
    microbatch_size: int | None
    recompute: str | None            # full, selective or none; None: the system profile's
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    sharded_gradients: bool = False  # the gradients sharded over dp too (ZeRO-2), each microbatch's scattered
    chunks: int = 1                  # interleaved 1F1B's model chunks per pipeline stage
    ends_as_layers: bool = False     # the embedding and the head pipeline layers of their own
    cp: int = 1                      # context parallelism
    precision: str = "mixed-fp32grad"
    measured_s: float | None = None
    measured_tflops: float | None = None
    flops_per_iteration: float | None = None
    assumed: tuple[str, ...] = ()    # what the source leaves unsaid and the row assumes
    differs: tuple[str, ...] = ()    # where the model priced is not exactly the model that ran
    extra: dict = field(default_factory=dict)
    # "megatron": the published layout (tp, pp, dp, ...) as a Megatron configuration;
    # any other `solvers.METHODS` name: what that method's own search finds on the
    # cluster (an Alpa paper's plan, a ZeRO run), with no layout given.
    method: str = "megatron"
    # The layout fields the source does not publish (of `UNPUBLISHABLE`): `validate
    # --spans` prices the row at each value they could have had (`_validate.span`).
    unpublished: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not all(isinstance(x, str) and x in UNPUBLISHABLE for x in self.unpublished):
            raise ValueError(f"published run {self.id}: unpublished {self.unpublished!r}; only "
                             f"{', '.join(UNPUBLISHABLE)} can be")
        layout = (self.tp, self.pp, self.dp, self.microbatch_size)
        if self.method == "megatron":
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in layout):
                raise ValueError(f"published run {self.id}: method megatron prices a layout; tp, pp, dp and "
                                 f"microbatch_size must be positive integers, got {layout}")
            if self.recompute is None:
                raise ValueError(f"published run {self.id}: a layout states its recomputation (none if unsaid)")
            if self.tp * self.pp * self.dp * self.cp != self.cluster.num_devices:
                raise ValueError(f"published run {self.id}: tp x pp x dp x cp is not the cluster's "
                                 f"{self.cluster.num_devices} devices")
        elif any(x is not None for x in layout) or self.unpublished:
            raise ValueError(f"published run {self.id}: method {self.method} searches its own layout; "
                             f"give no tp, pp, dp, microbatch_size or unpublished settings")

    @property
    def gpus(self) -> int:
        return self.cluster.num_devices

    @property
    def measured_iteration_s(self) -> float:
        """Seconds per iteration, as measured or from the published throughput."""
        if self.measured_s is not None:
            return self.measured_s
        return self.flops_per_iteration / (self.measured_tflops * 1e12 * self.gpus)


def gpt_model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Model FLOPs of one GPT iteration, Megatron-LM's count (Narayanan et al. 2021,
    eq. 3, without the recomputed forward): 72 B s l h^2 (1 + s / 6h + V / 12 l h).
    Attention's score and context products are counted whole (no causal halving)."""
    return 72.0 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def llama_model_flops(batch: int, seq: int, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
                      vocab: int) -> float:
    """Model FLOPs of one Llama iteration: three times the forward's (backward = twice
    the forward), 2 FLOPs per multiply-add. Per layer and token, the forward does the Q
    and output projections (2 h^2 each), the K and V projections of grouped-query
    attention (2 h kv each, kv = h x kv_heads / heads), the SwiGLU MLP's three matrices
    (2 h f each) and attention's score and context products counted whole (2 s h each);
    the logits add 2 h V per token. The Llama 3 paper does not print its count; this is
    Megatron-core's (`num_floating_point_operations`, megatron/training/training.py), and
    counting attention whole, causal or not, was Meta's own MFU convention then
    (torchtitan's, pytorch/torchtitan#280, April 2024, after PaLM and Megatron)."""
    kv = hidden * kv_heads // heads
    per_layer = 2 * seq * (hidden * hidden * 2 + 2 * hidden * kv + 3 * hidden * ffn) + 2 * 2 * seq * seq * hidden
    return 3.0 * batch * (layers * per_layer + 2 * seq * hidden * vocab)


def _a100_nodes(gpus: int) -> Cluster:
    return get_cluster("dgx-a100", nodes=max(1, gpus // 8))


def _h100_nodes(gpus: int) -> Cluster:
    return get_cluster("dgx-h100", nodes=max(1, gpus // 8))


# Jean Zay's A100 partition: 8 A100 SXM4 80GB per node, NVLink among them, and 4 Omni-Path
# 100 Gb/s cards per node (BLOOM's README, "Hardware").
_DGX_A100 = get_cluster("dgx-a100")
JEAN_ZAY_A100 = Cluster("jean-zay-a100", nodes=48, devices_per_node=8, device=_DGX_A100.device,
                        intra_node=_DGX_A100.intra_node,
                        inter_node=Link("Omni-Path 100G", 100.0, _DGX_A100.inter_node.latency_s), nics_per_node=4)


def _korthikanti(name: str, heads: int, hidden: int, layers: int, pp: int, batch: int, mbs: int, chunks: int,
                 full_s: float, sel_s: float) -> list[PublishedRun]:
    gpus = 8 * pp
    # Dropout 0.1 on the hidden states and the attention probabilities: Megatron-LM's
    # defaults (`--hidden-dropout`, `--attention-dropout`), and the paper's activation
    # count (34 sbh + 5 a s^2 b per layer) holds their masks.
    model = f"gpt3:hidden={hidden},layers={layers},heads={heads},seq=2048,vocab=51200,batch={batch},dropout=0.1"
    common = dict(source=KORTHIKANTI, system="megatron-lm-2022", generation="A100", cluster=_a100_nodes(gpus),
                  model=model, tp=8, pp=pp, dp=1, microbatch_size=mbs, chunks=chunks)
    return [PublishedRun(f"korthikanti-{name}-full", recompute="full", measured_s=full_s, **common),
            PublishedRun(f"korthikanti-{name}-sp-selective", recompute="selective", sequence_parallel=True,
                         measured_s=sel_s, **common)]


def _megatron_core(name: str, heads: int, hidden: int, layers: int, tp: int, pp: int, batch: int,
                   tflops: float) -> PublishedRun:
    dp = 48
    return PublishedRun(
        f"megatron-core-{name}", MEGATRON_CORE, "megatron-core-0.8", "H100", _h100_nodes(tp * pp * dp),
        f"gpt3:hidden={hidden},layers={layers},heads={heads},seq=4096,vocab=131072,batch={batch},dtype=bfloat16",
        tp, pp, dp, 1, "none", sequence_parallel=tp > 1, distributed_optimizer=True, precision="mixed-fp32grad",
        measured_tflops=tflops, flops_per_iteration=gpt_model_flops(batch, 4096, layers, hidden, 131072),
        assumed=("microbatch size 1 and no recomputation (the README does not say)",),
        unpublished=("microbatch_size", "recompute"))


# Llama 3's network (its paper, sec. 3.3.1): RoCE at 400 Gb/s per GPU, pods of 3,072 GPUs
# (384 servers) at full bisection, 1:7 oversubscribed above the pods.
def _llama3_cluster(gpus: int) -> Cluster:
    return dataclasses.replace(_h100_nodes(gpus), name="llama3-h100", spine=SpineTier(384, 7.0))


def _llama3(gpus: int, cp: int, dp: int, seq: int, tflops: float) -> PublishedRun:
    batch = 16 * 2 ** 20 // seq        # 16M tokens per batch
    # The paper (sec. 3.3.2) takes a block from the first and the last stage, so that "the
    # first model chunk on the first stage has only the embedding, and the last model
    # chunk on the last stage has only output projection and loss calculation": a chunk
    # is one layer of 126 blocks, the embedding and the head, 128 over 16 ranks, 8 each.
    return PublishedRun(
        f"llama3-405b-{gpus}-cp{cp}", LLAMA3, "llama3", "H100", _llama3_cluster(gpus),
        f"llama3-405b:seq={seq},batch={batch}", 8, 16, dp, 1, "none", sequence_parallel=True,
        distributed_optimizer=True, sharded_gradients=True, chunks=8, ends_as_layers=True, cp=cp,
        measured_tflops=tflops,
        flops_per_iteration=llama_model_flops(batch, seq, 126, 16384, 128, 8, 53248, 128256),
        unpublished=("microbatch_size",),
        assumed=("microbatch size 1 (not published)",
                 "8 chunks per stage, read from the paper's layout (its first chunk holds only the embedding, "
                 "its last only the head and loss)",
                 "Megatron's microbatch groups of pp: the paper tunes the group size (unpublished); Megatron-core "
                 "allows none below pp",
                 "model FLOPs counted as Megatron-core and PaLM's MFU count them, attention's products whole "
                 "(the paper does not print its count)"),
        differs=("RoCE priced as the DGX preset's InfiniBand links (400 Gb/s per GPU, the same rate)",))


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    *_korthikanti("22b", 64, 6144, 48, 1, 4, 4, 1, 1.42, 1.10),
    *_korthikanti("175b", 96, 12288, 96, 8, 64, 1, 3, 18.13, 13.75),
    *_korthikanti("530b", 128, 20480, 105, 35, 280, 1, 3, 49.05, 37.83),
    *_korthikanti("1t", 160, 25600, 128, 64, 512, 1, 1, 94.42, 71.49),
    PublishedRun(
        "bloom-176b", BLOOM, "megatron-deepspeed", "A100", JEAN_ZAY_A100,
        # Dropout 0.1: "The default Megatron-LM dropout settings are inherited" (README).
        "gpt3:hidden=14336,layers=70,heads=112,seq=2048,vocab=250880,batch=2048,dtype=bfloat16,dropout=0.1",
        tp=4, pp=12, dp=8, microbatch_size=2, recompute="full", distributed_optimizer=True,
        precision="deepspeed-bf16", measured_s=104.70,
        differs=("ALiBi and the embedding's extra layer norm are priced as GPT's learned positions",
                 "the tied embedding's gradient is priced as the head's bf16 part sent one way, sliced over dp; "
                 "DeepSpeed all-reduces both stages' fp32 gradients whole (_exec_reduce_tied_grads)")),
    _megatron_core("1.7b", 16, 2048, 24, 1, 1, 192, 408.8),
    _megatron_core("7.1b", 32, 4096, 30, 2, 1, 192, 465.9),
    _megatron_core("16b", 48, 6144, 32, 4, 1, 192, 489.1),
    _megatron_core("32b", 56, 7168, 48, 8, 1, 192, 459.6),
    _megatron_core("70b", 64, 8192, 84, 8, 2, 384, 419.7),
    _megatron_core("119b", 80, 10240, 92, 8, 4, 768, 420.5),
    _megatron_core("177b", 96, 12288, 96, 8, 6, 1152, 432.8),
    _megatron_core("314b", 128, 16384, 96, 8, 8, 1536, 474.4),
    _megatron_core("462b", 144, 18432, 112, 8, 16, 3072, 459.9),
    _llama3(8192, 1, 64, 8192, 430.0),
    _llama3(16384, 1, 128, 8192, 400.0),
    _llama3(16384, 16, 8, 131072, 380.0),
)
