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
                log: Optional[str] = None, name: str = "dhelix") -> int:
    """Run `python -m dhelix.cli argv` as `nproc` local ranks. If one rank fails, the
    others are stopped and a summary says which rank failed, how (exit code or signal),
    at what iteration, and that the others were stopped; an error message the ranks
    report (bad input) is printed once, not once per rank. Returns the exit code."""
    import tempfile
    port = free_port()
    procs = []
    sink = open(log, "a") if log else None     # ranks' output goes to a log file
    status = tempfile.mkdtemp(prefix="dhelix-ranks-")   # errors and progress, per rank
    for r in range(nproc):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), DHELIX_RANK_STATUS=status,
                   OMP_NUM_THREADS=os.environ.get(
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
    first = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                first = failed[0]
                rc = first[1]
                break
            if all(c == 0 for c in codes):
                break
            if timeout_s and time.time() - start > timeout_s:
                print(f"{name}: ranks did not finish within {timeout_s:.0f}s; stopping them",
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
        if first is not None:
            _report_failure(name, first[0], first[1], nproc, status)
        import shutil
        shutil.rmtree(status, ignore_errors=True)
    # a rank killed by a signal: the shell convention, 128 + signal
    return 128 - rc if rc < 0 else rc


def _report_failure(name: str, rank: int, code: int, nproc: int, status: str) -> None:
    """torchrun-style summary of a failed job, on the launcher's stderr."""
    import glob
    import signal as _signal
    errors = {}
    for path in sorted(glob.glob(os.path.join(status, "error.rank*"))):
        r = int(path.rsplit("rank", 1)[1])
        with open(path) as f:
            errors.setdefault(f.read().strip(), []).append(r)
    if errors:          # bad input the ranks reported: each message once
        for msg, ranks in errors.items():
            print(msg, file=sys.stderr)
        return
    if code < 0:
        try:
            how = f"was killed by signal {-code} ({_signal.Signals(-code).name})"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    it = rank_progress(status, rank)
    at = f" at iteration {it}" if it is not None else " before its first iteration"
    others = [r for r in range(nproc) if r != rank]
    stopped = f"; stopped the other rank{'s' if len(others) > 1 else ''} " \
              f"({', '.join(f'rank {r}' for r in others)})" if others else ""
    print(f"{name}: rank {rank} {how}{at}{stopped}", file=sys.stderr)


def rank_progress(status: str, rank: int) -> Optional[int]:
    try:
        with open(os.path.join(status, f"progress.rank{rank}")) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None


def report_progress(iteration: int) -> None:
    """A rank records the iteration it is in (for the launcher's failure summary)."""
    status = os.environ.get("DHELIX_RANK_STATUS")
    if status:
        rank = os.environ.get("RANK", "0")
        try:
            with open(os.path.join(status, f"progress.rank{rank}"), "w") as f:
                f.write(str(iteration))
        except OSError:
            pass


def report_error(message: str) -> bool:
    """A rank hands its error message to the launcher, which prints it once; False when
    not launched by `spawn_local` (print it yourself)."""
    status = os.environ.get("DHELIX_RANK_STATUS")
    if not status:
        return False
    rank = os.environ.get("RANK", "0")
    try:
        with open(os.path.join(status, f"error.rank{rank}"), "w") as f:
            f.write(message)
        return True
    except OSError:
        return False
