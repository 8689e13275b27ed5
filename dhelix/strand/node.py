"""A layer node: one micro-batch's pass through one DHelix layer (DESIGN §4).

Its forward runs the layer's forward ops on a *detached* input and returns a fresh leaf,
so the autograd graphs of the nodes above and below stay apart. Its backward is called by
the schedule on the one thread that drives a training step — never by autograd, so it
never waits inside the autograd engine's device thread (the CUDA deadlock this design
removes) — and hands the input gradient to the node below. Parameter gradients enter
autograd only at the end, through each parameter's own AccumulateGrad, so megatron DDP's
grad hooks, `no_sync` and `overlap_grad_reduce` see what they see for megatron's layer.

With `tiles=2` the node holds the two halves of its micro-batch (the intra-batch peer):
the executor runs their op chains round-robin.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from dhelix.strand.lanes import Lanes
from dhelix.strand.state import StrandState


class NodeOrderError(RuntimeError):
    """A node backward was entered from inside an autograd backward."""


def _split(t: torch.Tensor, tiles: int) -> List[torch.Tensor]:
    """Tiles along the batch dimension ([s, b, h]: dim 1)."""
    return [t] if tiles == 1 else list(t.chunk(tiles, dim=1))


def _join(ts: List[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim=1)


class LayerNode:
    def __init__(self, layer, x: torch.Tensor, meta: dict, lanes: Lanes, strand: str = "α",
                 label: str = "", tiles: int = 1):
        self.layer, self.program = layer, layer.program
        self.x_in: Optional[torch.Tensor] = x     # its graph leads to the node below
        self.out: Optional[torch.Tensor] = None
        if tiles > 1 and (x.shape[1] < tiles or x.shape[1] % tiles):
            raise ValueError(f"the intra-batch peer splits each micro-batch in {tiles}: "
                             f"--micro-batch-size must be divisible by {tiles} "
                             f"(got {x.shape[1]})")
        self.states = [StrandState(lanes, strand, label) for _ in range(tiles)]
        for S, xi, mi in zip(self.states, _split(x.detach(), tiles), _tile_meta(meta, tiles)):
            S.meta = mi
            S.put("x", xi)

    # ---- forward ------------------------------------------------------------------------
    def finish_forward(self) -> torch.Tensor:
        """The layer output, a leaf requiring grad: the graph above starts here."""
        outs = []
        for S in self.states:
            outs.append(S.get("out"))
            S.drop("out")
        self.out = _join(outs).requires_grad_()
        return self.out

    # ---- backward -----------------------------------------------------------------------
    def begin_backward(self, g: torch.Tensor, strand: str = "β", label: str = "") -> None:
        if torch._C._current_graph_task_id() != -1:
            raise NodeOrderError(
                f"layer {self.layer.layer_number}: a DHelix node backward was entered from "
                f"inside an autograd backward; the schedule must call node backwards on its "
                f"own thread, outside autograd")
        self.out = None
        for S, gi in zip(self.states, _split(g, len(self.states))):
            S.counting = False          # backward temporaries are not activations
            S.strand, S.label = strand, label
            S.put("g_out", gi.contiguous())

    def finish_backward(self) -> torch.Tensor:
        """Input gradient for the node below; parameter grads into AccumulateGrad."""
        g_x = _join([S.get("g_x") for S in self.states])
        grads: Dict[int, torch.Tensor] = {}
        for S in self.states:
            for k, g in S.grads.items():
                grads[k] = g if k not in grads else grads[k] + g
            S.clear()
        params = [p for p in self.program.params if id(p) in grads]
        accumulate_grads(params, [grads[id(p)] for p in params])
        self.states = []
        return g_x


def accumulate_grads(params: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
    """Hand finished gradients to the parameters' AccumulateGrad nodes: a leaf's backward
    runs only those (and the hooks on them: megatron DDP's main_grad accumulation and
    overlapped reduce), exactly once per parameter."""
    if params:
        torch.autograd.backward(params, grads)


def _tile_meta(meta: dict, tiles: int) -> List[dict]:
    """Per-tile attention mask (split when it has a batch dimension); rotary embeddings
    broadcast over the batch and are shared."""
    if tiles == 1:
        return [meta]
    mask = meta.get("attention_mask")
    masks = [mask] * tiles
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[0] > 1:
        masks = list(mask.chunk(tiles, dim=0))
    return [dict(meta, attention_mask=m) for m in masks]
