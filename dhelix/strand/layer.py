"""The DHelix layer: megatron's TransformerLayer, runnable as op chains.

`DHelixLayer` is built by the same spec, submodules and parameters as megatron-core's
`TransformerLayer`, so names, shapes, TP sharding and (sharded) state dicts are the
same and checkpoints move both ways. Outside an interleaved schedule it *is* a plain
TransformerLayer. Inside one (a strand runner is active on the calling thread), its
forward and backward become requests to the runner, which executes them as op chains,
possibly paired with another strand's ops; autograd still sees one node per layer, so
megatron's loss, DDP hooks and grad accumulation work unchanged.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from dhelix.strand.program import LayerProgram
from dhelix.strand.state import StrandState

_local = threading.local()


def active_runner():
    return getattr(_local, "runner", None)


class use_runner:
    """Context: DHelix layers called on this thread go through `runner`."""

    def __init__(self, runner):
        self.runner = runner

    def __enter__(self):
        self.prev = active_runner()
        _local.runner = self.runner
        return self.runner

    def __exit__(self, *exc):
        _local.runner = self.prev


_bwd = {"runner": None}


class set_backward_runner:
    """Context: layer backwards go to `runner` whatever thread autograd runs them on
    (on GPU the autograd engine uses its own device threads)."""

    def __init__(self, runner):
        self.runner = runner

    def __enter__(self):
        self.prev = _bwd["runner"]
        _bwd["runner"] = self.runner

    def __exit__(self, *exc):
        _bwd["runner"] = self.prev


class DHelixLayer(TransformerLayer):
    """Drop-in for megatron-core's TransformerLayer (local spec)."""

    _program: Optional[LayerProgram] = None

    @property
    def program(self) -> LayerProgram:
        if self._program is None:
            object.__setattr__(self, "_program", LayerProgram(self))
        return self._program

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None,
                rotary_pos_emb=None, **kwargs):
        runner = active_runner()
        plain = (runner is None or not torch.is_grad_enabled() or context is not None
                 or kwargs.get("inference_context") is not None
                 or kwargs.get("packed_seq_params") is not None
                 or kwargs.get("attention_bias") is not None)
        if plain:
            return super().forward(hidden_states, attention_mask=attention_mask,
                                   context=context, context_mask=context_mask,
                                   rotary_pos_emb=rotary_pos_emb, **kwargs)
        S = runner.new_state(self)
        S.meta = {"attention_mask": attention_mask, "rotary_pos_emb": rotary_pos_emb}
        out = _StrandLayerFn.apply(runner, self, S, hidden_states, *self.program.params)
        return out, context


class _StrandLayerFn(torch.autograd.Function):
    """One autograd node per layer; its forward and backward are op chains run by the
    strand runner. Parameters are inputs, so their grads flow through AccumulateGrad
    (and megatron DDP's hooks) exactly as for megatron's own layer."""

    @staticmethod
    def forward(ctx, runner, layer, S: StrandState, x, *params):
        S.put("x", x.detach())
        runner.forward(layer, S)
        ctx.runner, ctx.layer, ctx.S = runner, layer, S
        return S.get("out")

    @staticmethod
    def backward(ctx, g):
        S = ctx.S
        S.counting = False
        S.put("g_out", g.contiguous())
        # the strand whose thread runs this backward; on GPU autograd uses a device
        # thread of its own, so the schedule names the backward strand globally
        (active_runner() or _bwd["runner"] or ctx.runner).backward(ctx.layer, S)
        gx = S.get("g_x")
        grads = [S.grads.get(id(p)) for p in ctx.layer.program.params]
        S.clear()
        ctx.S = None
        return (None, None, None, gx, *grads)
