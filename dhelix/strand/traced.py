"""A compute op's local autograd graph (shared by the layer, ring-attention and MoE ops)."""
from __future__ import annotations

import torch

from dhelix.base.memory import METER


def traced(fn, x, owned=()):
    """Build fn's local autograd graph. Saved tensors are counted by the activation
    meter, as for megatron's layer. An `owned` input that no op saved is only needed
    for its identity in backward: its storage is freed now (megatron's own graph never
    keeps such a tensor either), so DHelix keeps no extra activations."""
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return (t, METER.hold(t))

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p[0]):
        y = fn(x)
    for t in owned:
        st = t.untyped_storage()
        if st.data_ptr() not in saved and st.data_ptr() != y.untyped_storage().data_ptr():
            st.resize_(0)
    return y
