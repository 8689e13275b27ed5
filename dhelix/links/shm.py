"""Shared-memory data movement for the paced link (ranks on one machine).

gloo over loopback TCP costs about 1.2 ms of CPU per rank for a 512 KiB all-gather on this
machine — as long as the link time being modelled — so the paced link moves the bytes of
its collectives through shared memory instead: a copy in at issue, a copy (or sum) out at
`wait()`. Both are memcpy-speed work; the waiting in between polls with sleeps.

Each rank owns one segment per process group: a header (`posted`: the last sequence
number whose data it wrote, `done`: the last up to which it has finished reading every
collective) and K slots.
The group's collectives are numbered in issue order, the same on every rank (collective
semantics already demand that order). Collective s uses slot s % K of every member:
  issue(s): wait until every member is done with s - K (the slot is free), copy the
            input into the own slot, publish `posted = s`;
  wait(s):  wait until every member has posted s, read (gather) or sum (reduce) the
            members' slots into the output, publish `done` = the highest d with every
            collective <= d read. Waits may come out of issue order (a DHelix reader
            waits for its own comm, not for the ones issued before it), so `done` is a
            low-water mark, never just the latest read: a peer reuses slot s % K only
            once every rank has read s.
A rank with K collectives of its own still open completes the oldest before issuing, so
no rank can wait for a slot that only its own unfinished read keeps busy. And at each
issue a rank first reads every open collective all members have posted (`EAGER`), so a
peer's issue K collectives later does not wait for this rank's reader to run (an output
written before its wait is legal: NCCL writes it whenever the transfer ends). On x86 a
store is not reordered with an earlier store, nor a load with an earlier load, so
publishing a counter after the data copy is enough.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from multiprocessing import shared_memory
from typing import Dict, List, Optional

import numpy as np
import torch

from dhelix.links import clock

HEADER = 64                       # bytes: int64 posted, int64 done, int64 ready, padding
READY = 0x6468656c6978            # "dhelix": the owner has initialised the counters
SLOTS = 4
# read a collective as soon as every member has posted it (at this rank's next issue),
# not only at its wait: False reads at the wait alone (for measuring what it buys)
EAGER = True
SLOT_BYTES = int(float(os.environ.get("DHELIX_SHM_SLOT_MB", "4")) * 2**20)
TIMEOUT_S = float(os.environ.get("DHELIX_SHM_TIMEOUT_S", "300"))


class ShmTimeout(RuntimeError):
    pass


# seconds this process waited at issue for a free slot (its own oldest read, which
# needs a peer's data, or a peer's read of an older collective): time the link model
# does not price (statistics for the trainer's report; the wait for a peer's data at a
# wait is timed by the paced link, which knows the modelled end)
PEER_WAIT = {"slot_s": 0.0}


def _poll(cond, what: str) -> None:
    """Wait for `cond()` without holding a core (`clock.poll`), or fail after TIMEOUT_S."""
    if cond():
        return

    def timeout():
        raise ShmTimeout(f"paced link: {what} not within {TIMEOUT_S:.0f}s (a peer rank "
                         f"died or issues collectives in another order)")
    clock.poll(cond, time.monotonic() + TIMEOUT_S, timeout)


class _Segment:
    def __init__(self, name: str, create: bool):
        size = HEADER + SLOTS * SLOT_BYTES
        if create:
            try:                       # a leftover of a killed run with the same port
                shared_memory.SharedMemory(name=name).unlink()
            except FileNotFoundError:
                pass
            except ValueError:         # ... killed before it sized it: an empty file
                os.remove(f"/dev/shm/{name}")
            self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
            try:     # the owner unlinks it; Python's tracker would warn of a "leak"
                from multiprocessing import resource_tracker
                resource_tracker.unregister(self.shm._name, "shared_memory")
            except Exception:
                pass
        self.ctr = np.ndarray((3,), dtype=np.int64, buffer=self.shm.buf[:24])
        if create:
            self.ctr[:2] = -1
            self.ctr[2] = READY           # after the counters: a new segment reads 0 here
        self.data = torch.frombuffer(self.shm.buf, dtype=torch.uint8, offset=HEADER,
                                     count=SLOTS * SLOT_BYTES)
        self._views: Dict[tuple, torch.Tensor] = {}

    def slot(self, s: int, nbytes: int) -> torch.Tensor:
        # the views are cached: a layer's collectives reuse a handful of sizes, and
        # slicing a tensor costs as much as copying a small message
        key = (s % SLOTS, nbytes)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= 256:          # sizes without end: keep it bounded
                self._views.clear()
            k = key[0] * SLOT_BYTES
            v = self._views[key] = self.data[k:k + nbytes]
        return v


class ShmGroup:
    """The shared-memory side of one process group, on one rank."""

    def __init__(self, tag: str, ranks: List[int], me: int):
        self.n, self.i = len(ranks), me
        self.names = [f"dhx-{tag}-{r}" for r in ranks]
        self.own = _Segment(self.names[me], create=True)
        atexit.register(self._unlink)
        self.peers: Dict[int, _Segment] = {}
        self.seq = -1                    # last issued
        self.open: Dict[int, "ShmWork"] = {}
        self.read_upto = -1              # every collective <= this one read (`done`)
        self.read_above: set = set()     # read out of order, above read_upto
        # a collective may be read by its own wait or early, by another thread's issue
        # (strict lanes issue on their lane's thread): reads and `open` under this lock
        self.lock = threading.Lock()

    def _unlink(self):
        try:
            self.own.shm.unlink()
        except FileNotFoundError:
            pass

    def seg(self, j: int) -> _Segment:
        if j == self.i:
            return self.own
        if j not in self.peers:
            def attached():
                try:
                    seg = _Segment(self.names[j], create=False)
                except (FileNotFoundError, ValueError):
                    # not created yet, or created and not yet sized ("cannot mmap an
                    # empty file": the owner is between shm_open and ftruncate)
                    return False
                if int(seg.ctr[2]) != READY:      # created, counters not yet set
                    return False
                self.peers[j] = seg
                return True
            _poll(attached, f"rank {j}'s segment {self.names[j]}")
        return self.peers[j]

    @staticmethod
    def fits(nbytes: int) -> bool:
        return nbytes <= SLOT_BYTES

    def issue(self, data, finish) -> "ShmWork":
        """Post `data` (a contiguous tensor, or a list of them, one after the other) as
        the next collective; `finish(slots)` runs at wait."""
        s = self.seq + 1
        if EAGER:
            self.read_ready()
        with self.lock:
            oldest = [self.open[k] for k in sorted(self.open) if k <= s - SLOTS]
        segs = [self.seg(j) for j in range(self.n)]

        def free():
            return min(int(g.ctr[1]) for g in segs) >= s - SLOTS
        if oldest or not free():
            t0 = time.perf_counter()
            for w in oldest:
                w.wait_data()                    # our own oldest read frees the slot
            _poll(free, f"slot {s % SLOTS} free for collective {s}")
            PEER_WAIT["slot_s"] += time.perf_counter() - t0
        flats = [t.reshape(-1).view(torch.uint8) for t in
                 (data if isinstance(data, (list, tuple)) else (data,))]
        nbytes = sum(f.numel() for f in flats)
        dst = self.own.slot(s, nbytes)
        if len(flats) == 1:
            dst.copy_(flats[0])
        else:
            at = 0
            for f in flats:
                dst[at:at + f.numel()].copy_(f)
                at += f.numel()
        self.own.ctr[0] = s                      # posted: after the data
        self.seq = s
        w = ShmWork(self, s, nbytes, finish)
        with self.lock:
            self.open[s] = w
        return w

    def read_ready(self) -> None:
        """Read every open collective whose data all members have posted, without
        waiting, so that the peers may reuse its slots (a peer's issue otherwise waits
        until this rank's reader runs, or this rank's own issue K collectives later).
        Legal by NCCL's rules: a collective's output is undefined until its wait, and
        NCCL writes it whenever the transfer ends."""
        if not self.open:
            return
        posted = min(int(self.seg(j).ctr[0]) for j in range(self.n))
        with self.lock:
            ready = [self.open[k] for k in sorted(self.open) if k <= posted]
        for w in ready:
            w.read()


class ShmWork:
    def __init__(self, group: ShmGroup, s: int, nbytes: int, finish):
        self.group, self.s, self.nbytes, self.finish = group, s, nbytes, finish
        self.done = False

    def wait_data(self) -> None:
        if self.done:
            return
        g = self.group
        segs = [g.seg(j) for j in range(g.n)]
        s = self.s

        def posted():
            for x in segs:
                if x.ctr[0] < s:
                    return False
            return True
        if not posted():
            _poll(posted, f"every rank's data of collective {s}")
        self.read()

    def read(self) -> None:
        """Gather or sum the members' posted data into the output (once); publish
        `done`."""
        g = self.group
        with g.lock:
            if self.done:
                return
            self.finish([g.seg(j).slot(self.s, self.nbytes) for j in range(g.n)])
            g.read_above.add(self.s)
            while g.read_upto + 1 in g.read_above:
                g.read_upto += 1
                g.read_above.discard(g.read_upto)
            g.own.ctr[1] = g.read_upto                   # done: after the reads
            g.open.pop(self.s, None)
            self.done = True

    # the Work interface PacedWork delegates to
    def wait(self, timeout=None):
        self.wait_data()
        return True

    def is_completed(self):
        return self.done

    def is_success(self):
        return True

    def exception(self):
        return None


# ---- the collectives, as (input to post, finish) pairs ------------------------------------

def _sum_into(out: torch.Tensor, parts: List[torch.Tensor]) -> None:
    """out = parts[0] + parts[1] + ..., added left to right (every rank the same sum,
    bit for bit), written straight into `out` when it is contiguous (no temporary, one
    pass over the memory for two ranks), else through one contiguous temporary."""
    dst = out.view(-1) if out.is_contiguous() else torch.empty_like(parts[0])
    if len(parts) == 1:
        dst.copy_(parts[0])
    else:
        torch.add(parts[0], parts[1], out=dst)
    for t in parts[2:]:
        dst += t
    if not out.is_contiguous():
        out.copy_(dst.view(out.shape))


def all_gather(group: ShmGroup, out: torch.Tensor, inp: torch.Tensor) -> ShmWork:
    inp = inp.contiguous()

    def finish(slots):
        parts = out.view(group.n, -1)
        for j, sl in enumerate(slots):
            parts[j].copy_(sl.view(inp.dtype))
    return group.issue(inp, finish)


def reduce_scatter(group: ShmGroup, out: torch.Tensor, inp: torch.Tensor) -> ShmWork:
    """Each rank posts only the chunks its peers sum (its own stays in `inp`, which the
    caller keeps unchanged until the wait, as NCCL requires): a (n−1)/n copy in."""
    n, me = group.n, group.i
    chunks = inp.contiguous().view(n, -1)
    posted = [c for c in (chunks[:me], chunks[me + 1:]) if c.numel()]

    def finish(slots):
        # from rank r's slot the chunk for `me`: its chunks skip r's own
        parts = [chunks[me] if r == me else
                 sl.view(chunks.dtype).view(n - 1, -1)[me if me < r else me - 1]
                 for r, sl in enumerate(slots)]
        _sum_into(out, parts)
    return group.issue(posted, finish)


def all_reduce(group: ShmGroup, tensor: torch.Tensor) -> ShmWork:
    src = tensor.contiguous()

    def finish(slots):
        _sum_into(tensor, [sl.view(tensor.dtype) for sl in slots])
    return group.issue(src, finish)


def remove_segments(port) -> None:
    """Remove the segments of the job on MASTER_PORT `port` (the spawner calls this
    after its ranks end, also when one was killed and could not clean up)."""
    import glob
    for path in glob.glob(f"/dev/shm/dhx-{port}-*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def shm_group_for(pg, cache: Dict[int, Optional[ShmGroup]]) -> Optional[ShmGroup]:
    """The shared-memory side of `pg` on this rank (None: ranks on several machines)."""
    import torch.distributed as dist
    k = id(pg)
    if k not in cache:
        ranks = dist.get_process_group_ranks(pg)
        tag = f"{os.environ.get('MASTER_PORT', '0')}-{pg.group_name}"
        same_host = os.environ.get("DHELIX_SHM", "1") == "1" and \
            int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) >= max(ranks) + 1
        cache[k] = ShmGroup(tag, ranks, ranks.index(dist.get_rank())) if same_host else None
    return cache[k]
