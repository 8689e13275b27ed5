"""Build megatron-core's GPTModel from a ModelConfig and parallel settings."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from dhelix.models.config import ModelConfig
from dhelix.models.spec import block_spec


def transformer_config(m: ModelConfig, *, tp: int = 1, sequence_parallel: bool = False,
                       bf16: bool = False, fp16: bool = False, pp: int = 1, ep: int = 1,
                       etp: Optional[int] = None, cp: int = 1,
                       recompute_granularity: Optional[str] = None,
                       recompute_method: Optional[str] = None,
                       recompute_num_layers: Optional[int] = None) -> TransformerConfig:
    """The megatron TransformerConfig for a model shape. Fusions that need CUDA kernels
    are off; the math is megatron's unfused path, which the DHelix layer mirrors.
    The recompute settings are megatron's (--recompute-*): its TransformerBlock
    checkpoints whole layers (full) or its attention the core (selective); under DHelix's
    schedule the layer nodes recompute instead (docs/recompute.md)."""
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization=m.normalization,
        activation_func=F.silu if m.activation == "swiglu" else F.gelu,
        gated_linear_unit=m.activation == "swiglu",
        add_bias_linear=m.add_bias_linear,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype,
        bf16=bf16,
        fp16=fp16,
        pipeline_dtype=dtype,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        recompute_granularity=recompute_granularity,
        recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
        **(_moe(m, ep, etp or tp) if m.num_experts else {}),
    )


def _moe(m: ModelConfig, ep: int, etp: int) -> dict:
    """megatron's MoE settings: all-to-all dispatcher, no token dropping, the router's
    load-balancing aux loss as megatron computes it."""
    return dict(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                moe_token_dispatcher_type="alltoall",
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_grouped_gemm=False,
                moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                moe_permute_fusion=False)


def build_gpt(m: ModelConfig, config: TransformerConfig, layer_module=TransformerLayer,
              seq_length: int = 128) -> GPTModel:
    """megatron-core GPTModel with the CPU-safe spec; `layer_module` picks the layer."""
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(m.num_layers, layer_module, m.num_experts,
                                          config.context_parallel_size),
        vocab_size=m.vocab_size,
        max_sequence_length=max(seq_length, m.max_position_embeddings),
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
    )
