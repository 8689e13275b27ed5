"""A micro-batch's forward and backward as nodes, around megatron's own steps.

F(k): megatron's `forward_step` — the user's forward_step_func: embedding, the decoder,
final norm, output layer, loss — runs with a node runner active, so each DHelix layer
of the model becomes a layer node (`strand.node`) that the schedule runs, possibly
beside another micro-batch's backward node. The micro-batch's nodes are recorded.

B(k): an explicit walk in backward order, driven by the schedule on its one thread:
  post-process node  megatron's `backward_step` from the loss; autograd stops at the
                     last layer node's output (a leaf) and leaves the gradient there;
  layer nodes L..1   each one's backward ops; the input grad goes to the node below;
  pre-process node   autograd from the first layer node's input to the embedding.
No backward is ever run by autograd on the schedule's behalf, so nothing waits inside
the autograd engine (on CUDA: its device thread).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from dhelix.strand.executor import Tracer
from dhelix.strand.lanes import Lanes
from dhelix.strand.layer import node_runner
from dhelix.strand.node import LayerNode, accumulate_grads


class NodeChainError(RuntimeError):
    """The model does something between DHelix layers that the node walk cannot see."""


@dataclass
class Microbatch:
    index: int
    output: Any                           # megatron's output tensor (the scaled loss)
    nodes: List[LayerNode] = field(default_factory=list)


class ForwardRunner:
    """The node runner of one micro-batch's forward: each DHelix layer called becomes a
    node, handed to `execute(node)` (the schedule decides what runs beside it)."""

    def __init__(self, lanes: Lanes, label: str, execute: Callable[[LayerNode], None],
                 tiles: int = 1):
        self.lanes, self.label, self.execute, self.tiles = lanes, label, execute, tiles
        self.nodes: List[LayerNode] = []

    def layer_forward(self, layer, x, meta):
        if self.nodes and x is not self.nodes[-1].out:
            raise NodeChainError(
                f"layer {layer.layer_number}: its input is not the output of the DHelix layer "
                f"before it (something runs between layers, e.g. activation offloading); "
                f"DHelix needs the decoder's layers back to back")
        node = LayerNode(layer, x, meta, self.lanes, "α", self.label, self.tiles)
        self.execute(node)
        self.nodes.append(node)
        return node.finish_forward()


class BackwardWalk:
    """β: one micro-batch's backward as explicit nodes (see the module doc).

    A parameter used both above the layers and below them — the output layer's weight
    tied to the word embedding — gets one gradient per micro-batch, the sum of both
    parts, as megatron's single autograd pass gives it: the post-process part is held
    until the pre-process node adds its own. Every other parameter's gradient goes to its
    AccumulateGrad as soon as its last contribution in its node is in (`strand.node`).

    The walk owns the micro-batch's nodes (`mb.nodes` is emptied) and lets each go when
    its backward is done: a finished node keeps nothing, its input — the output of the
    node below, whose own `out` the walk clears then — is freed, and the walk holds only
    the gradient in flight and the first layer's input for the pre-process node.

    `hold` (megatron DDP's no_sync): every gradient this walk hands over is handed inside
    it — a backward that is not the step's last, run beside the last (the paired tail),
    must not ready a DDP bucket."""

    def __init__(self, mb: Microbatch, steps: "MicrobatchSteps", label: str,
                 grad_output: Optional[torch.Tensor] = None,
                 hold: Optional[Callable] = None):
        self.mb, self.steps, self.label, self.hold = mb, steps, label, hold
        self.grad_output = grad_output      # None: the output is the loss
        self.pending, mb.nodes = list(mb.nodes), []
        self.first_input = self.pending[0].x_in if self.pending else None
        self.g: Optional[torch.Tensor] = None
        self.input_grad: Optional[torch.Tensor] = None   # for the stage before (pipeline)
        self.held: Dict[int, torch.Tensor] = {}
        self.below: List[torch.Tensor] = []

    def post(self) -> None:
        """Post-process node: loss → gradient of the last layer node's output (and of the
        final norm's and output layer's parameters)."""
        from megatron.core.pipeline_parallel import schedules as ms
        out, self.mb.output = self.mb.output, None
        if not self.pending:        # no DHelix layer: megatron's own backward step
            with self.hold() if self.hold is not None else contextlib.nullcontext():
                ms.backward_step(None, out, self.grad_output, self.steps.model_type,
                                 self.steps.config)
            return
        if self.grad_output is None and self.steps.config.grad_scale_func is not None:
            out = self.steps.config.grad_scale_func(out)
        last = self.pending[-1]
        body = self.steps.body_params
        grads = torch.autograd.grad(out, [last.out] + body, grad_outputs=self.grad_output,
                                    allow_unused=True)
        self.g = grads[0]
        last.out = None
        if self.g is None:
            raise NodeChainError("the loss does not depend on the last DHelix layer's "
                                 "output; DHelix needs the decoder to end the model body")
        self.below = graph_params(self.first_input)
        tied = {id(p) for p in self.below}
        now = [(p, g) for p, g in zip(body, grads[1:]) if g is not None]
        self.held = {id(p): g for p, g in now if id(p) in tied}
        now = [(p, g) for p, g in now if id(p) not in tied]
        accumulate_grads([p for p, _ in now], [g for _, g in now], self.hold)

    def remaining(self) -> int:
        return len(self.pending)

    def next(self) -> LayerNode:
        node = self.pending.pop()
        g, self.g = self.g, None            # the node's states hold it (or their tiles)
        node.grad_hold = self.hold
        node.begin_backward(g, "β", self.label)
        node.recompute_forward(self.steps.tracer)    # a recomputed layer: forward again
        return node

    def done(self, node: LayerNode) -> None:
        """The node's input grad goes on; its input (the output of the node below) goes."""
        self.g = node.finish_backward()
        if self.pending:
            self.pending[-1].out = None

    def pre(self) -> None:
        """Pre-process node: the first layer's input grad into the embedding's graph."""
        assert not self.pending, "pre-process backward before every layer node's backward"
        x, self.first_input = self.first_input, None
        params, grads = [], []
        if self.below:
            got = torch.autograd.grad(x, self.below, self.g, allow_unused=True)
            for p, g in zip(self.below, got):
                held = self.held.pop(id(p), None)
                if held is not None:      # megatron's order: output layer's part first
                    g = held if g is None else held + g
                if g is not None:
                    params.append(p)
                    grads.append(g)
        accumulate_grads(params, grads, self.hold)
        if x is not None and x.requires_grad and x.grad_fn is None:
            self.input_grad = self.g          # a received pipeline input: its gradient
        self.g, self.below = None, []


def graph_params(x: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """The leaves (parameters) that `x`'s autograd graph reaches: what the pre-process
    node's backward gives gradients to."""
    if x is None or x.grad_fn is None:
        return []
    out, seen, todo = [], set(), [x.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)       # AccumulateGrad
        if var is not None:
            out.append(var)
        todo.extend(f for f, _ in fn.next_functions)
    return out


class MicrobatchSteps:
    """megatron's forward_step / backward_step of micro-batch k with DHelix layer nodes,
    and the bookkeeping megatron's schedules do around them (tokens, finalize)."""

    def __init__(self, forward_step_func, data_iterator, model, num_microbatches,
                 lanes: Lanes, tracer: Optional[Tracer] = None, collect_non_loss_data=False,
                 first_val_step=None):
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config, get_model_type
        self.fs, self.data, self.model = forward_step_func, data_iterator, model
        self.n, self.collect, self.first_val = num_microbatches, collect_non_loss_data, \
            first_val_step
        self.lanes, self.tracer = lanes, tracer
        self.config, self.model_type = get_model_config(model), get_model_type(model)
        own_recompute(model)
        self.cp = parallel_state.get_context_parallel_world_size()
        self.store: list = []
        # parameters outside the DHelix layers (embedding, final norm, output layer)
        from dhelix.strand.layer import DHelixLayer
        in_layers = {id(p) for m in model.modules() if isinstance(m, DHelixLayer)
                     for p in m.parameters()}
        self.body_params = [p for p in model.parameters()
                            if p.requires_grad and id(p) not in in_layers]
        device = next(model.parameters()).device
        # on the model's device: megatron's finalize all-reduces it on an NCCL group
        self.tokens = torch.zeros([], dtype=torch.int, device=device)

    def forward(self, k: int, execute: Callable[[LayerNode], None], tiles: int = 1,
                data=None, input_tensor=None, is_last_stage: bool = True) -> Microbatch:
        """Micro-batch k's forward; in a pipeline, `data` (this chunk's view of the
        micro-batch), the received `input_tensor`, and whether this chunk ends the model."""
        from megatron.core.pipeline_parallel import schedules as ms
        runner = ForwardRunner(self.lanes, f"F{k + 1}", execute, tiles)
        with node_runner(runner):
            out, ntok = ms.forward_step(
                self.fs, self.data if data is None else data, self.model, self.n,
                input_tensor, self.store, self.config, self.cp, self.collect,
                is_first_microbatch=ms.check_first_val_step(self.first_val, False, k == 0),
                current_microbatch=k, is_last_stage=is_last_stage)
        self.tokens += ntok          # no host copy: stays where megatron made it
        return Microbatch(k, out, runner.nodes)

    def backward(self, mb: Microbatch, grad_output=None, hold=None) -> BackwardWalk:
        return BackwardWalk(mb, self, f"B{mb.index + 1}", grad_output, hold)

    def finalize(self) -> None:
        c = self.config
        if c.finalize_model_grads_func is not None:
            c.finalize_model_grads_func([self.model],
                                        self.tokens if c.calculate_per_token_loss else None)


def own_recompute(model) -> None:
    """Full recompute under DHelix is the layer nodes' (`LayerNode.recompute_forward`):
    a TransformerBlock of DHelix layers set to checkpoint whole layers itself would run
    them inside megatron's checkpoint, where no node can be made. Such a block gets its
    own copy of the config with `recompute_granularity` None — its layers keep the
    shared config, from which each program reads whether it is recomputed. Idempotent."""
    import copy
    from megatron.core.transformer.transformer_block import TransformerBlock
    from dhelix.strand.layer import DHelixLayer
    for m in model.modules():
        if isinstance(m, TransformerBlock) and \
                getattr(m.config, "recompute_granularity", None) == "full" and \
                any(isinstance(x, DHelixLayer) for x in m.layers):
            cfg = copy.copy(m.config)
            cfg.recompute_granularity = None
            m.config = cfg


def unwrap_and_evaluate(model, data_iterator, forward_only, **kw):
    """PP = 1: one model chunk and one data iterator. Returns (model, data_iterator,
    eval_result): with `forward_only` (evaluation: nothing to pair) megatron's own
    schedule runs, the DHelix layers in plain mode, and its result is returned."""
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("DHelix without pipeline parallelism takes one model chunk")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if not forward_only:
        return model, data_iterator, None
    from megatron.core.pipeline_parallel import schedules as ms
    return model, data_iterator, ms.forward_backward_no_pipelining(
        model=model, data_iterator=data_iterator, forward_only=True, **kw)
