"""Where the layers live under pipeline parallelism (plain arithmetic, no tensors).

The U-shaped fold (DESIGN §1.6): with L layers over G stages in chunks of L/(2G), stage g
holds the g-th chunk from the front and the g-th from the back. A micro-batch's forward
runs down the stages through the front chunks and back up through the back chunks; the
embedding (before the first front chunk) and the loss (after the last back chunk) both
sit on stage 0, so a tied output layer and embedding are one parameter on one rank.

megatron's own placements (1F1B: stage g holds layers [g·L/G, (g+1)·L/G); interleaved
with V chunks per stage: chunk v of stage g holds block v·G + g) are here too, so a
checkpoint can name every layer by its global number whatever the layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List


class FoldError(ValueError):
    """A layer count or layout that does not fold; the message names the flag and fix."""


@dataclass(frozen=True)
class Chunk:
    """One model chunk on one stage: its global layers (0-based), in forward order, and
    whether it holds the embedding (pre-process) and the loss (post-process)."""
    stage: int
    index: int                 # chunk number on its stage (0 = front, 1 = back in a fold)
    layers: tuple
    pre_process: bool
    post_process: bool


def fold(num_layers: int, stages: int) -> List[List[Chunk]]:
    """The fold's chunks: per stage [front, back]."""
    if stages < 2:
        raise FoldError("--dhelix-fold folds layers over pipeline stages: give "
                        "--pipeline-model-parallel-size 2 or more")
    if num_layers % (2 * stages):
        raise FoldError(
            f"--dhelix-fold: {num_layers} layers do not fold evenly over "
            f"--pipeline-model-parallel-size {stages}: every stage holds two chunks of "
            f"num_layers / (2 × {stages}) layers; use a layer count divisible by "
            f"{2 * stages}")
    c = num_layers // (2 * stages)
    out = []
    for g in range(stages):
        front = tuple(range(g * c, (g + 1) * c))
        back = tuple(range(num_layers - (g + 1) * c, num_layers - g * c))
        out.append([Chunk(g, 0, front, pre_process=g == 0, post_process=False),
                    Chunk(g, 1, back, pre_process=False, post_process=g == 0)])
    return out


def megatron_pipeline(num_layers: int, stages: int, chunks: int = 1) -> List[List[Chunk]]:
    """megatron's placement: 1F1B (chunks = 1) or interleaved (chunks = V per stage)."""
    blocks = stages * chunks
    if num_layers % blocks:
        raise FoldError(f"{num_layers} layers do not split over --pipeline-model-parallel-size "
                        f"{stages} × {chunks} virtual chunk(s); use a divisible layer count")
    n = num_layers // blocks
    out = []
    for g in range(stages):
        row = []
        for v in range(chunks):
            b = v * stages + g
            row.append(Chunk(g, v, tuple(range(b * n, (b + 1) * n)),
                             pre_process=b == 0, post_process=b == blocks - 1))
        out.append(row)
    return out
