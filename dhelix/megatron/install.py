"""The install hook: with `--dhelix`, swap the layer spec and the forward-backward
function of an unmodified Megatron-LM / megatron-core; without it, change nothing."""
from __future__ import annotations

import functools
import sys

from dhelix.megatron.args import check_dhelix_args

_ORIGINAL = {}


def dhelix_options(args) -> dict:
    opts = {k[len("dhelix_"):]: v for k, v in vars(args).items() if k.startswith("dhelix_")}
    opts["enabled"] = bool(getattr(args, "dhelix", False))
    return opts


def install(args) -> bool:
    """Apply the hooks if `args.dhelix` (DHelix's layer spec and schedule) or
    `args.dhelix_sdpa_baseline` (the spec with megatron's layer, megatron's schedule);
    returns whether anything was installed."""
    check_dhelix_args(args)
    if getattr(args, "dhelix_sdpa_baseline", False):
        from megatron.core.transformer.transformer_layer import TransformerLayer
        _install_spec(args, TransformerLayer)
        return True
    if not getattr(args, "dhelix", False):
        return False
    if getattr(args, "dhelix_fold", False):
        from dhelix.megatron.args import DHelixArgError
        raise DHelixArgError("--dhelix-fold: Megatron-LM's pretrain_gpt.py builds megatron's "
                             "own pipeline placement; the U-folded pipeline runs with "
                             "`dhelix train --pipeline-model-parallel-size G --dhelix "
                             "--dhelix-fold`")
    from megatron.core import pipeline_parallel
    from megatron.core.pipeline_parallel import schedules

    from dhelix.schedules.dhelix import DHelixSchedule, forward_backward_dhelix
    from dhelix.strand.layer import DHelixLayer

    schedule = DHelixSchedule(dhelix_options(args))

    def get_forward_backward_func(*a, **k):
        return functools.partial(functools.wraps(forward_backward_dhelix)(_guarded),
                                 schedule=schedule)

    targets = [pipeline_parallel, schedules]
    training = sys.modules.get("megatron.training.training")
    if training is not None:
        targets.append(training)
    for mod in targets:
        if hasattr(mod, "get_forward_backward_func"):
            _ORIGINAL.setdefault((mod.__name__, "get_forward_backward_func"),
                                 mod.get_forward_backward_func)
            mod.get_forward_backward_func = get_forward_backward_func
    _install_spec(args, DHelixLayer)
    return True


def _guarded(*args, schedule, **kwargs):
    """DHelix's forward-backward, after the --overlap-param-gather wait is on every DHelix
    layer of the model (once; `megatron/param_gather.py`)."""
    from dhelix.megatron.param_gather import guard_param_gather
    from dhelix.schedules.dhelix import forward_backward_dhelix
    guard_param_gather(kwargs.get("model"))
    return forward_backward_dhelix(*args, schedule=schedule, **kwargs)


def _install_spec(args, layer_module) -> None:
    """megatron's local spec function (and Megatron-LM gpt_builders' copy of it) returns
    DHelix's spec with `layer_module`; a block of layer specs ends with DHelix's `Norm`
    (megatron's torch norm refuses sequence parallel)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    from dhelix.megatron.spec import with_dhelix_layer
    from dhelix.models.spec import Norm

    orig_local = _ORIGINAL.setdefault((gpt_layer_specs.__name__, "get_gpt_layer_local_spec"),
                                      gpt_layer_specs.get_gpt_layer_local_spec)

    @functools.wraps(orig_local)
    def local_spec(*a, **k):
        return with_dhelix_layer(orig_local(*a, **k), getattr(args, "context_parallel_size", 1),
                                 layer_module)
    local_spec.dhelix_hook = True
    # Megatron-LM's model builders import the spec function by name (gpt_builders; from
    # core_v0.19 also megatron.training.models.gpt): patch every copy of it
    _patch_everywhere("get_gpt_layer_local_spec", orig_local, local_spec)
    # the final norm megatron adds to a layer spec's block
    _ORIGINAL.setdefault((transformer_block.__name__, "LayerNormImpl"),
                         transformer_block.LayerNormImpl)
    transformer_block.LayerNormImpl = Norm


def _patch_everywhere(attr: str, original, replacement) -> None:
    """Set `attr` to `replacement` in every loaded module whose `attr` is `original` (or an
    earlier install's replacement)."""
    for name, mod in list(sys.modules.items()):
        # the module's own names only: a module-level __getattr__ (torch's) may raise
        now = getattr(mod, "__dict__", {}).get(attr) if mod is not None else None
        if now is not None and (now is original or getattr(now, "dhelix_hook", False)):
            _ORIGINAL.setdefault((name, attr), original)
            setattr(mod, attr, replacement)


def uninstall() -> None:
    for (modname, attr), fn in _ORIGINAL.items():
        mod = sys.modules.get(modname)
        if mod is not None:
            setattr(mod, attr, fn)
    _ORIGINAL.clear()
