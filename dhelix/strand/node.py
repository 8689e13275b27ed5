"""A layer node: one micro-batch's pass through one DHelix layer (DESIGN §4).

Its forward runs the layer's forward ops on a *detached* input and returns a fresh leaf,
so the autograd graphs of the nodes above and below stay apart. Its backward is called by
the schedule on the one thread that drives a training step — never by autograd, so it
never waits inside the autograd engine's device thread (the CUDA deadlock this design
removes) — and hands the input gradient to the node below. Parameter gradients enter
autograd through each parameter's own AccumulateGrad, once per node, so megatron DDP's
grad hooks, `no_sync` and `overlap_grad_reduce` see what they see for megatron's layer.

A parameter's gradient is handed over as soon as its last contribution in this node has
arrived (`GradHandoff`), not at the end of the node: the node never holds a finished
weight gradient beyond the op that finished it (with tiles: until the last tile's op),
and its sum is the one the whole-node path makes, in the same order. How many
contributions each parameter gets per state is learnt from the program's first node
backward, which holds everything to the end as before. When the backward ends the node
drops its input (`x_in`): nothing of the node outlives its backward but the input grad.

With `tiles=2` the node holds the two halves of its micro-batch (the intra-batch peer):
the executor runs their op chains round-robin.
"""
from __future__ import annotations

import os
import weakref
from typing import Callable, Dict, List, Optional

import torch

from dhelix.base.memory import METER

from dhelix.strand.lanes import Lanes
from dhelix.strand.state import GradHandoffError, RngStates, StrandState

# program -> {id(param): gradient contributions per state in one node backward}, learnt
# from the program's first node backward (its op chain is fixed, so are the counts)
_GRAD_COUNTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def grad_handoff_enabled() -> bool:
    """DHELIX_GRAD_HANDOFF=0 keeps every weight gradient to the end of its node (the
    whole-node path; same values, higher peak)."""
    return os.environ.get("DHELIX_GRAD_HANDOFF", "1") != "0"


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
        self.handoff: Optional[GradHandoff] = None    # during a backward with known counts
        # a context that every gradient hand-over of this node's backward runs in: megatron
        # DDP's no_sync for a backward that is not the step's last but runs beside it
        # (`schedules/dhelix.py`, the paired tail), so its grads do not ready a bucket
        self.grad_hold: Optional[Callable] = None
        if tiles > 1 and (x.shape[1] < tiles or x.shape[1] % tiles):
            raise ValueError(f"the intra-batch peer splits each micro-batch in {tiles}: "
                             f"--micro-batch-size must be divisible by {tiles} "
                             f"(got {x.shape[1]})")
        # full recompute (megatron's --recompute-granularity full, this layer chosen by
        # its method): after the forward the node keeps its input only, and its backward
        # begins by running the forward ops again from the generator states of now
        self.recompute = getattr(self.program, "recompute", None) == "full"
        self.rng: Optional[RngStates] = RngStates() if self.recompute else None
        self.states = [StrandState(lanes, strand, label) for _ in range(tiles)]
        for S, xi, mi in zip(self.states, _split(x.detach(), tiles), _tile_meta(meta, tiles)):
            S.meta = mi
            S.graphs = not self.recompute
            S.put("x", xi)

    # ---- forward ------------------------------------------------------------------------
    def finish_forward(self) -> torch.Tensor:
        """The layer output, a leaf requiring grad: the graph above starts here."""
        outs = []
        for S in self.states:
            outs.append(S.get("out"))
            S.drop("out")
            if self.recompute:
                S.retain("x")       # the ops' saved tensors go; the backward recomputes
        self.out = _join(outs).requires_grad_()
        if len(outs) > 1:
            # the tiles' outputs now live on in the joined copy; the last op's local graph
            # keeps each tile's only as its autograd root, which needs no data: free them
            # (else a tiled layer holds its output twice)
            for o in outs:
                METER.forget(o)
                o.untyped_storage().resize_(0)
        return self.out

    def recompute_forward(self, tracer=None) -> None:
        """A recomputed node's backward begins here: its forward ops again, on the kept
        input, from the generator states its first forward started with (megatron's
        checkpoint: the same dropout masks), as one step of this strand alone; what they
        keep for the backward ops counts as activations again. Called by the backward walk
        right after `begin_backward`, before the node's backward ops."""
        if not self.recompute:
            return
        from dhelix.strand.executor import execute_step
        for S in self.states:
            S.counting = True
            S.graphs = True
        try:
            with self.rng.restored():
                states = self.states[0] if len(self.states) == 1 else self.states
                execute_step((states, self.program.forward_ops), None, tracer)
        finally:
            for S in self.states:
                S.drop("out")
                S.counting = False

    # ---- backward -----------------------------------------------------------------------
    def begin_backward(self, g: torch.Tensor, strand: str = "β", label: str = "") -> None:
        if torch._C._current_graph_task_id() != -1:
            raise NodeOrderError(
                f"layer {self.layer.layer_number}: a DHelix node backward was entered from "
                f"inside an autograd backward; the schedule must call node backwards on its "
                f"own thread, outside autograd")
        self.out = None
        counts = _GRAD_COUNTS.get(self.program) if grad_handoff_enabled() else None
        self.handoff = GradHandoff(self.states, self.grad_hold) if counts is not None \
            else None
        for S, gi in zip(self.states, _split(g, len(self.states))):
            S.counting = False          # backward temporaries are not activations
            S.strand, S.label = strand, label
            S.put("g_out", gi.contiguous())
            if self.handoff is not None:
                S.hand_grads_to(self.handoff.take, counts)

    def finish_backward(self) -> torch.Tensor:
        """Input gradient for the node below; the parameter grads not handed over yet
        into AccumulateGrad (all of them on the program's first backward, which learns
        the counts); the node's input and states are dropped."""
        g_x = _join([S.get("g_x") for S in self.states])
        h = self.handoff
        # what is still here, per state in tile order, summed as the whole-node path does
        grads: Dict[int, torch.Tensor] = {}
        for i, S in enumerate(self.states):
            mine = dict(S.grads)
            if h is not None:
                mine.update((k, sums[i]) for k, sums in h.done.items() if sums[i] is not None)
            for k, g in mine.items():
                grads[k] = g if k not in grads else grads[k] + g
        seen = [S.grad_seen for S in self.states]
        for S in self.states:
            S.clear()
        if h is not None:
            h.done.clear()
        params = [p for p in self.program.params if id(p) in grads]
        if h is not None:
            h.check_unhanded(params)
        accumulate_grads(params, [grads[id(p)] for p in params], self.grad_hold)
        if grad_handoff_enabled():
            if h is None or grads:
                # first backward (or the counts did not hold: their grads went over only
                # now, still in order): learn the counts, if every tile agrees
                same = all(s == seen[0] for s in seen)
                if same:
                    _GRAD_COUNTS[self.program] = dict(seen[0])
                else:
                    _GRAD_COUNTS.pop(self.program, None)
        self.states = []
        self.handoff = None
        self.rng = None
        self.x_in = None                # its storage is the node below's output
        return g_x

    def held_grad_bytes(self) -> int:
        """Bytes of parameter gradients this node holds now (not yet handed over)."""
        n = sum(S.held_grad_bytes() for S in self.states)
        if self.handoff is not None:
            n += self.handoff.held_bytes()
        return n


class GradHandoff:
    """A node's parameter gradients on their way to AccumulateGrad. Each state (tile)
    hands over its sum of a parameter once its last contribution is in (`StrandState.
    acc_grad`); when every tile's sum is here they are added in tile order — exactly the
    whole-node path's sum — and handed to the parameter's AccumulateGrad, once."""

    def __init__(self, states: List[StrandState], hold: Optional[Callable] = None):
        self.hold = hold
        self.index = {id(S): i for i, S in enumerate(states)}
        self.tiles = len(states)
        self.done: Dict[int, List[Optional[torch.Tensor]]] = {}   # id(param) -> per tile
        self.handed: Dict[int, torch.nn.Parameter] = {}

    def take(self, S: StrandState, param: torch.nn.Parameter, g: torch.Tensor) -> None:
        k, i = id(param), self.index[id(S)]
        if k in self.handed:
            raise GradHandoffError(
                f"{S.label or S.strand}: the gradient of a parameter {tuple(param.shape)} "
                f"was handed to autograd already in this node backward")
        sums = self.done.setdefault(k, [None] * self.tiles)
        if sums[i] is not None:
            raise GradHandoffError(
                f"{S.label or S.strand}: tile {i} finished the gradient of a parameter "
                f"{tuple(param.shape)} twice")
        sums[i] = g
        if all(t is not None for t in sums):
            del self.done[k]
            total = sums[0]
            for t in sums[1:]:
                total = total + t
            sums.clear()
            self.handed[k] = param
            accumulate_grads([param], [total], self.hold)

    def check_unhanded(self, params: List[torch.Tensor]) -> None:
        twice = [tuple(p.shape) for p in params if id(p) in self.handed]
        if twice:
            raise GradHandoffError(f"parameters {twice} would get a second gradient in one "
                                   f"node backward")

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for sums in self.done.values()
                   for t in sums if t is not None)


# a parameter's attribute: megatron DDP's post-hook for it, to which its gradient is
# handed directly (set by `schedules/grad_hooks.py`)
DDP_HOOK = "_dhelix_ddp_grad_hook"


def accumulate_grads(params: List[torch.Tensor], grads: List[torch.Tensor],
                     hold: Optional[Callable] = None) -> None:
    """Hand finished gradients over, exactly once per parameter: to megatron DDP's hook
    directly (main_grad accumulation and overlapped reduce, as its AccumulateGrad
    post-hook does), or else to the parameters' AccumulateGrad nodes (a leaf's backward
    runs only those, and the hooks on them); inside `hold()` when given (`grad_hold`)."""
    if hold is not None and params:
        with hold():
            return accumulate_grads(params, grads)
    rest_p, rest_g = [], []
    for p, g in zip(params, grads):
        hook = getattr(p, DDP_HOOK, None)
        # the engine casts a gradient of another dtype to the parameter's; .grad would
        # refuse it: such a one (and a parameter already holding a grad) takes that path
        if hook is None or p.grad is not None or g.dtype != p.dtype:
            rest_p.append(p)
            rest_g.append(g)
            continue
        p.grad = g            # what AccumulateGrad stores; the hook adds it and clears it
        hook()
    if rest_p:
        torch.autograd.backward(rest_p, rest_g)


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
