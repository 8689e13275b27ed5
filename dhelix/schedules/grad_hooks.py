"""Megatron DDP's gradient hook per parameter, for handing a finished gradient over
without the autograd engine.

megatron's DDP registers, on each parameter's AccumulateGrad, a post-hook that adds
`param.grad` to `param.main_grad`, sets `param.grad` to None and, with
`overlap_grad_reduce`, tells the parameter's bucket that its gradient is ready. A DHelix
node's gradient is made outside autograd; handed to AccumulateGrad by
`torch.autograd.backward`, it costs an engine call and a copy of the gradient (the engine
holds references to it, so AccumulateGrad cannot take it over) before that hook runs. Here
the same hook (megatron's own function, made for the parameter) runs directly on the
gradient: the same `main_grad` sum, the same bucket bookkeeping, no engine, no copy."""
from __future__ import annotations

import os
from typing import Callable, Dict

import torch

from dhelix.strand.node import DDP_HOOK


def ddp_grad_hooks(chunks) -> Dict[torch.nn.Parameter, Callable[[], None]]:
    """For the parameters of megatron DDP wrappers among `chunks`: the post-hook DDP
    registered on their AccumulateGrad (a fresh closure of DDP's `_make_backward_post_hook`,
    which does the same). Parameters whose hook DDP registers elsewhere
    (`delay_wgrad_compute`) and other wrappers (megatron's FSDP, torch's DDP) are left
    out: their gradients go through autograd."""
    from megatron.core.distributed import DistributedDataParallel
    hooks = {}
    for c in chunks:
        if not isinstance(c, DistributedDataParallel):
            continue          # another wrapper (FSDP, torch's DDP): autograd's path
        delayed = getattr(c.ddp_config, "delay_wgrad_compute", False)
        for p in c.module.parameters():
            if p.requires_grad and not (delayed and getattr(p, "skip_backward_post_hook",
                                                            False)):
                hooks[p] = c._make_backward_post_hook(p)
    return hooks


def use_ddp_grad_hooks(chunks) -> int:
    """From now on, the parameters of megatron's DDP wrappers `chunks` get their
    gradients as megatron's DDP hook takes them (`strand.node.accumulate_grads`), not
    through an autograd engine call; DHELIX_GRAD_DIRECT=0 keeps the engine path. Returns
    how many parameters take the direct path."""
    if os.environ.get("DHELIX_GRAD_DIRECT", "1") == "0":
        return 0
    hooks = ddp_grad_hooks(chunks)
    for p, hook in hooks.items():
        setattr(p, DDP_HOOK, hook)      # lives and dies with the parameter
    return len(hooks)
