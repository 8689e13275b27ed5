"""Process-group setup for local (`--nproc`), torchrun and Slurm (`srun`) launches.

Rank and world size come from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK) or
Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); NCCL on GPU, gloo on CPU.
"""
from __future__ import annotations

import datetime
import os
import socket
import signal
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
    from dhelix.base.hardware import uses_cuda
    use_cuda = uses_cuda()
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
        _install_crash_hook()       # after torch's own hook, which it replaces
    return DistInfo(rank, world, local, node_ids(world)[rank], backend, device)


def free_port() -> int:
    """A free TCP port for a job's store, below the kernel's ephemeral range: a port
    the kernel hands out (bind to 0) is released before rank 0's store binds it, and any
    other job's gloo connections may take it in between ('address already in use', rank 0
    dead before its first iteration); ports below the range are only ever taken on
    purpose. Random, so two launchers starting together rarely pick the same one."""
    import random
    low = _ephemeral_low()
    pick = random.SystemRandom()
    first = max(1024, low - 20000)
    for _ in range(64 if first < low else 0):
        port = pick.randrange(first, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:      # all taken: the kernel's choice, race and all
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: 32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def spawn_local(nproc: int, argv: List[str], timeout_s: Optional[float] = None,
                extra_env: Optional[dict] = None, prefix: Optional[List[str]] = None,
                log: Optional[str] = None, name: str = "dhelix") -> int:
    """Run `python -m dhelix.cli argv` as `nproc` local ranks. If one rank fails, the
    others are stopped and a summary names the first rank to fail (see `_first_failure`),
    how (exit code or signal), at what iteration, and that the others were stopped, after
    that rank's own traceback; the others' lost-connection errors are left out. An error
    message the ranks report (bad input) is printed once, not once per rank.

    The launcher owns its ranks. SIGINT, SIGTERM or SIGHUP to it stops them (SIGTERM,
    then SIGKILL after 10 s) and ends the command with 128 + the signal
    (`LauncherStopped`, a SystemExit: a command that starts ranks several times stops as a
    whole; the CLI prints its one line last). The ranks
    ignore SIGINT (a terminal's Ctrl-C reaches the whole process group: the launcher
    stops them), and die with the launcher (Linux's parent-death signal: SIGKILL when it
    dies without a word). With `--exit-signal-handler` in `argv` a SIGTERM is passed on
    instead: the ranks finish their step, save and exit 0 (a second signal stops them).
    Returns the exit code."""
    import shutil
    import tempfile
    port = free_port()
    procs = []
    sink = open(log, "a") if log else None     # ranks' output goes to a log file
    status = tempfile.mkdtemp(prefix="dhelix-ranks-")   # errors and progress, per rank
    exited = {}             # rank -> (wall time its exit was first seen, exit code)
    rc = 0
    failed = False
    interrupted = None      # the signal that stopped the launcher
    graceful = "--exit-signal-handler" in argv
    passed_on = []          # signals passed to the ranks (--exit-signal-handler)

    def on_signal(signum, frame):
        if graceful and signum == signal.SIGTERM and not passed_on and procs:
            passed_on.append(signum)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            print(f"{name}: SIGTERM passed to the ranks (--exit-signal-handler: they finish "
                  f"the step, save and exit)", file=sys.stderr, flush=True)
            return
        raise _Stopped(signum)
    handlers = _set_handlers(on_signal)
    try:
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
            procs.append(_popen_ignoring_sigint(
                list(prefix or []) + [sys.executable, "-m", "dhelix.cli"] + argv,
                env=env, stdout=sink, stderr=sink))
        start = time.time()
        first_seen = None
        while True:
            now = time.time()
            for r, p in enumerate(procs):
                c = p.poll()
                if c is not None and r not in exited:
                    exited[r] = (now, c)
            if any(c != 0 for _, c in exited.values()):
                failed = True
                first_seen = first_seen or now
                # a moment for the others to end on their own (their records say when
                # they failed and why); one still waiting on a collective is stopped
                if len(exited) == nproc or now - first_seen > _FAILURE_GRACE_S:
                    break
            elif len(exited) == nproc:
                break
            if (not failed and timeout_s and now - start > timeout_s):
                print(f"{name}: ranks did not finish within {timeout_s:.0f}s; stopping them",
                      file=sys.stderr)
                rc = 124
                break
            time.sleep(0.05)
    except _Stopped as e:
        interrupted = e.signum
    except KeyboardInterrupt:
        interrupted = signal.SIGINT
    finally:
        _set_handlers(handlers)
        _stop(procs)
        if sink is not None and not interrupted:
            _log_crashes(sink, status)
        if sink is not None:
            sink.close()
        from dhelix.links.shm import remove_segments
        remove_segments(port)
        try:
            if interrupted:
                pass                # LauncherStopped below: the command's last line
            elif failed:
                rank, code = _first_failure(status, exited, nproc)
                rc = code if code not in (None, 0) else 1
                _report_failure(name, rank, code, nproc, status)
        finally:
            shutil.rmtree(status, ignore_errors=True)
    if interrupted:
        raise LauncherStopped(interrupted, len(procs))
    # a rank killed by a signal: the shell convention, 128 + signal
    return 128 - rc if rc < 0 else rc


def log_tail(log: str, lines: int = 15) -> str:
    """The last `lines` lines of a ranks' log (`spawn_local(log=...)`), indented, for an
    error message: the failed run's own words, not just where to find them."""
    try:
        with open(log, errors="replace") as f:
            tail = f.read()[-20000:].splitlines()[-lines:]
    except OSError:
        return ""
    return "".join(f"\n    {line}" for line in tail)


class LauncherStopped(SystemExit):
    """A signal stopped the launcher and its ranks: the whole command ends with 128 + the
    signal (SystemExit), and the CLI prints `line()` as its last line."""

    def __init__(self, signum: int, ranks: int):
        super().__init__(128 + signum)
        self.signum, self.ranks = signum, ranks

    def line(self) -> str:
        n = self.ranks
        return (f"{signal.Signals(self.signum).name} received: stopped {n} "
                f"rank{'s' if n != 1 else ''}")


class _Stopped(Exception):
    """A signal to the launcher: stop the ranks."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def _set_handlers(handler):
    """Install `handler` (a function, or a dict of the previous handlers) for SIGINT,
    SIGTERM and SIGHUP; returns the previous ones. Only the main thread can."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return {}
    old = {}
    for name in _STOP_SIGNALS:
        sig = getattr(signal, name)
        h = handler.get(sig) if isinstance(handler, dict) else handler
        if h is not None:
            old[sig] = signal.signal(sig, h)
    return old


def _die_with_parent() -> None:
    """In a rank, before exec: SIGKILL when the launcher dies (Linux prctl
    PR_SET_PDEATHSIG), so a launcher killed without a word leaves no orphan."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)        # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_FAILURE_GRACE_S = 1.0

# what a rank dies of when another rank died first: a consequence, never the cause
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe")


def _popen_ignoring_sigint(cmd, **kw) -> subprocess.Popen:
    """Start a rank with SIGINT ignored (inherited through exec; Python then installs no
    KeyboardInterrupt handler): a terminal's Ctrl-C reaches only the launcher's handling,
    which stops the ranks, instead of a traceback from every rank."""
    import threading
    kw.setdefault("preexec_fn", _die_with_parent)
    if threading.current_thread() is not threading.main_thread():
        return subprocess.Popen(cmd, **kw)
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return subprocess.Popen(cmd, **kw)
    finally:
        signal.signal(signal.SIGINT, old)


def _stop(procs) -> None:
    """Terminate the ranks still running, wait up to 10 s, then kill (at once on a second
    Ctrl-C)."""
    try:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()


def _crashes(status: str) -> dict:
    """rank -> the record its exception hook left (`_record_crash`): time, error."""
    import glob
    import json
    out = {}
    for path in glob.glob(os.path.join(status, "crash.rank*")):
        try:
            with open(path) as f:
                out[int(path.rsplit("rank", 1)[1])] = json.load(f)
        except (OSError, ValueError):
            pass
    return out


def _lost_peer(error: str) -> bool:
    last = error.strip().splitlines()[-1].lower() if error.strip() else ""
    return any(s in last for s in _LOST_PEER)


def _first_failure(status: str, exited: dict, nproc: int):
    """(rank, exit code or None) of the rank that failed first: among the ranks that
    exited non-zero on their own or recorded an exception, the earliest by the time it
    recorded its failure (else the time its exit was seen); a rank whose own error is a
    lost connection ("connection closed by peer": another rank died) comes after every
    rank that failed of something else."""
    crashes = _crashes(status)
    cands = []
    for r in range(nproc):
        t, code = exited.get(r, (None, None))
        rec = crashes.get(r)
        if rec is None and code in (None, 0):
            continue
        when = rec["time"] if rec is not None else t
        cands.append((rec is not None and _lost_peer(rec.get("error", "")),
                      when if when is not None else float("inf"), r, code))
    if not cands:
        return 0, None
    _, _, rank, code = min(cands)
    return rank, code


def _log_crashes(sink, status: str) -> None:
    """Every rank's recorded traceback into the log the ranks write."""
    for r, rec in sorted(_crashes(status).items()):
        sink.write(_prefixed(r, rec.get("error", "")))
    sink.flush()


def _prefixed(rank: int, text: str) -> str:
    return "".join(f"[rank{rank}]: {line}\n" for line in text.rstrip("\n").splitlines())


def _report_failure(name: str, rank: int, code: Optional[int], nproc: int,
                    status: str) -> None:
    """torchrun-style summary of a failed job, on the launcher's stderr: the first
    failed rank's traceback, then one line naming it."""
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
    rec = _crashes(status).get(rank)
    if rec is not None and rec.get("error"):
        sys.stderr.write(_prefixed(rank, rec["error"]))
    if code is None:
        # it recorded its exception, then was stopped while tearing down
        last = rec["error"].strip().splitlines()[-1] if rec and rec.get("error") else ""
        how = f"failed ({last.split(':', 1)[0]})" if last else "failed"
    elif code < 0:
        try:
            how = f"was killed by signal {-code} ({_signal.Signals(-code).name})"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    it = rank_progress(status, rank)
    if rank_done(status, rank):
        at = " after its work was done and written, while exiting"
    else:
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


def report_done() -> None:
    """A rank records that its work is done and every rank passed the final barrier, so
    a death after it (while the interpreter shuts down) is reported as such."""
    status = os.environ.get("DHELIX_RANK_STATUS")
    if status:
        try:
            open(os.path.join(status, f"done.rank{os.environ.get('RANK', '0')}"), "w").close()
        except OSError:
            pass


def rank_done(status: str, rank: int) -> bool:
    return os.path.exists(os.path.join(status, f"done.rank{rank}"))


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


def _install_crash_hook() -> None:
    """Under `spawn_local`: an uncaught exception is recorded (time, traceback) in the
    status directory for the launcher, which shows the first failed rank's and leaves
    out the others' (most often "connection closed by peer"), instead of every rank
    printing its own."""
    if not os.environ.get("DHELIX_RANK_STATUS"):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        if not _record_crash(kind, value, tb):
            previous(kind, value, tb)
    sys.excepthook = hook


def _record_crash(kind, value, tb) -> bool:
    import json
    import traceback
    status = os.environ.get("DHELIX_RANK_STATUS")
    if not status:
        return False
    when = time.time()
    rank = os.environ.get("RANK", "0")
    text = "".join(traceback.format_exception(kind, value, tb))
    path = os.path.join(status, f"crash.rank{rank}")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"time": when, "error": text}, f)
        os.replace(path + ".tmp", path)
        return True
    except OSError:
        return False


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
