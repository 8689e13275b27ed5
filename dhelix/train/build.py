"""Model chunks for a layout: PP = 1, megatron's pipeline (1F1B or interleaved), or the
DHelix fold. Each chunk is megatron's GPTModel with the chunk's layers, wrapped in
megatron's DDP, and knows its global layer numbers (`layer_ids`) so that checkpoints and
checksums name every layer the same way in every layout."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from dhelix.folding.placement import Chunk, fold, megatron_pipeline


@dataclass
class Built:
    chunks: list                   # DDP-wrapped model chunks, as megatron's schedules take them
    placement: List[Chunk]         # this stage's chunks
    loss_stage: int                # pipeline rank whose chunk computes the loss


class FoldedStage(torch.nn.Module):
    """The fold's two chunks of one stage in one module (one DDP, one optimizer view): a
    tied output layer on stage 0 is then one parameter, seen once."""

    def __init__(self, front, back):
        super().__init__()
        self.front, self.back = front, back


def placement_of(cfg, m, layout, fold_layers: bool) -> List[List[Chunk]]:
    if fold_layers:
        return fold(m.num_layers, layout.pp)
    if layout.pp == 1:
        return [[Chunk(0, 0, tuple(range(m.num_layers)), True, True)]]
    return megatron_pipeline(m.num_layers, layout.pp, layout.vpp)


def _gpt(cfg, m, tconfig, chunk: Chunk, layer_module, vp_stage, share: bool):
    from megatron.core.models.gpt import GPTModel

    from dhelix.models.spec import block_spec
    spec = block_spec(len(chunk.layers), layer_module, m.num_experts,
                      tconfig.context_parallel_size)
    if cfg.layer_spec == "megatron-local":     # the unfused baseline, timed against
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        spec = get_gpt_layer_local_spec(normalization=tconfig.normalization)
    model = GPTModel(
        config=tconfig, transformer_layer_spec=spec,
        vocab_size=m.vocab_size,
        max_sequence_length=max(cfg.seq_length, m.max_position_embeddings),
        pre_process=chunk.pre_process, post_process=chunk.post_process, parallel_output=True,
        share_embeddings_and_output_weights=share,
        position_embedding_type=m.position_embedding_type, vp_stage=vp_stage)
    for layer, gid in zip(model.decoder.layers, chunk.layers):
        layer.layer_number = gid + 1       # megatron's 1-based global number
    model.layer_ids = chunk.layers
    return model


def build(cfg, m, tconfig, layout, device, layer_module=None,
          fold_layers: bool = False) -> Built:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layer_module = layer_module or TransformerLayer
    stage = parallel_state.get_pipeline_model_parallel_rank() if layout.pp > 1 else 0
    rows = placement_of(cfg, m, layout, fold_layers)
    mine = rows[stage]
    tied = not m.untie_embeddings_and_output_weights
    torch.manual_seed(cfg.seed)
    if fold_layers:
        front = _gpt(cfg, m, tconfig, mine[0], layer_module, None, share=False)
        back = _gpt(cfg, m, tconfig, mine[1], layer_module, None, share=False)
        if tied and stage == 0:   # both ends on stage 0: tie them by sharing the Parameter
            back.output_layer.weight = front.embedding.word_embeddings.weight
        modules = [FoldedStage(front, back)]
        loss_stage = 0
    else:
        vp = layout.vpp > 1
        modules = [_gpt(cfg, m, tconfig, c, layer_module, c.index if vp else None,
                        share=tied) for c in mine]
        loss_stage = layout.pp - 1
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=cfg.overlap_grad_reduce,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        overlap_param_gather=cfg.overlap_param_gather,
        bucket_size=None if not cfg.overlap_grad_reduce else 40000)
    if cfg.bf16 or cfg.fp16:   # every parameter, norms too, in the 16-bit type, as
        half = torch.bfloat16 if cfg.bf16 else torch.float16   # megatron's Float16Module
        modules = [mod.to(half) for mod in modules]
    chunks = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config,
                                      module=mod.to(device)) for mod in modules]
    tconfig.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else \
        [c.no_sync for c in chunks]
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.grad_scale_func = None
    return Built(chunks, mine, loss_stage)


def expert_offsets(gpt) -> dict:
    """Module name of each expert container in `gpt` (megatron's SequentialMLP,
    `...mlp.experts`) -> the global index of its first local expert: megatron's own
    convention (`SequentialMLP.sharded_state_dict`, `MoELayer.local_expert_indices`),
    EP rank × local experts."""
    out = {}
    for name, mod in gpt.named_modules():
        local = getattr(mod, "local_experts", None)
        if not isinstance(local, torch.nn.ModuleList):
            continue
        group = getattr(mod, "ep_group", None)
        if group is not None:
            rank = group.rank()
        else:
            from megatron.core import parallel_state
            rank = parallel_state.get_expert_model_parallel_rank()
        out[name] = rank * len(local)
    return out


def _global_name(name: str, ids, experts: dict) -> str:
    """A parameter's name in one GPT chunk -> its name in the unfolded model with every
    expert at its global index: 'decoder.layers.1.mlp.experts.local_experts.0.x' on EP
    rank 1 of 2 (2 local experts) in a chunk holding layers (6, 7) ->
    'decoder.layers.7.mlp.experts.local_experts.2.x'."""
    for mod, offset in experts.items():
        head = mod + ".local_experts."
        if name.startswith(head):
            local, rest = name[len(head):].split(".", 1)
            name = f"{head}{offset + int(local)}.{rest}"
            break
    if name.startswith("decoder.layers."):
        local, rest = name[len("decoder.layers."):].split(".", 1)
        name = f"decoder.layers.{ids[int(local)]}.{rest}"
    return name


def global_names(chunk) -> dict:
    """Parameter name in `chunk` -> the name of that parameter in the unfolded, PP = 1,
    EP = 1 model ('decoder.layers.7.mlp.linear_fc1.weight'; an expert by its global index,
    'decoder.layers.7.mlp.experts.local_experts.3.linear_fc1.weight', so the names are
    the same whatever the expert-parallel size); a tied output layer maps to None (the
    embedding holds it)."""
    inner = chunk.module
    parts = [("front.", inner.front), ("back.", inner.back)] if isinstance(
        inner, FoldedStage) else [("", inner)]
    out = {}
    seen = set()
    for prefix, gpt in parts:
        ids = gpt.layer_ids
        experts = expert_offsets(gpt)
        for name, p in gpt.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            out["module." + prefix + name] = _global_name(name, ids, experts)
    return out


def named_parameters_global(chunks):
    """(global name, parameter) over every chunk of this rank."""
    for c in chunks:
        names = global_names(c)
        params = dict(c.named_parameters())
        for local, g in names.items():
            yield g, params[local]


def loss_stage_rank(loss_stage: int) -> Optional[int]:
    """Global rank of the loss stage in this rank's pipeline group."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    return dist.get_process_group_ranks(
        parallel_state.get_pipeline_model_parallel_group())[loss_stage]
