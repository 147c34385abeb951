"""Which parameter paths form the stack of blocks an imported graph is layered by."""

from __future__ import annotations

from alpasim.graphs._blocks import block_of_params
from alpasim.graphs import Tensor


def params(shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
    return {n: Tensor(n, s, "float32", "param") for n, s in shapes.items()}


def block(prefix: str) -> dict[str, tuple[int, ...]]:
    # Inside each block Dense_0 and Dense_1 differ in shape: they are not a stack.
    return {f"{prefix}/Dense_0/kernel": (8, 32), f"{prefix}/Dense_1/kernel": (32, 8), f"{prefix}/ln/scale": (8,)}


def test_the_shallowest_stack_of_alike_members_is_the_block_stack():
    flax = params({**block("Block_0"), **block("Block_1"), **block("Block_2"), "Embed_0/embedding": (16, 8)})
    got = block_of_params(flax)
    assert got == {n: int(n.split("/")[0][-1]) for n in flax if n.startswith("Block_")}
    hf = params({**block("transformer/h/0"), **block("transformer/h/1"), "transformer/wte": (16, 8)})
    assert set(block_of_params(hf).values()) == {0, 1}
    assert block_of_params(hf)["transformer/h/1/ln/scale"] == 1


def test_no_stack_without_two_alike_members():
    assert block_of_params(params({**block("Block_0"), "head/kernel": (8, 16)})) is None
    unlike = params({**block("Block_0"), "Block_1/Dense_0/kernel": (8, 64)})
    assert block_of_params(unlike) is None
    assert block_of_params(params({"emb/weight": (16, 8), "mlp/weight": (8, 8)})) is None
