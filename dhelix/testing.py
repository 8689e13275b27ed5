"""Run a function on N local gloo ranks with a timeout (tests and scripts).

`run_ranks(fn, n, timeout=...)` starts n processes, each with RANK/WORLD_SIZE set and
torch.distributed initialised on gloo, calls `fn(*args)` in each and returns the list
of results by rank. If any rank raises, the others are stopped and `RankError` carries
the failing rank's traceback; if they do not finish within `timeout` seconds (a
deadlock, a dead peer), all are killed and `RankTimeout` says which ranks were still
running. Nothing is left hanging.

Ranks start from a fork server that has already imported torch and megatron-core
(`dhelix/base/preload.py`): a rank is up in milliseconds instead of the seconds those
imports take, which is most of the test suite's time. A rank gets the caller's
environment as it is at the call (not the server's, which is frozen at its start);
`DHELIX_RANK_START=spawn` starts each rank from a fresh interpreter instead.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable, Dict, List, Optional


class RankError(RuntimeError):
    pass


class RankTimeout(RankError):
    pass


def _rank_main(fn, args, kwargs, rank, world, port, env, q, caller_env):
    try:
        os.environ.clear()           # a fork server's environment dates from its start
        os.environ.update(caller_env)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world),
                           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                           "DHELIX_FORCE_CPU": "1"})
        from dhelix.base.nodes import local_cpus
        cpus = local_cpus(rank, world)
        if cpus:
            os.environ.setdefault("DHELIX_CPUS", cpus)
        os.environ.update(env or {})
        import torch
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        from dhelix.base.warnings import quiet_library_warnings
        quiet_library_warnings()
        from dhelix.train.dist import init_distributed
        init_distributed(timeout_s=float(os.environ.get("DHELIX_PG_TIMEOUT", "60")))
        result = fn(*args, **kwargs)
        # by value: through the queue torch would share a tensor's storage by a file
        # descriptor that this process must still be alive to hand over
        q.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including SystemExit from argparse
        q.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _died(procs, results, reporter: int, grace: float) -> Optional[int]:
    """A rank other than `reporter` that exited with an error without reporting."""
    end = time.time() + grace
    while True:
        dead = [r for r, p in enumerate(procs) if r != reporter and r not in results
                and p.exitcode not in (None, 0)]
        if dead or time.time() >= end:
            return dead[0] if dead else None
        time.sleep(0.05)


def _start_context():
    """The fork server (preloaded imports) where there is one, else spawn."""
    if (os.environ.get("DHELIX_RANK_START", "forkserver") == "spawn"
            or "forkserver" not in mp.get_all_start_methods()):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # takes effect when the server starts (the first call); later calls reuse it
    ctx.set_forkserver_preload(["dhelix.base.preload"])
    return ctx


def run_ranks(fn: Callable, nranks: int, *args, timeout: float = 120.0,
              env: Optional[Dict[str, str]] = None, **kwargs) -> List[Any]:
    """Run `fn(*args, **kwargs)` on `nranks` gloo ranks; results by rank."""
    from dhelix.train.dist import free_port

    ctx = _start_context()
    caller_env = dict(os.environ)
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main,
                         args=(fn, args, kwargs, r, nranks, port, env, q, caller_env),
                         daemon=True) for r in range(nranks)]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    deadline = time.time() + timeout
    try:
        while len(results) < nranks:
            left = deadline - time.time()
            if left <= 0:
                running = [r for r in range(nranks) if r not in results]
                raise RankTimeout(f"ranks {running} did not finish within {timeout:.0f}s "
                                  f"(deadlock or dead peer)")
            try:
                rank, status, payload = q.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise RankError(f"rank {dead[0]} died with exit code "
                                    f"{procs[dead[0]].exitcode} before reporting")
                continue
            if status == "error":
                # a peer's death shows on the others as a lost connection: blame the
                # rank that died first, if one did (it may need a moment to be reaped)
                dead = _died(procs, results, rank, grace=1.0)
                if dead is not None:
                    raise RankError(f"rank {dead} died with exit code {procs[dead].exitcode} "
                                    f"before reporting; rank {rank} then failed:\n{payload}")
                raise RankError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        from dhelix.links.shm import remove_segments
        remove_segments(port)
    return [results[r] for r in range(nranks)]
