"""A compute op's local autograd graph (shared by the layer, ring-attention and MoE ops):
built by `traced`, differentiated by `local_grad`."""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from dhelix.base.memory import METER

# autograd's engine, called directly: `torch.autograd.grad` validates and normalises its
# arguments in Python (~20 µs a call, ~800 calls a step for small16's 8 micro-batches),
# which the local graphs, whose output grads are made here with their outputs' shapes,
# do not need
_ENGINE = torch.autograd.Variable._execution_engine


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


def local_grad(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
               grads: Sequence[torch.Tensor], allow_unused: bool = False
               ) -> Tuple[torch.Tensor, ...]:
    """`torch.autograd.grad(outputs, inputs, grads, allow_unused=...)` through the engine
    directly: the same backward, bit for bit, without the Python checks; a grad whose
    shape is not its output's is refused here, as `torch.autograd.grad` would."""
    for y, g in zip(outputs, grads):
        if g.shape != y.shape:
            raise RuntimeError(f"local graph: grad of shape {tuple(g.shape)} for an output "
                               f"of shape {tuple(y.shape)}")
    return _ENGINE.run_backward(tuple(outputs), tuple(grads), False, False, tuple(inputs),
                                allow_unused, False)
