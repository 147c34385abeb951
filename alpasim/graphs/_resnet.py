"""Forward graph of Wide-ResNet, the paper's heterogeneous model.

The architecture is Alpa's benchmark model (a Flax ImageNet ResNet with a width
factor): a 7x7/2 stem convolution with batch norm, ReLU and a 3x3/2 max pool; four
stages of bottleneck blocks with `channels * 2**i` filters; each bottleneck is
1x1 (f) -> 3x3 (f * width, stride 2 in the first block of stages 2-4) -> 1x1 (4f), batch
norm after each convolution and a projection shortcut when the shape changes; then
global average pooling and a dense classifier. Convolutions are NHWC with HWIO
filters and no bias. Activations shrink stage by stage while weights grow — the
tension that makes uniform pipeline stages a poor fit (seed, section 5).

Layer labels: one per bottleneck block (16 for depth 50); the stem joins the first
block and the classifier the last.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._builder import GraphBuilder
from ._types import OpGraph

# Bottleneck blocks per stage: ResNet-50/101/152 (He et al. 2016, Table 1), and the
# 26-layer variant with two blocks a stage (1 + 3 x 8 + 1 layers) and a 17-layer one
# (two blocks in the first stage, one in each other: every kind of block, a projection
# shortcut with and without a stride and an identity shortcut, at least once), small
# networks of the same structure for tests that compile them.
STAGE_BLOCKS = {17: (2, 1, 1, 1), 26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


@dataclass(frozen=True, slots=True)
class WResNetConfig:
    """Wide-ResNet family; `batch` is the global batch (1536 in the paper)."""

    channels: int
    width: int
    depth: int = 50
    image: int = 224
    classes: int = 1024
    batch: int = 1536
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for key in ("channels", "width", "image", "classes", "batch"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"wresnet: {key} must be a positive integer, got {v!r}")
        if self.depth not in STAGE_BLOCKS:
            raise ValueError(f"wresnet: depth must be one of {sorted(STAGE_BLOCKS)}, got {self.depth!r}")
        if self.image < 32:
            raise ValueError(f"wresnet: image must be at least 32 pixels, got {self.image}")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"wresnet: dtype must be float16, bfloat16 or float32, got {self.dtype!r}")

    @property
    def family(self) -> str:
        return "wresnet"

    @property
    def blocks(self) -> tuple[int, ...]:
        return STAGE_BLOCKS[self.depth]


SAME_3x3 = ((1, 1), (1, 1))
VALID = ((0, 0), (0, 0))


def _conv_bn(b: GraphBuilder, x: str, cout: int, k: int, stride: int, dt: str, name: str, relu: bool) -> str:
    cin = b.shape(x)[-1]
    pad = VALID if k == 1 else ((k // 2, k // 2), (k // 2, k // 2))
    w = b.param(f"{name}_w", (k, k, cin, cout), dt, tp="replicated")
    y = b.one("conv2d", [x, w], name=name, strides=(stride, stride), padding=pad)
    y = b.one("batch_norm", [y, b.param(f"{name}_bn_scale", (cout,), dt, tp="replicated"),
                              b.param(f"{name}_bn_bias", (cout,), dt, tp="replicated")],
              name=f"{name}_bn", eps=1e-5)
    return b.ew("relu", y, name=f"{name}_relu") if relu else y


def _bottleneck(b: GraphBuilder, x: str, filters: int, width: int, stride: int, dt: str) -> str:
    y = _conv_bn(b, x, filters, 1, 1, dt, "conv1", relu=True)
    y = _conv_bn(b, y, filters * width, 3, stride, dt, "conv2", relu=True)
    y = _conv_bn(b, y, filters * 4, 1, 1, dt, "conv3", relu=False)
    shortcut = x
    if b.shape(x) != b.shape(y):
        shortcut = _conv_bn(b, x, filters * 4, 1, stride, dt, "proj", relu=False)
    return b.ew("relu", b.ew("add", y, shortcut, name="residual"), name="out_relu")


def wide_resnet(cfg: WResNetConfig, name: str) -> OpGraph:
    """Forward graph of a Wide-ResNet image classifier ending in the mean loss."""
    dt = cfg.dtype
    b = GraphBuilder(name)
    images = b.input("images", (cfg.batch, cfg.image, cfg.image, 3), dt)
    labels = b.input("labels", (cfg.batch,), "int32")
    with b.scope(layer=0, tags=("stem",), prefix="stem/"):
        x = _conv_bn(b, images, cfg.channels, 7, 2, dt, "conv", relu=True)
        x = b.one("max_pool", [x], name="max_pool", window=(3, 3), strides=(2, 2), padding=SAME_3x3)
    layer = 0
    for stage, n_blocks in enumerate(cfg.blocks):
        for j in range(n_blocks):
            stride = 2 if stage > 0 and j == 0 else 1
            with b.scope(layer=layer, prefix=f"stage{stage}/block{j}/", tags=(f"stage{stage}",)):
                x = _bottleneck(b, x, cfg.channels * 2 ** stage, cfg.width, stride, dt)
            layer += 1
    with b.scope(layer=layer - 1, tags=("head",), prefix="head/"):
        pooled = b.one("reduce", [x], name="avg_pool", kind="mean", axes=(1, 2))
        c = b.shape(pooled)[-1]
        logits = b.einsum("nc,ck->nk", pooled, b.param("fc_w", (c, cfg.classes), dt, tp="replicated"), name="fc")
        logits = b.one("bias_add", [logits, b.param("fc_b", (cfg.classes,), dt, tp="replicated")], name="fc_bias")
        loss = b.one("softmax_cross_entropy", [logits, labels], name="loss")
    return b.build([loss], meta={"family": cfg.family, "dtype": dt,
                                 "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}})
