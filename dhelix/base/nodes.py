"""Which node each rank sits on: decides whether a process group is `intra` or `inter`."""
from __future__ import annotations

import os
from typing import List, Optional


class NodeIdError(ValueError):
    pass


def _env_int(*names, default=None) -> Optional[int]:
    """The first of the launcher's variables `names` that is set, as an int."""
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return default


def node_ids(world_size: int) -> List[int]:
    """Node id of every rank: DHELIX_NODE_IDS="0,0,1,1" (tests), else from the launcher's
    local world size (ranks are laid out node by node, as torchrun and srun do)."""
    spec = os.environ.get("DHELIX_NODE_IDS")
    if spec:
        ids = [int(x) for x in spec.split(",")]
        if len(ids) != world_size:
            raise NodeIdError(f"DHELIX_NODE_IDS lists {len(ids)} node ids for a world of "
                              f"{world_size} ranks; give one id per rank")
        return ids
    per_node = _env_int("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=world_size)
    return [r // max(per_node, 1) for r in range(world_size)]


def local_cpus(local_rank: int, nproc: int) -> Optional[str]:
    """The cores local rank `local_rank` of `nproc` is pinned to ("2,3"), or None when
    there are fewer cores than ranks. Pinned ranks keep their caches and do not steal
    each other's core: on a 2-core machine an unpinned run's op times swing ±40%."""
    n = os.cpu_count() or 1
    if nproc > n:
        return None
    k = n // nproc
    return ",".join(str(c) for c in range(local_rank * k, (local_rank + 1) * k))


def pin_to_cpus() -> None:
    """Apply DHELIX_CPUS (set by the local launchers) to this process."""
    spec = os.environ.get("DHELIX_CPUS")
    if spec and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {int(c) for c in spec.split(",")})
        except OSError:
            pass          # fewer cores than the launcher saw (a container): stay unpinned
