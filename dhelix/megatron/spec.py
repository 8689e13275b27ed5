"""Layer specs for Megatron-LM: DHelix's one spec (`models/spec.py`), on every device.

`get_dhelix_layer_spec` / `dhelix_layer_spec`: the DHelix layer on that spec (SDPA core
attention, the one-node norm, megatron's linears and bias-dropout-add). `with_dhelix_layer`
turns a megatron local spec (what the install hook intercepts) into it, refusing what the
DHelix layer does not have. `get_local_sdpa_spec` / `local_sdpa_spec`: megatron's own
TransformerLayer on the same spec — the baseline that compares the schedule alone, with
the same kernels. Older Megatron-LM imports the object named by `--spec`; newer versions
call it: both work.
"""
from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from dhelix.compat import mcore
from dhelix.models.spec import Norm, layer_spec
from dhelix.strand.layer import DHelixLayer


class SpecError(ValueError):
    """A megatron spec that DHelix's layer cannot stand in for."""


def _args_of(args):
    a = args[0] if args else None
    return (getattr(a, "num_experts", None) or None,
            getattr(a, "context_parallel_size", 1) or 1)


def get_dhelix_layer_spec(*args, **kwargs) -> ModuleSpec:
    """The DHelix layer spec, the same on every device. Called with Megatron's args, it
    takes --num-experts and --context-parallel-size from them (the ring attention)."""
    num_experts, cp = _args_of(args)
    return layer_spec(DHelixLayer, num_experts, cp)


def get_local_sdpa_spec(*args, **kwargs) -> ModuleSpec:
    """megatron's TransformerLayer on DHelix's spec: the baseline with DHelix's kernels."""
    num_experts, cp = _args_of(args)
    return layer_spec(TransformerLayer, num_experts, cp)


def _check_supported(spec: ModuleSpec) -> bool:
    """Refuse what the DHelix layer lacks; return whether the MLP is an MoE block."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    sa = spec.submodules.self_attention
    sa_class = mcore.spec_class(sa)
    if not (sa_class is not None and issubclass(sa_class, SelfAttention)):
        raise SpecError(f"--dhelix: self-attention {sa_class or sa} is not "
                        f"megatron's SelfAttention (multi-latent attention and other "
                        f"variants are not DHelix ops yet)")
    sub = mcore.spec_submodules(sa)
    for name in ("q_layernorm", "k_layernorm"):
        norm = getattr(sub, name, None)
        if norm not in (None, IdentityOp):
            raise SpecError(f"--dhelix: the layer has a {name} (--qk-layernorm); DHelix's "
                            f"layer has none yet: drop --qk-layernorm")
    mlp_class = mcore.spec_class(spec.submodules.mlp)
    return mlp_class is not None and "MoE" in mlp_class.__name__


def with_dhelix_layer(spec, context_parallel_size: int = 1, layer_module=DHelixLayer):
    """DHelix's spec in place of a megatron layer spec (or of every layer of a block
    spec, whose final norm becomes DHelix's `Norm`, which sequence parallel accepts):
    the same layer structure (dense or MoE MLP, the ring with context parallel), DHelix's
    kernels, `layer_module` as the layer (the DHelix layer, or megatron's for the
    baseline)."""
    if isinstance(spec, TransformerBlockSubmodules):
        return TransformerBlockSubmodules(
            layer_specs=[with_dhelix_layer(s, context_parallel_size, layer_module)
                         for s in spec.layer_specs], layer_norm=Norm)
    if isinstance(spec, ModuleSpec) and isinstance(spec.module, type) and \
            issubclass(spec.module, TransformerLayer):
        if spec.module not in (TransformerLayer, DHelixLayer):
            raise SpecError(f"--dhelix: layer class {spec.module.__name__} is not megatron's "
                            f"TransformerLayer; DHelix replaces only that one")
        moe = _check_supported(spec)
        return layer_spec(layer_module, True if moe else None, context_parallel_size)
    return spec


dhelix_layer_spec = get_dhelix_layer_spec()
local_sdpa_spec = get_local_sdpa_spec()
