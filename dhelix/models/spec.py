"""The one layer spec DHelix builds on every device: megatron-core modules plus two
pieces of its own.

megatron-core's local spec needs apex for a sequence-parallel norm, and its core
attention (`DotProductAttention`) keeps a full score tensor per head for backward. `Norm`
(LayerNorm/RMSNorm as one autograd node, torch's fused kernel on CUDA, marked
sequence-parallel) and `SDPAttention` (`scaled_dot_product_attention`: FlashAttention or
cuDNN on CUDA, O(s) memory) replace them; everything else — linears, MLP,
bias-dropout-add, the layer itself — is megatron-core's own. The layer module is a
parameter: megatron's TransformerLayer on this spec is the baseline that compares the
schedule alone, the DHelix layer drops into the same spec.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from dhelix.compat import mcore


def fused_norm_available(x: torch.Tensor) -> bool:
    """torch's fused RMSNorm kernels (forward and backward) exist for CUDA tensors."""
    return x.is_cuda and hasattr(torch.ops.aten, "_fused_rms_norm_backward")


class _RMSNorm(torch.autograd.Function):
    """RMSNorm as one autograd node, as the fused norms of TE and apex are (torch's CPU
    rms_norm is a chain of small ops). One node means the input's gradient arrives as one
    tensor, so where the input is also a residual, its two gradients are summed in one
    order whatever the schedule — what lets DHelix's node backward be bit-identical.
    On CUDA the node runs torch's fused kernels; on CPU the same math in plain ops."""

    @staticmethod
    def forward(ctx, x, weight, eps, fused=None):
        ctx.fused = fused_norm_available(x) if fused is None else fused
        if ctx.fused:
            y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
            ctx.save_for_backward(x, weight, rstd)
            return y
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        if ctx.fused:
            gx, gw = torch.ops.aten._fused_rms_norm_backward(
                g.contiguous(), x, [x.shape[-1]], rstd, weight, [True, True])
            return gx, gw, None, None
        xhat = x.float() * rstd
        gw = (g * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
        gxhat = (g * weight).float()
        gx = rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None, None


class Norm(torch.nn.Module):
    """LayerNorm or RMSNorm (by `config.normalization`) that works with sequence parallel:
    its parameters are marked `sequence_parallel` so megatron all-reduces their grads."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else torch.nn.Parameter(
            torch.zeros(hidden_size, dtype=config.params_dtype))
        for p in self.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def forward(self, x):
        if self.rms:
            return _RMSNorm.apply(x, self.weight, self.eps)
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


class SDPAttention(MegatronModule):
    """Core attention on `scaled_dot_product_attention`: [s, b, np, hn] -> [s, b, np*hn].
    Same constructor as megatron's DotProductAttention, no CUDA buffers."""

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type=None,
                 pg_collection=None, **_):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention: context parallelism is not supported "
                             "(set --context-parallel-size 1)")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None \
            else attention_dropout
        self.softmax_scale = softmax_scale
        if self.softmax_scale is None:
            self.softmax_scale = config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **_):
        if packed_seq_params is not None:
            raise ValueError("SDPAttention: packed sequences are not supported")
        np_, ng = query.size(2), key.size(2)
        if np_ != ng:   # grouped-query attention: repeat KV heads
            key = key.repeat_interleave(np_ // ng, dim=2)
            value = value.repeat_interleave(np_ // ng, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))   # [b, np, s, hn]
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        mask = None
        if not causal and attention_mask is not None:
            mask = ~attention_mask   # megatron masks True = masked out
        ctx = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal,
            dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale)
        s, b = ctx.size(2), ctx.size(0)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, -1)


def moe_spec(num_experts: int = 2):
    """megatron-core's local MoE block: top-k router, all-to-all token dispatcher (by the
    config), `SequentialMLP` experts of megatron linears, and shared experts (built only
    when the config sets moe_shared_expert_intermediate_size) — megatron's own
    `get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts)`, in the form of
    the installed release (`compat/mcore.py`). The number of experts comes from the
    config; the spec only needs one."""
    return mcore.mlp_spec(num_experts=num_experts)


def layer_spec(layer_module=TransformerLayer, num_experts: Optional[int] = None,
               context_parallel_size: int = 1) -> ModuleSpec:
    """A GPT layer spec from megatron-core modules, CPU-safe; `layer_module` is
    megatron's TransformerLayer or the DHelix layer (same submodules, same params); with
    `num_experts` the MLP is megatron's MoE block; with context parallel the core
    attention is the ring (`RingAttention`), for megatron's layer and DHelix's alike."""
    from dhelix.models.ring_attention import RingAttention
    mlp = mcore.mlp_spec(num_experts=int(num_experts) if num_experts else None)
    return ModuleSpec(
        module=layer_module,
        submodules=TransformerLayerSubmodules(
            input_layernorm=Norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=RingAttention if context_parallel_size > 1
                    else SDPAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=Norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            # checkpoint names as megatron's local spec writes them (Megatron-LM's
            # TransformerEngine layers fuse each norm into the linear after it, and name
            # them so): a save of either loads into the other
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
        ),
    )


def block_spec(num_layers: int, layer_module=TransformerLayer,
               num_experts: Optional[int] = None,
               context_parallel_size: int = 1) -> TransformerBlockSubmodules:
    """Block spec whose final norm is the sequence-parallel-capable `Norm` too."""
    spec = layer_spec(layer_module, num_experts, context_parallel_size)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=Norm)
