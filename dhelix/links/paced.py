"""The paced link: collectives at loopback speed, completed no earlier than a link model.

Installed in a rank process (before any collective) when DHELIX_LINK is `paced:...`, the
same way for megatron's baseline and for DHelix. It wraps the collective methods of
torch's ProcessGroup class, so every path is seen: megatron's synchronous collectives
inside its layers and mappings (whatever function references they captured), DDP's
coalesced grad reduce, DHelix's asynchronous lane collectives.

For a collective on any group but the default one (the default group carries control
traffic: barriers, plan checks): the link model gives its duration — the ring formula of
the analytical cost model (`planner.costmodel.collective_seconds`, one source for both)
with the link's RATE and per-hop LATENCY — and a FIFO link per group (per node pair for
groups that span nodes) gives its start: when the link is free, or when it is issued.
The data moves at once: through shared memory for the all-gathers, reduce-scatters and
sum all-reduces of ranks on this machine (`shm.py`: gloo's loopback TCP would cost as
much CPU as the link time being modelled), through gloo otherwise. The Work's `wait()`
waits for the data, then sleeps until the modelled completion: a timed wait that holds
no core, as a NIC or NVLink moving bytes by DMA leaves the cores free. Not modelled: the
SMs a real NCCL kernel occupies (unless `slow=X` is given: then `contention.py` stretches
the GEMMs that overlap this rank's in-flight transfers, using the in-flight intervals
recorded here, `PacedLink.busy_seconds`), contention between different links, and
congestion.
"""
from __future__ import annotations

import bisect
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from dhelix.links import Link, clock
from dhelix.planner.costmodel import collective_seconds

_PG = torch._C._distributed_c10d.ProcessGroup
# DHelix's gloo lanes call the link directly (`direct`); False: through torch.distributed,
# as before (for measuring what it buys: scripts/own_cost_inproc.py --ab direct)
DIRECT = True

# method -> (collective kind, index of the positional argument whose tensors give the
# buffer size: all-gather output, reduce-scatter input, all-reduce buffer, ...)
METHODS = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "_allgather_base": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "allgather": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "all_gather_single_coalesced": ("all_gather", 0),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1),
    "alltoall_base": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 1),
    "alltoall": ("all_to_all", 1),
    "broadcast": ("broadcast", 0),
    "send": ("send", 0),
    "recv": ("recv", 0),
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class PacedWork(dist.Work):
    """A collective's Work that completes no earlier than the link model's time."""

    def __init__(self, inner, done_at: float, link: "PacedLink"):
        super().__init__()
        self.inner, self.done_at, self.link = inner, done_at, link

    def wait(self, timeout=None):
        if self.inner is not None:
            called = time.perf_counter()
            if timeout is None:
                self.inner.wait()
            else:
                self.inner.wait(timeout)
            # the peers' data came after the modelled end: a peer rank posted late
            late = time.perf_counter() - max(called, self.done_at)
            if late > 0:
                self.link.late_s += late
        left = self.done_at - time.perf_counter()
        if left > 0:
            self.link.waited_s += left
            clock.sleep_until(self.done_at)
        return True

    def is_completed(self):
        return (self.inner is None or self.inner.is_completed()) and \
            time.perf_counter() >= self.done_at

    def is_success(self):
        return self.inner is None or self.inner.is_success()

    def exception(self):
        return None if self.inner is None else self.inner.exception()

    def get_future(self):
        return self.inner.get_future()

    def source_rank(self):
        return self.inner.source_rank()

    def result(self):
        return self.inner.result()

    def synchronize(self):
        return self.wait()


# how long a transfer's in-flight interval is kept after it ends: a GEMM asks about the
# interval it ran in, so this only has to outlast the longest single GEMM
KEEP_S = 60.0
# intervals older than KEEP_S are dropped this many at a time: dropping each as it ages
# moved the whole list (~20k intervals after a minute) on every collective
PRUNE_MIN = 1024


def union_seconds(spans, t0: float, t1: float) -> float:
    """The measure of the union of the intervals `spans` ((start, end) pairs) within
    [t0, t1]."""
    cut = sorted((max(s, t0), min(e, t1)) for s, e in spans if s < t1 and e > t0)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in cut:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class PacedLink:
    def __init__(self, rate_Bps: float, latency_s: float, slow: float = 0.0):
        self.rate, self.latency, self.slow = rate_Bps, latency_s, slow
        self.free_at: Dict[str, float] = {}       # link -> when it is next free
        self.last_done: Dict[int, float] = {}     # group -> its latest modelled completion
        self._keys: Dict[int, Optional[str]] = {}
        self.shm_groups: Dict[int, object] = {}   # group -> shm.ShmGroup (or None)
        self.lock = threading.Lock()              # DDP hooks may run on autograd's thread
        self.modelled_s = 0.0                     # statistics for tests and reports
        self.waited_s = 0.0
        self.late_s = 0.0          # waits that outlasted the modelled end (a peer was late)
        self.count = 0
        # this rank's transfers in flight, as modelled: (start, done) in schedule order,
        # and the running maximum of done (non-decreasing: the first entry a query from
        # t0 needs is found by bisection, and old ones are pruned from the front)
        self._spans: List[Tuple[float, float]] = []
        self._reach: List[float] = []
        # contention (slow > 0, `contention.py`): the stretch charged to GEMMs that ran
        # while a transfer was in flight (slow x their in-flight seconds), how many were
        # stretched, the seconds actually slept for it (sleeps are batched: within
        # contention.MIN_SLEEP_S of the charge), and the hook ("kernel" | "mode" | None)
        self.stretched_s = 0.0
        self.stretched_ops = 0
        self.stretch_slept_s = 0.0
        self.stretch_hook: Optional[str] = None
        # paced compute (`train/emulate.py`): a group's bytes scaled to the emulated shape's
        # (key id(group), or (id(group), collective) where one kind of collective moves
        # another dtype: the DP group's parameter all-gather), and the emulated cluster's
        # links ("intra_node"/"inter_node" -> (bytes/s, s))
        self.byte_scale: Dict[object, float] = {}
        self.lanes: Optional[Dict[str, Tuple[float, float]]] = None
        self.group_size: Dict[int, int] = {}    # a group priced as this many ranks
        # a group crossing nodes: how many rings share each NIC with it (the node's
        # other ranks run theirs at the same time; `costmodel.nic_share`): its rate / this
        self.share: Dict[int, float] = {}

    def link_of(self, pg) -> Optional[str]:
        """The link a group's collectives queue on; None for the default group."""
        k = id(pg)
        if k not in self._keys:
            default = dist.distributed_c10d._get_default_group()
            if pg is default or pg.size() < 2:
                self._keys[k] = None
            else:
                from dhelix.base.nodes import node_ids
                ranks = dist.get_process_group_ranks(pg)
                nodes = sorted({node_ids(dist.get_world_size())[r] for r in ranks})
                self._keys[k] = (f"intra:{pg.group_name}" if len(nodes) == 1
                                 else "inter:" + "-".join(map(str, nodes)))
        return self._keys[k]

    def schedule(self, pg, collective: str, nbytes: int) -> Optional[float]:
        """The modelled completion time of a collective issued now (host clock). Links
        are full duplex: a send and a receive queue on the two directions of the group's
        link, so a ring step (send to one neighbour, receive from the other) takes one
        transfer, as the cost model's "send_recv" says; collectives use both directions."""
        key = self.link_of(pg)
        if key is None:
            return None
        if collective in ("send", "recv"):
            key = f"{key}:{collective}"
        rate, lat = self.rate, self.latency
        if self.lanes is not None:
            rate, lat = self.lanes["inter_node" if key.startswith("inter") else "intra_node"]
        scale = self.byte_scale.get((id(pg), collective), self.byte_scale.get(id(pg), 1.0))
        dur = collective_seconds(collective, float(nbytes) * scale,
                                 self.group_size.get(id(pg), pg.size()),
                                 rate / self.share.get(id(pg), 1.0), lat) * clock.SCALE
        with self.lock:
            now = time.perf_counter()
            start = max(now, self.free_at.get(key, 0.0))
            done = start + dur
            self.free_at[key] = done
            self.last_done[id(pg)] = done
            self._record(start, done, now)
            self.modelled_s += dur
            self.count += 1
        return done

    def _record(self, start: float, done: float, now: float) -> None:
        """(under the lock) A transfer in flight from `start` to `done`; forget those that
        ended more than KEEP_S before `now`, once PRUNE_MIN of them have gathered."""
        self._spans.append((start, done))
        self._reach.append(max(done, self._reach[-1]) if self._reach else done)
        # _reach is non-decreasing: its PRUNE_MIN-th entry old means PRUNE_MIN old ones
        if len(self._reach) >= PRUNE_MIN and self._reach[PRUNE_MIN - 1] < now - KEEP_S:
            old = bisect.bisect_left(self._reach, now - KEEP_S)
            del self._spans[:old], self._reach[:old]

    def record_transfer(self, start: float, done: float) -> None:
        """Note a transfer of this rank in flight over [start, done] (host clock,
        time.perf_counter); `schedule` does it for every paced collective."""
        with self.lock:
            self._record(start, done, time.perf_counter())

    def busy_seconds(self, t0: float, t1: float) -> float:
        """How long within [t0, t1] at least one transfer of this rank was in flight
        (the measure of the union of the in-flight intervals, cut to [t0, t1])."""
        if t1 <= t0:
            return 0.0
        with self.lock:
            first = bisect.bisect_right(self._reach, t0)   # before it: all ended by t0
            if first == len(self._spans):
                return 0.0
            spans = self._spans[first:]
        return union_seconds(spans, t0, t1)

    def spans_between(self, t0: float, t1: float) -> List[Tuple[float, float]]:
        """This rank's transfers in flight at some time within [t0, t1], as recorded
        ((start, done), host clock): the link track of a trace."""
        with self.lock:
            first = bisect.bisect_right(self._reach, t0)
            return [(s, e) for s, e in self._spans[first:] if s < t1]

    def in_flight_until(self) -> float:
        """When the last transfer recorded so far ends (0.0 if none)."""
        with self.lock:
            return self._reach[-1] if self._reach else 0.0

    def reset_stats(self) -> None:
        """Forget the statistics so far (an emulated run's warm-up step: its waits ran at
        another scale); the modelled queues stay."""
        with self.lock:
            self.modelled_s = self.waited_s = self.late_s = 0.0
            self.count = self.stretched_ops = 0
            self.stretched_s = self.stretch_slept_s = 0.0

    def charge_stretch(self, extra_s: float) -> None:
        with self.lock:
            self.stretched_s += extra_s
            self.stretched_ops += 1

    def note_stretch_sleep(self, slept_s: float) -> None:
        with self.lock:
            self.stretch_slept_s += slept_s


_ACTIVE: Dict[str, PacedLink] = {}


def install(link: Link) -> PacedLink:
    """Wrap ProcessGroup's collective methods with `link`'s model (once per process); with
    `slow=X`, also stretch the GEMMs that overlap a transfer (`contention.py`; the calling
    thread is the rank's training thread)."""
    if "link" in _ACTIVE:
        return _ACTIVE["link"]
    paced = PacedLink(link.rate_Bps, link.latency_s, link.slow)
    if link.slow > 0:
        from dhelix.links.contention import install_stretch
        paced.stretch_hook = install_stretch(paced, link.slow)
    for name, (collective, arg) in METHODS.items():
        orig = getattr(_PG, name, None)
        if orig is not None:
            setattr(_PG, name, _wrap(orig, paced, collective, arg, name))
    end = getattr(_PG, "_end_coalescing", None)
    if end is not None:
        def end_coalescing(self, *a, **k):
            # old-style coalescing: the ops inside were scheduled one by one
            return PacedWork(end(self, *a, **k), paced.last_done.get(id(self), 0.0), paced)
        _PG._end_coalescing = end_coalescing
    _ACTIVE["link"] = paced
    return paced


# methods whose data can move through shared memory: name -> (kind, tensors from args)
SHM = {
    "allreduce": "all_reduce", "_allgather_base": "all_gather",
    "all_gather_single": "all_gather", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
}


def _shm_work(paced: PacedLink, pg, name: str, a, k):
    """The collective on shared memory, or None where it must go to gloo (another op
    than a sum, a list of tensors, a message larger than a slot, ranks on two hosts)."""
    from dhelix.links import shm
    kind = SHM.get(name)
    if kind is None:
        return None
    opts = a[-1] if len(a) > (1 if kind == "all_reduce" else 2) else k.get("opts")
    if kind != "all_gather":
        op = getattr(opts, "reduceOp", None)
        if op is None or not op == dist.ReduceOp.SUM:
            return None
    if kind == "all_reduce":
        ts = a[0]
        if not isinstance(ts, (list, tuple)) or len(ts) != 1:
            return None
        tensors = (ts[0],)
    else:
        tensors = tuple(a[:2])
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors) \
            or not shm.ShmGroup.fits(max(_nbytes(t) for t in tensors)):
        return None
    group = shm.shm_group_for(pg, paced.shm_groups)
    if group is None:
        return None
    return getattr(shm, kind)(group, *tensors)


def _wrap(orig, paced: PacedLink, collective: str, arg: int, name: str):
    def method(self, *a, **k):
        nbytes = _nbytes(a[arg]) if len(a) > arg else 0
        done = paced.schedule(self, collective, nbytes)
        if done is None:
            return orig(self, *a, **k)
        work = _shm_work(paced, self, name, a, k) or orig(self, *a, **k)
        return PacedWork(work, done, paced)
    method.__name__ = orig.__name__ if hasattr(orig, "__name__") else "collective"
    return method


def direct(pg, kind: str):
    """For DHelix's gloo lanes: `fn(out, inp) -> Work` that runs the collective `kind`
    ("all_gather" or "reduce_scatter", torch.distributed's `*_into_tensor` / `*_tensor`
    arguments) of group `pg` on the paced link's shared memory, without torch.distributed's
    Python wrapper and this module's argument parsing (`_wrap`, `_shm_work`): the same
    link model, the same data path, the same Work, about 80 µs less of the issuing
    thread's time per collective here (a NCCL launch costs ~10 µs; the emulator's own
    Python is not the network's cost). None where the collective must go through
    torch.distributed: no paced link, the default group, ranks on several hosts.
    A message larger than a slot falls back per call."""
    from dhelix.links import shm
    paced = _ACTIVE.get("link")
    if paced is None or paced.link_of(pg) is None:
        return None
    group = shm.shm_group_for(pg, paced.shm_groups)
    if group is None:
        return None
    post = getattr(shm, kind)
    arg = 0 if kind == "all_gather" else 1          # the tensor whose bytes the model counts
    fallback = dist.all_gather_into_tensor if kind == "all_gather" else \
        dist.reduce_scatter_tensor

    def fn(out, inp):
        t = (out, inp)[arg]
        nbytes = t.numel() * t.element_size()
        if not shm.ShmGroup.fits(nbytes):
            return fallback(out, inp, group=pg, async_op=True)
        return PacedWork(post(group, out, inp), paced.schedule(pg, kind, nbytes), paced)
    return fn


def active() -> Optional[PacedLink]:
    return _ACTIVE.get("link")


def install_from_env() -> Optional[PacedLink]:
    """Install the paced link this process's DHELIX_LINK names, if it is one."""
    import os
    from dhelix.links import parse_link
    link = parse_link(os.environ.get("DHELIX_LINK", "none"), "DHELIX_LINK")
    return install(link) if link.kind == "paced" else None
