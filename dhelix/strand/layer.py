"""The DHelix layer: megatron's TransformerLayer, runnable as op chains.

`DHelixLayer` is built by the same spec, submodules and parameters as megatron-core's
`TransformerLayer`, so names, shapes, TP sharding and (sharded) state dicts are the same
and checkpoints move both ways. Outside a DHelix step it *is* a plain TransformerLayer.
Inside one (a node runner is active), calling it makes a layer node (`strand.node`) and
hands it to the runner, which runs its forward ops — paired with another strand's
backward ops by the plan — and returns the node's output.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from dhelix.strand.program import LayerProgram

# The runner of the DHelix step in progress. One thread drives a step (DESIGN §4), so one
# slot, not a thread-local: a layer called on another thread during a step is a bug.
_RUNNER = {"active": None}


def active_runner():
    return _RUNNER["active"]


class node_runner:
    """Context: DHelix layers called inside become nodes handed to `runner`, an object
    with `layer_forward(layer, hidden_states, meta) -> Tensor`."""

    def __init__(self, runner):
        self.runner = runner

    def __enter__(self):
        self.prev = _RUNNER["active"]
        _RUNNER["active"] = self.runner
        return self.runner

    def __exit__(self, *exc):
        _RUNNER["active"] = self.prev


class DHelixLayer(TransformerLayer):
    """Drop-in for megatron-core's TransformerLayer (local spec)."""

    _program: Optional[LayerProgram] = None

    @property
    def program(self) -> LayerProgram:
        if self._program is None:
            from megatron.core.transformer.moe.moe_layer import MoELayer
            if isinstance(self.mlp, MoELayer):
                from dhelix.strand.moe import MoEProgram
                program = MoEProgram(self)
            else:
                program = LayerProgram(self)
            object.__setattr__(self, "_program", program)
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
        meta = {"attention_mask": attention_mask, "rotary_pos_emb": rotary_pos_emb}
        return runner.layer_forward(self, hidden_states, meta), context
