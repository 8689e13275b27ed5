"""A checkpoint's RNG states (`rng_state`, Megatron-LM's key and layout): Python's,
numpy's, torch's CPU and CUDA generators and the model-parallel tracker's, and the device
type they came from, so that a save from the other device type is not restored (its
generator states do not load into this one's) but named in the `resumed from` line."""
from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch

from dhelix.base.hardware import uses_cuda


def sharded(layout):
    """This rank's RNG states as Megatron-LM shards them: one object per (PP, TP) stage,
    the DP ranks its replicas; with EP > 1 one per rank (experts draw from per-EP-rank
    streams)."""
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.dist_checkpointing import ShardedObject
    cuda = uses_cuda()
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             # no CUDA generator on a CPU rank: its CPU one stands in
             "cuda_rng_state": torch.cuda.get_rng_state() if cuda else torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
             # the device whose generators these are (Megatron-LM ignores the key)
             "rng_device": "cuda" if cuda else "cpu"}
    pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    pps, tps = (ps.get_pipeline_model_parallel_world_size(),
                ps.get_tensor_model_parallel_world_size())
    dp = ps.get_data_parallel_rank(with_context_parallel=True)
    if layout.ep > 1:
        return ShardedObject("rng_state", [state], (pps, tps, layout.dp * layout.cp),
                             (pp, tp, dp), replica_id=0)
    return ShardedObject("rng_state", [state], (pps, tps), (pp, tp), replica_id=dp)


def device(state: dict) -> str:
    """The device type whose generators a saved RNG state holds: its `rng_device`; a save
    without it (older, or Megatron-LM's own) by its CUDA generator state's size (CUDA's
    Philox state is 16 bytes, the CPU Mersenne twister's 5056)."""
    if "rng_device" in state:
        return state["rng_device"]
    return "cuda" if state["cuda_rng_state"].numel() < 64 else "cpu"


def restorable(state: dict) -> Optional[str]:
    """None if this process can restore `state`, else why not: generator states of one
    device type do not load into the other's (torch.cuda.set_rng_state would fail after
    the model and optimizer had loaded)."""
    saved, mine = device(state), "cuda" if uses_cuda() else "cpu"
    if saved != mine:
        return (f"RNG state, saved on {saved.upper() if saved == 'cuda' else saved}; this "
                f"run is on {mine.upper() if mine == 'cuda' else mine}, whose generators "
                f"start from --seed")
    return None


def restore(state: dict) -> None:
    from megatron.core import tensor_parallel
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if uses_cuda():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
