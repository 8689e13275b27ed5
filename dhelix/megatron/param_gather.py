"""--overlap-param-gather under DHelix: no op reads a weight before its gather is done.

With megatron's distributed optimizer and overlapped parameter gathering, each rank
updates its shard of the weights and the all-gather of every bucket runs during the next
forward: megatron's DDP puts a forward pre-hook on every module that waits for the
buckets of the module's *own* parameters before the module runs. DHelix's ops read the
layer's weights directly (`strand/program.py`), never through the submodules' forward,
so those hooks never fire for them.

The guarantee: every DHelix layer gets one more forward pre-hook that waits for the
gathers of *all* its parameters (recursively: attention, MLP or experts, router, norms).
A layer's ops run only inside its node, and the node is made by the layer's forward
(`strand/layer.py`), after the pre-hooks; its backward ops read the same weights later
in the same step. Embedding, final norm and output layer are megatron's own modules,
waited for by megatron's own hooks.
"""
from __future__ import annotations

from functools import partial


def guard_param_gather(chunks, layer_cls=None) -> int:
    """Register the wait on every `layer_cls` layer (default: DHelixLayer) of each DDP
    chunk that overlaps its parameter gather; returns how many layers got it. Idempotent."""
    if layer_cls is None:
        from dhelix.strand.layer import DHelixLayer as layer_cls
    n = 0
    for chunk in chunks if isinstance(chunks, (list, tuple)) else [chunks]:
        if not getattr(chunk, "use_forward_hook", False) or \
                getattr(chunk, "_dhelix_gather_guard", False):
            continue
        for module in chunk.module.modules():
            if isinstance(module, layer_cls):
                module.register_forward_pre_hook(partial(_wait_for_layer, chunk))
                n += 1
        chunk._dhelix_gather_guard = True
    return n


def _wait_for_layer(chunk, module, *unused):
    """Finish the all-gather of each bucket group holding one of `module`'s parameters,
    in parameter order (the same on every rank, so the collectives match)."""
    if not chunk.remove_forward_pre_hook_handles:
        return              # megatron disabled its hooks and synchronized the params itself
    skip_next = bool(chunk.ddp_config.align_param_gather or
                     chunk.overlap_param_gather_with_optimizer_step)
    seen = set()
    for p in module.parameters():
        group = chunk.param_to_bucket_group.get(p)
        if group is not None and id(group) not in seen:
            seen.add(id(group))
            group.finish_param_sync(skip_next_bucket_dispatch=skip_next)
