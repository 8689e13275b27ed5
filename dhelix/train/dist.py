"""Process-group setup for local (`--nproc`), torchrun and Slurm (`srun`) launches.

Rank and world size come from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK) or
Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); NCCL on GPU, gloo on CPU.
"""
from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from dhelix.base.nodes import _env_int, local_cpus, node_ids, pin_to_cpus


class LaunchError(RuntimeError):
    pass


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    backend: str
    device: torch.device


def init_distributed(timeout_s: float = 120.0) -> DistInfo:
    """Initialise torch.distributed from the launcher's environment (idempotent)."""
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    use_cuda = torch.cuda.is_available() and os.environ.get("DHELIX_FORCE_CPU") != "1"
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    pin_to_cpus()
    if not dist.is_initialized():
        from dhelix.links.paced import install_from_env
        install_from_env()          # --link paced:...: before the first collective
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local, node_ids(world)[rank], backend, device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(nproc: int, argv: List[str], timeout_s: Optional[float] = None,
                extra_env: Optional[dict] = None, prefix: Optional[List[str]] = None,
                log: Optional[str] = None) -> int:
    """Run `python -m dhelix.cli argv` as `nproc` local ranks; if one rank fails, stop the
    others and return its exit code (no rank is left hanging)."""
    port = free_port()
    procs = []
    sink = open(log, "a") if log else None     # ranks' output goes to a log file
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=os.environ.get(
                       "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))))
        cpus = local_cpus(r, nproc)
        if cpus and "DHELIX_CPUS" not in os.environ:
            env["DHELIX_CPUS"] = cpus
        env.update(extra_env or {})
        procs.append(subprocess.Popen(list(prefix or []) + [sys.executable, "-m", "dhelix.cli"]
                                      + argv, env=env,
                                      stdout=sink, stderr=sink))
    start = time.time()
    rc = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                rc = failed[0]
                break
            if all(c == 0 for c in codes):
                break
            if timeout_s and time.time() - start > timeout_s:
                print(f"dhelix: ranks did not finish within {timeout_s:.0f}s; stopping them",
                      file=sys.stderr)
                rc = 124
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if sink is not None:
            sink.close()
        from dhelix.links.shm import remove_segments
        remove_segments(port)
    return rc
