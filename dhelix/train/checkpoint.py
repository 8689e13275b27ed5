"""Checkpoints by global parameter name: the same files whatever the pipeline layout.

`save` writes, for every (TP rank, pipeline stage), the weights that stage holds under
the names of the unfolded PP = 1 model (`decoder.layers.7...`), from data-parallel rank
0: `DIR/tp{t}-pp{p}.pt`. `load` reads every file of this rank's TP rank and takes each
parameter by its global name — so a checkpoint written by the DHelix fold loads into
PP = 1 or megatron's 1F1B and back. TP shards stay TP shards: load with the TP size that
saved.
"""
from __future__ import annotations

import glob
import os

import torch
import torch.distributed as dist


class CheckpointError(ValueError):
    pass


def save(chunks, directory: str, tp_size: int) -> str:
    from megatron.core import parallel_state
    from dhelix.train.build import named_parameters_global
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    path = os.path.join(directory, f"tp{tp}-pp{pp}.pt")
    if parallel_state.get_data_parallel_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        state = {g: p.detach().cpu().clone() for g, p in named_parameters_global(chunks)}
        torch.save({"format": "dhelix.checkpoint", "version": 1, "tp_size": tp_size,
                    "params": state}, path + ".tmp")
        os.replace(path + ".tmp", path)      # never a half-written file
    if dist.is_initialized():
        dist.barrier()
    return path


def load(chunks, directory: str, tp_size: int) -> int:
    """Copy every parameter of `chunks` from the checkpoint; returns how many."""
    from megatron.core import parallel_state
    from dhelix.train.build import named_parameters_global
    tp = parallel_state.get_tensor_model_parallel_rank()
    files = sorted(glob.glob(os.path.join(directory, f"tp{tp}-pp*.pt")))
    if not files:
        raise CheckpointError(f"--load {directory}: no checkpoint files tp{tp}-pp*.pt there "
                              f"(write one with --save)")
    state = {}
    for f in files:
        d = torch.load(f, map_location="cpu", weights_only=True)
        if d.get("format") != "dhelix.checkpoint":
            raise CheckpointError(f"--load {f}: not a dhelix checkpoint")
        if d["tp_size"] != tp_size:
            raise CheckpointError(f"--load {f}: saved with --tensor-model-parallel-size "
                                  f"{d['tp_size']}, this run has {tp_size}; load with the "
                                  f"same TP size")
        state.update(d["params"])
    n = 0
    with torch.no_grad():
        for g, p in named_parameters_global(chunks):
            src = state.get(g)
            if src is None and g == "output_layer.weight":     # saved tied: the embedding
                src = state.get("embedding.word_embeddings.weight")
            if src is None:
                raise CheckpointError(f"--load {directory}: parameter {g} is not in the "
                                      f"checkpoint (a different model config?)")
            if tuple(src.shape) != tuple(p.shape):
                raise CheckpointError(f"--load {directory}: {g} has shape {tuple(src.shape)}"
                                      f", this model {tuple(p.shape)}")
            p.copy_(src)
            n += 1
    return n
