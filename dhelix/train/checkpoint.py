"""Checkpoints in megatron's distributed format (`dist_checkpointing`, "torch_dist"), laid
out as Megatron-LM lays them out, so that either program resumes the other's run:

    DIR/latest_checkpointed_iteration.txt      the last complete save ("200")
    DIR/iter_0000200/                          one save: metadata.json, common.pt,
                                               .metadata, __*_*.distcp

A save holds what Megatron-LM's `save_checkpoint` holds, under its keys: `model` (each
layer's ShardedTensors, keyed by global layer number, TP/EP shards as megatron cuts
them), `optimizer` (Adam state and fp32 main weights; the distributed optimizer's shards
in megatron's model-space layout), `opt_param_scheduler`, `rng_state`, `iteration`, and
`args` (the run's flags under Megatron-LM's names, `consumed_train_samples` the data
position). dist_checkpointing reshards on load: a save from one TP/PP/EP/CP layout, or
from the DHelix fold, loads into another.

A save is complete when the tracker file names it: rank 0 rewrites the tracker (to a
temporary name, then renamed) only after every rank has written its shards, so a run
killed while saving leaves the previous save loadable.
"""
from __future__ import annotations

import os
import shutil
from types import SimpleNamespace as Namespace    # what Megatron-LM saves as `args`
from dataclasses import asdict, dataclass, field
from typing import List

import torch
import torch.distributed as dist

from dhelix.compat import mcore
from dhelix.train import rng_state

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0                   # Megatron-LM's current one


class CheckpointError(ValueError):
    pass


@dataclass
class Resumed:
    """What a --load restored (the trainer starts at `iteration`)."""
    path: str
    iteration: int = 0
    consumed_samples: int = 0
    restored: List[str] = field(default_factory=list)    # "optimizer state", ...
    skipped: List[str] = field(default_factory=list)     # why something was not restored

    def line(self) -> str:
        what = ", ".join([f"iteration {self.iteration}"] + self.restored) if \
            self.iteration or self.restored else "weights only (iteration 0)"
        skip = f" (not restored: {'; '.join(self.skipped)})" if self.skipped else ""
        return f"resumed from {self.path}: {what}{skip}"


# ---- where saves live -----------------------------------------------------------------

def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int:
    """The iteration the tracker names; CheckpointError if there is no complete save."""
    if not os.path.isdir(root):
        raise CheckpointError(f"--load {root}: no such directory (write one with --save)")
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        saves = sorted(d for d in os.listdir(root) if d.startswith("iter_"))
        hint = (f"; {', '.join(saves)} there never finished saving" if saves else
                " (write one with --save)")
        raise CheckpointError(f"--load {root}: no {TRACKER}, so no complete save{hint}")
    text = open(path).read().strip()
    if text == "release":
        raise CheckpointError(f"--load {path}: a 'release' checkpoint (weights converted "
                              f"for inference); train from one saved by training")
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"--load {path}: holds {text[:40]!r}, not an iteration "
                              f"number") from None


def _write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))      # the save is now the latest


# ---- the state dict -------------------------------------------------------------------

def _gpt_sharded(gpt, meta: dict, drop_tied_output: bool = False) -> dict:
    """megatron's sharded state dict of one GPT chunk, with dict keys this module's own
    `state_dict` keys. megatron names each layer's ShardedTensors by `layer_number` (our
    global number, `build._gpt`), but keys the dict by `layer_number − (megatron's own
    offset of this stage)`; for a placement other than megatron's (the fold) those keys
    are not the module's: rename them."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    sd = gpt.sharded_state_dict(metadata=meta)
    offset = get_transformer_layer_offset(gpt.config, getattr(gpt, "vp_stage", None))
    rename = {}
    for local, layer in enumerate(gpt.decoder.layers):
        wrong = f"decoder.layers.{layer.layer_number - 1 - offset}."
        if wrong != f"decoder.layers.{local}.":
            rename[wrong] = f"decoder.layers.{local}."
    if rename:
        out = {}
        for k, v in sd.items():
            for a, b in rename.items():
                if k.startswith(a):
                    k = b + k[len(a):]
                    break
            out[k] = v
        sd = out
    if drop_tied_output:       # the fold's stage 0: the embedding holds the output weight
        sd.pop("output_layer.weight", None)
    return sd


def model_state(chunks, meta: dict) -> dict:
    """{'model': ...} (or 'model0', 'model1', ... for megatron's interleaved chunks, as
    Megatron-LM keys them): each chunk's sharded state dict. The fold's stage holds two
    GPTs: {'front': ..., 'back': ...} (their ShardedTensor keys are global, so the nesting
    is only this program's)."""
    from dhelix.train.build import FoldedStage
    out = {}
    for i, c in enumerate(chunks):
        inner = c.module
        if isinstance(inner, FoldedStage):
            out_layer = getattr(inner.back, "output_layer", None)
            emb = getattr(inner.front, "embedding", None)
            tied = out_layer is not None and emb is not None and \
                out_layer.weight is emb.word_embeddings.weight
            sd = {"front": _gpt_sharded(inner.front, meta),
                  "back": _gpt_sharded(inner.back, meta, drop_tied_output=tied)}
        else:
            sd = _gpt_sharded(inner, meta)
        out["model" if len(chunks) == 1 else f"model{i}"] = sd
    return out


def _load_model(chunks, loaded: dict, path: str) -> None:
    from dhelix.train.build import FoldedStage
    for i, c in enumerate(chunks):
        sd = loaded["model" if len(chunks) == 1 else f"model{i}"]
        inner = c.module
        parts = [(inner.front, sd["front"]), (inner.back, sd["back"])] if isinstance(
            inner, FoldedStage) else [(inner, sd)]
        for gpt, part in parts:
            missing, unexpected = gpt.load_state_dict(part, strict=False)
            # a tied output weight is the embedding's: loaded through it
            missing = [k for k in missing if k != "output_layer.weight" and
                       not k.endswith("_extra_state")]
            if missing or unexpected:
                raise CheckpointError(f"--load {path}: parameters missing {missing[:4]}, "
                                      f"unexpected {unexpected[:4]}; load with the model "
                                      f"config that saved")


def run_args(cfg, m, layout, iteration: int, consumed: int,
             no_save_optim: bool = False) -> Namespace:
    """The run's flags under Megatron-LM's names (what its `load_checkpoint` reads from a
    checkpoint's `args`), and DHelix's whole TrainConfig under `dhelix_train_config`."""
    return Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.kv_groups, group_query_attention=m.num_query_groups is not None,
        kv_channels=m.hidden_size //
        m.num_attention_heads, max_position_embeddings=max(cfg.seq_length,
                                                           m.max_position_embeddings),
        padded_vocab_size=m.vocab_size, num_experts=m.num_experts or None,
        position_embedding_type=m.position_embedding_type,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size,
        global_batch_size=cfg.micro_batch_size * layout.dp * layout.num_microbatches,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp, data_parallel_size=layout.dp,
        world_size=layout.world, sequence_parallel=cfg.sequence_parallel,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        fp16=cfg.fp16, bf16=cfg.bf16, iteration=iteration, train_iters=cfg.train_iters,
        consumed_train_samples=consumed, consumed_valid_samples=0,
        skipped_train_samples=0, ckpt_format="torch_dist", dhelix_fold=layout.fold,
        no_save_optim=no_save_optim, no_save_rng=False,
        dhelix_train_config=asdict(cfg))


def content_metadata(cfg) -> dict:
    """What Megatron-LM passes to every `sharded_state_dict` and stores with the save
    (`_build_sharded_state_dict_metadata`), with its default layout of the distributed
    optimizer's state: `dp_reshardable`, which loads at another DP size but the same
    TP/PP/EP (its fully reshardable layout gathers through CUDA tensors)."""
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if cfg.use_distributed_optimizer:
        meta["distrib_optim_sharding_type"] = "dp_reshardable"
    return meta


# ---- save -----------------------------------------------------------------------------

def _save_strategy():
    """megatron's torch_dist writer, one writer process per rank (it forks one per
    thread): a test's rank is a daemon process, which may not have children, so the
    writer runs as a non-daemon (the rank still dies with its parent's timeout)."""
    import multiprocessing
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistSaveShardedStrategy)
    multiprocessing.current_process()._config["daemon"] = False
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def save(chunks, optimizer, cfg, m, layout, iteration: int, consumed: int) -> str:
    """Write iteration `iteration` under cfg.save (every rank calls this); returns the
    save's directory. Every rank writes into `iter_N.saving`; once all have, rank 0
renames it `iter_N` and names it in the tracker."""
    from megatron.core import dist_checkpointing
    root = cfg.save
    path = iteration_dir(root, iteration)
    staging = path + ".saving"              # renamed to `path` once complete
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)     # a save killed half-way
        os.makedirs(staging)
    dist.barrier()
    meta = content_metadata(cfg)
    state = model_state(chunks, meta)
    stepped = optimizer.has_state()      # none before the first step: a fresh one
    if stepped:
        state["optimizer"] = optimizer.optimizer.sharded_state_dict(
            state, is_loading=False, metadata=meta)
    state["opt_param_scheduler"] = optimizer.scheduler.state_dict()
    state["rng_state"] = rng_state.sharded(layout)
    state.update(iteration=iteration, checkpoint_version=CHECKPOINT_VERSION,
                 args=run_args(cfg, m, layout, iteration, consumed,
                               no_save_optim=not stepped),
                 num_floating_point_operations_so_far=0)
    dist_checkpointing.save(state, staging, sharded_strategy=_save_strategy(),
                            validate_access_integrity=True, content_metadata=meta)
    dist.barrier()                          # every shard written: now it counts
    if dist.get_rank() == 0:
        if os.path.exists(path):            # an older save of this iteration
            shutil.rmtree(path)
        os.replace(staging, path)
        _write_tracker(root, iteration)
    dist.barrier()
    return path


# ---- load -----------------------------------------------------------------------------

def saved_args(path: str) -> Namespace:
    """The `args` of the save at `path` (its common.pt)."""
    try:
        common = mcore.load_common_state_dict(path)
    except Exception as e:                  # missing or damaged common.pt / metadata.json
        raise CheckpointError(f"--load {path}: not a readable torch_dist checkpoint "
                              f"({type(e).__name__}: {str(e)[:200]})") from None
    args = common.get("args")
    if args is None:
        raise CheckpointError(f"--load {path}: its common.pt has no 'args' (not saved by "
                              f"Megatron-LM or dhelix train)")
    return args


def check_load(cfg, m):
    """Everything about `--load` that can be checked from the files, before any rank
    starts (and again on each rank before it reads): a complete save is named, every shard
    file its metadata lists is there, whole, and the model shape is this run's. Returns
    (the save's folder, its iteration, its args); CheckpointError naming the file and the fix."""
    root = cfg.load
    iteration = read_tracker(root)
    path = iteration_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(f"--load {root}: {TRACKER} names iteration {iteration}, but "
                              f"{path} is not there")
    if not os.path.exists(os.path.join(path, "metadata.json")):
        raise CheckpointError(f"--load {path}: no metadata.json, so not a complete "
                              f"torch_dist save (--ckpt-format torch_dist)")
    args = saved_args(path)
    for f, need in _shard_files(path).items():
        full = os.path.join(path, f)
        if not os.path.exists(full):
            raise CheckpointError(f"--load {full}: missing (the save's .metadata lists it); "
                                  f"copy the whole {os.path.basename(path)} folder, or "
                                  f"resume from another save")
        have = os.path.getsize(full)
        if have < need:
            raise CheckpointError(f"--load {full}: truncated ({have} bytes, the save wrote "
                                  f"at least {need}); copy it again, or resume from "
                                  f"another save")
    check_same_model(args, cfg, m, path)
    return path, iteration, args


def _shard_files(path: str) -> dict:
    """Shard file -> the bytes the save's torch.distributed.checkpoint metadata says it
    holds at least (the end of its last item)."""
    from torch.distributed.checkpoint import FileSystemReader
    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"--load {os.path.join(path, '.metadata')}: cannot be read "
                              f"({type(e).__name__}: {_first_line(e)}); resume from "
                              f"another save") from None
    need = {}
    for info in (meta.storage_data or {}).values():
        f = info.relative_path
        need[f] = max(need.get(f, 0), info.offset + info.length)
    return need


def load(chunks, optimizer, cfg, m, layout, finetune: bool = False,
         load_optim: bool = True, load_rng: bool = True) -> Resumed:
    """Restore the latest save under cfg.load into `chunks` and `optimizer`. With
    `finetune` (Megatron's --finetune) the weights only, iteration 0."""
    from megatron.core import dist_checkpointing
    path, iteration, args = check_load(cfg, m)
    r = Resumed(path)
    if finetune:
        load_optim = load_rng = False
    else:
        r.iteration = iteration
        r.consumed_samples = int(getattr(args, "consumed_train_samples", 0))
    saved_layout, my_layout = _layout_of(args), _layout_of(run_args(cfg, m, layout, 0, 0))
    if load_optim and getattr(args, "no_save_optim", False):
        load_optim = False      # saved before any step: the fresh optimizer is that state
    if load_rng and saved_layout != my_layout:
        load_rng = False
        r.skipped.append(f"RNG state, saved at {_show(saved_layout)}")
    # the layout the save used (a Megatron-LM save: its own choice of optimizer layout)
    meta = dist_checkpointing.load_content_metadata(
        preloaded_state_dict=mcore.load_common_state_dict(path)) or {}
    state = model_state(chunks, meta)
    if load_optim:
        if cfg.use_distributed_optimizer and "distrib_optim_sharding_type" not in meta:
            raise CheckpointError(f"--load {path}: saved without the distributed optimizer; "
                                  f"resume without --use-distributed-optimizer, or with "
                                  f"--no-load-optim")
        if not cfg.use_distributed_optimizer and "distrib_optim_sharding_type" in meta:
            raise CheckpointError(f"--load {path}: saved by the distributed optimizer; "
                                  f"resume with --use-distributed-optimizer, or with "
                                  f"--no-load-optim")
        _check_optimizer_fits(optimizer, path, meta, saved_layout, my_layout)
        optimizer.before_load()
        state["optimizer"] = optimizer.optimizer.sharded_state_dict(
            state, is_loading=True, metadata=meta)
    if load_rng:
        state["rng_state"] = rng_state.sharded(layout)
    try:
        loaded = mcore.load_checkpoint(state, path)
    except Exception as e:
        raise CheckpointError(f"--load {path}: {type(e).__name__}: "
                              f"{_first_line(e)}") from None
    _load_model(chunks, loaded, path)
    if load_optim:
        with torch.no_grad():     # it copies into main weights that are views of leaves
            optimizer.optimizer.load_state_dict(loaded["optimizer"])
        optimizer.after_load()
        try:
            optimizer.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        except AssertionError as e:
            raise CheckpointError(f"--load {path}: {e}; resume with the learning-rate flags "
                                  f"that saved, or --finetune") from None
        r.restored.append("optimizer state")
    elif cfg.bf16 or cfg.fp16:       # fp32 main weights from the loaded 16-bit ones
        optimizer.optimizer.reload_model_params()
    if load_rng:
        rng = loaded["rng_state"]
        rng = rng[0] if isinstance(rng, list) else rng
        why_not = rng_state.restorable(rng)
        if why_not:
            r.skipped.append(why_not)
        else:
            rng_state.restore(rng)
            r.restored.append("RNG state")
    if r.consumed_samples:
        r.restored.append("data position")
    return r


def _check_optimizer_fits(optimizer, path, meta, saved_layout, my_layout) -> None:
    """The optimizer state reshards as megatron can: the plain optimizer's, kept in model
    space, at any layout with the same optimizers (MoE: the dense and the expert
    parameters' optimizers apart, at EP > 1); the distributed optimizer's (dp_reshardable)
    only to another DP size. Else the weights alone can move: one message, the fix."""
    from megatron.core import dist_checkpointing
    saved = mcore.load_common_state_dict(path).get("optimizer", {})
    n_saved = len([k for k in saved if isinstance(k, int)]) or 1
    n_mine = len(getattr(optimizer.optimizer, "chained_optimizers", [None]))
    why = None
    if n_saved != n_mine:
        why = (f"its optimizer state is {n_saved} optimizer(s), this run has {n_mine} "
               f"(MoE: expert parameters get their own at EP > 1)")
    elif meta.get("distrib_optim_sharding_type") == "dp_reshardable" and \
            _but_dp(saved_layout) != _but_dp(my_layout):
        why = ("the distributed optimizer's state (dp_reshardable) loads at another DP "
               "size only")
    if why:
        raise CheckpointError(f"--load {path}: saved at {_show(saved_layout)}: {why}; the "
                              f"weights reshard: add --no-load-optim to resume with a fresh "
                              f"optimizer (or --finetune)")


def _but_dp(layout: tuple) -> tuple:
    return layout[:4] + layout[5:]


def _layout_of(args) -> tuple:
    return tuple(getattr(args, k, 1) or 1 for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "context_parallel_size", "expert_model_parallel_size", "data_parallel_size")) + (
        bool(getattr(args, "dhelix_fold", False)),)


def _show(layout: tuple) -> str:
    tp, pp, cp, ep, dp, fold = layout
    return f"TP={tp} PP={pp}{' (fold)' if fold else ''} CP={cp} EP={ep} DP={dp}"


# the model's shape, by Megatron-LM's args names
SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
         "num_query_groups", "padded_vocab_size", "num_experts")


def check_same_model(args, cfg, m, path: str) -> None:
    """The save's model shape is this run's: else one message naming the field."""
    mine = {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
            "ffn_hidden_size": m.ffn_hidden_size, "num_attention_heads": m.num_attention_heads,
            "num_query_groups": m.kv_groups, "padded_vocab_size": m.vocab_size,
            "num_experts": m.num_experts or None}
    for k in SHAPE:
        theirs = getattr(args, k, None)
        if k == "num_query_groups" and not getattr(args, "group_query_attention", False):
            theirs = getattr(args, "num_attention_heads", None)   # multi-head attention
        if k == "num_experts":
            theirs = theirs or None
        if theirs != mine[k]:
            saved_cfg = (getattr(args, "dhelix_train_config", None) or {}).get("config")
            fix = (f"--config {saved_cfg}" if saved_cfg else
                   f"a model config (configs/models/*.yaml) with {k}: {theirs}")
            raise CheckpointError(
                f"--load {path}: saved with {k} = {theirs}, this run's model "
                f"({cfg.config}) has {mine[k]}; load it with the model that saved: {fix}")


def _first_line(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else "")[:300]
