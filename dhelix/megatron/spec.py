"""Layer specs for Megatron-LM's `--spec`: the DHelix layer in megatron's local spec.

Older Megatron-LM imports the object named by `--spec`; newer versions call it. Both
work: `dhelix_layer_spec` is a ModuleSpec, `get_dhelix_layer_spec` returns one.
"""
from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from dhelix.strand.layer import DHelixLayer


def with_dhelix_layer(spec):
    """The same spec with megatron's TransformerLayer replaced by the DHelix layer
    (a layer spec, or a block spec with its list of layer specs)."""
    if isinstance(spec, TransformerBlockSubmodules):
        return TransformerBlockSubmodules(
            layer_specs=[with_dhelix_layer(s) for s in spec.layer_specs],
            layer_norm=spec.layer_norm)
    if isinstance(spec, ModuleSpec) and isinstance(spec.module, type) and \
            issubclass(spec.module, TransformerLayer):
        if spec.module not in (TransformerLayer, DHelixLayer):
            raise ValueError(f"--dhelix: layer class {spec.module.__name__} is not megatron's "
                             f"TransformerLayer; DHelix replaces only that one")
        return ModuleSpec(module=DHelixLayer, params=dict(spec.params or {}),
                          submodules=spec.submodules)
    return spec


def get_dhelix_layer_spec(*args, normalization: str = None, **kwargs) -> ModuleSpec:
    """Megatron's local GPT layer spec with the DHelix layer. On a machine without CUDA
    the CPU-safe spec (torch norm with sequence parallel, SDPA core attention). With
    --context-parallel-size > 1 (read from Megatron's args) the core attention is DHelix's
    ring (megatron's local DotProductAttention refuses context parallel)."""
    import torch
    cp = getattr(args[0], "context_parallel_size", 1) if args else 1
    if not torch.cuda.is_available():
        from dhelix.models.spec import layer_spec
        return layer_spec(DHelixLayer, context_parallel_size=cp)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    if normalization is None and args and hasattr(args[0], "normalization"):
        normalization = args[0].normalization      # called with Megatron's args
    return with_ring_attention(
        with_dhelix_layer(get_gpt_layer_local_spec(normalization=normalization)), cp)


def with_ring_attention(spec, context_parallel_size: int):
    """With context parallel, the layer's core attention becomes DHelix's ring (megatron's
    local DotProductAttention asserts CP = 1; its CP attention is Transformer Engine's)."""
    if context_parallel_size > 1 and isinstance(spec, ModuleSpec):
        from dhelix.models.ring_attention import RingAttention
        spec.submodules.self_attention.submodules.core_attention = RingAttention
    return spec


dhelix_layer_spec = get_dhelix_layer_spec()
