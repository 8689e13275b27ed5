"""Checkpoints by global parameter name: the same files whatever the pipeline layout and
whatever the expert-parallel size.

`save` writes, for every (TP rank, pipeline stage), the weights that stage holds under
the names of the unfolded PP = 1 model (`decoder.layers.7...`). Dense parameters come
from data-parallel rank 0: `DIR/tp{t}-pp{p}.pt`. Experts (megatron's SequentialMLP
`local_experts`, replicated over the expert-data-parallel group, not the DP one) are
named by their global index (EP rank × local experts + i, megatron's own convention:
`build.global_names`) and written apart, once per (expert-TP rank, EP rank, stage), from
expert-data-parallel rank 0: `DIR/experts-etp{e}-ep{r}-pp{p}.pt`, with the expert count,
EP size and expert-TP size. With --expert-tensor-parallel-size 1 the experts are whole,
so the loader of every TP rank reads the same `experts-etp0-*` files.

`load` reads every dense file of this rank's TP rank and every expert file of its
expert-TP rank, and takes each parameter by its global name — so a checkpoint written by
the DHelix fold loads into PP = 1 or megatron's 1F1B and back, and one written at EP = 2
loads at EP = 1 (each rank then holds all experts) or EP = 4. TP shards stay TP shards:
load with the TP size (and expert-TP size) that saved. Every file is written to a
temporary name and renamed, so a file is never half-written.
"""
from __future__ import annotations

import glob
import os
import re

import torch
import torch.distributed as dist

FORMAT = "dhelix.checkpoint"
VERSION = 2


class CheckpointError(ValueError):
    pass


def expert_params(chunks) -> set:
    """ids of the expert parameters in `chunks`: those of megatron's expert containers
    (SequentialMLP's `local_experts`), and any megatron marks as reduced over the
    expert-data-parallel group (`allreduce = False`, EP > 1). At EP = 1 too, so a MoE
    checkpoint always keeps its experts apart, with their count and expert-TP size."""
    out = set()
    for c in chunks:
        for mod in c.modules():
            if isinstance(getattr(mod, "local_experts", None), torch.nn.ModuleList):
                out.update(id(p) for p in mod.local_experts.parameters())
        out.update(id(p) for p in c.parameters() if not getattr(p, "allreduce", True))
    return out


def num_experts_of(chunks) -> int:
    """Global expert count of the model in `chunks` (0 without experts)."""
    for c in chunks:
        for mod in c.modules():
            local = getattr(mod, "local_experts", None)
            if isinstance(local, torch.nn.ModuleList):
                group = getattr(mod, "ep_group", None)
                return len(local) * (group.size() if group is not None else 1)
    return 0


def _write(obj, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)          # never a half-written file


def save(chunks, directory: str, tp_size: int) -> str:
    """Write this rank's share (see the module doc); returns the dense file's path."""
    from megatron.core import parallel_state
    from dhelix.train.build import named_parameters_global
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    dense, experts = {}, {}
    expert = expert_params(chunks)
    for g, p in named_parameters_global(chunks):
        if g in dense or g in experts:
            raise CheckpointError(f"--save {directory}: two parameters of this rank are "
                                  f"both named {g} (an expert container DHelix cannot name "
                                  f"globally?)")
        (experts if id(p) in expert else dense)[g] = p
    path = os.path.join(directory, f"tp{tp}-pp{pp}.pt")
    head = {"format": FORMAT, "version": VERSION, "tp_size": tp_size, "pp_size": pp_size}
    # one writer per (TP, PP): DP rank 0 of the DP × CP group (the CP ranks hold the
    # same weights; two of them writing one file race on its rename)
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
        _write({**head, "params": {g: p.detach().cpu().clone() for g, p in dense.items()}},
               path)
    if experts and parallel_state.get_expert_data_parallel_rank() == 0:
        etp = parallel_state.get_expert_tensor_parallel_rank()
        ep = parallel_state.get_expert_model_parallel_rank()
        _write({**head, "kind": "experts",
                "expert_tp_size": parallel_state.get_expert_tensor_parallel_world_size(),
                "ep_size": parallel_state.get_expert_model_parallel_world_size(),
                "num_experts": num_experts_of(chunks),
                "params": {g: p.detach().cpu().clone() for g, p in experts.items()}},
               os.path.join(directory, f"experts-etp{etp}-ep{ep}-pp{pp}.pt"))
    if dist.is_initialized():
        dist.barrier()
    return path


def _one_save(directory: str, seen: dict, field: str, value, f: str) -> None:
    """Files of one save agree on `field`; `seen` maps each value met to its first file."""
    seen.setdefault(value, f)
    if len(seen) > 1:
        (a, fa), (b, fb) = sorted(seen.items())
        raise CheckpointError(
            f"--load {directory}: files of two checkpoints mixed in one folder: "
            f"{os.path.basename(fa)} has {field} {a}, {os.path.basename(fb)} {field} {b}; "
            f"--save into an empty folder")


def _read(f: str) -> dict:
    try:
        d = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:                      # truncated, not a torch file, ...
        raise CheckpointError(f"--load {f}: cannot be read ({type(e).__name__}: {e}); "
                              f"save the checkpoint again") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CheckpointError(f"--load {f}: not a dhelix checkpoint")
    return d


def load(chunks, directory: str, tp_size: int) -> int:
    """Copy every parameter of `chunks` from the checkpoint; returns how many."""
    from megatron.core import parallel_state
    from dhelix.train.build import named_parameters_global
    tp = parallel_state.get_tensor_model_parallel_rank()
    mine = list(named_parameters_global(chunks))
    expert = expert_params(chunks)
    need = {g for g, _ in mine}
    if "output_layer.weight" in need:          # saved tied: the embedding holds it
        need.add("embedding.word_embeddings.weight")
    files = sorted(glob.glob(os.path.join(directory, f"tp{tp}-pp*.pt")))
    if not files:
        raise CheckpointError(f"--load {directory}: no checkpoint files tp{tp}-pp*.pt there "
                              f"(write one with --save)")
    state, where = {}, {}
    pp_sizes = {}

    def take(f, d):
        if "pp_size" in d:
            _one_save(directory, pp_sizes, "pp_size", d["pp_size"], f)
        for g, t in d["params"].items():
            if g in need:
                state[g], where[g] = t, f

    for f in files:
        d = _read(f)
        if d["tp_size"] != tp_size:
            raise CheckpointError(f"--load {f}: tp_size {d['tp_size']} (saved with "
                                  f"--tensor-model-parallel-size {d['tp_size']}), this run "
                                  f"has {tp_size}; load with the same TP size")
        take(f, d)
    n_experts = num_experts_of(chunks)
    if n_experts:
        etp_size = parallel_state.get_expert_tensor_parallel_world_size()
        etp = parallel_state.get_expert_tensor_parallel_rank()
        every = sorted(glob.glob(os.path.join(directory, "experts-*.pt")))
        efiles = [f for f in every if re.fullmatch(rf"experts-etp{etp}-ep\d+-pp\d+\.pt",
                                                    os.path.basename(f))]
        if every and not efiles:       # an expert-TP rank this checkpoint does not have
            d = _read(every[0])
            raise CheckpointError(
                f"--load {every[0]}: expert_tp_size {d.get('expert_tp_size')} (saved with "
                f"--expert-tensor-parallel-size {d.get('expert_tp_size')}), this run has "
                f"{etp_size}: no experts-etp{etp}-*.pt for expert-TP rank {etp}; load with "
                f"--expert-tensor-parallel-size {d.get('expert_tp_size')}")
        ep_sizes = {}
        for f in efiles:
            d = _read(f)
            if d.get("num_experts") != n_experts:
                raise CheckpointError(
                    f"--load {f}: num_experts {d.get('num_experts')}, this model has "
                    f"{n_experts}; load with --num-experts {d.get('num_experts')} (or the "
                    f"model config that saved)")
            if d.get("expert_tp_size") != etp_size:
                raise CheckpointError(
                    f"--load {f}: expert_tp_size {d.get('expert_tp_size')} (saved with "
                    f"--expert-tensor-parallel-size {d.get('expert_tp_size')}), this run has "
                    f"{etp_size}; load with --expert-tensor-parallel-size "
                    f"{d.get('expert_tp_size')}")
            _one_save(directory, ep_sizes, "ep_size", d.get("ep_size"), f)
            take(f, d)
    n = 0
    with torch.no_grad():
        for g, p in mine:
            src, f = state.get(g), where.get(g)
            if src is None and g == "output_layer.weight":     # saved tied: the embedding
                g0 = "embedding.word_embeddings.weight"
                src, f = state.get(g0), where.get(g0)
            if src is None:
                hint = (" (experts are read from experts-etp*-ep*-pp*.pt: is one of this "
                        "checkpoint's expert files missing?)" if id(p) in expert else
                        " (a different model config?)")
                raise CheckpointError(f"--load {directory}: parameter {g} is not in the "
                                      f"checkpoint{hint}")
            if tuple(src.shape) != tuple(p.shape):
                raise CheckpointError(f"--load {f}: {g} has shape {tuple(src.shape)}, this "
                                      f"model {tuple(p.shape)}; load with the model config "
                                      f"(and TP size) that saved")
            p.copy_(src)
            n += 1
    return n
