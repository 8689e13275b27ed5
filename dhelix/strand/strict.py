"""Strict lanes: gloo run by the rules of CUDA streams and NCCL (DESIGN §4), so that the
bugs only a GPU would show fail on CPU. Selected by DHELIX_LANES=strict.

The rules kept:
  - A lane is a stream: a worker thread runs its ops one after another in issue order,
    asynchronously to the thread that issued them. It only moves data (no autograd).
  - A comm reads its inputs when its lane runs it, which may be as late as the moment it
    is waited for. So from issue until then every input must stay alive (the lane keeps
    what it was given, as `record_stream` does on CUDA; nothing else may be relied on)
    and unchanged (the tensor's version counter and storage size); otherwise the op
    fails, naming itself and the input.
  - NCCL matches point-to-point messages between two ranks in posting order, never by
    tag: the k-th send from a to b meets b's k-th receive from a. A send holds its lane
    until the peer's matching receive runs; a receive until the data is there; an op
    that waits holds every later op of its lane. Posting orders that differ are an
    error naming both messages; a wait that does not end is reported by the watchdog
    within DHELIX_STRICT_TIMEOUT seconds (default 30), naming the lane, the op it waits
    in and the peer.
"""
from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from dhelix.strand.lane_api import Lanes, Pending


class StrictLaneError(RuntimeError):
    """A comm op broke a rule of CUDA streams or NCCL."""


class LaneDeadlock(StrictLaneError):
    """A lane waited longer than the watchdog allows."""


class LaneWorker(threading.Thread):
    """The thread that plays one lane's stream (the node schedule's one-thread rule
    counts every other thread)."""

    def __init__(self, lanes: "StrictLanes", lane: str):
        super().__init__(name=f"dhelix-lane-{lane}", daemon=True)
        self.lanes, self.lane = lanes, lane
        self.q: "queue.Queue[_Op]" = queue.Queue()
        self.current: Optional[_Op] = None
        self.since = 0.0
        self.waiting_for = ""           # what the current op waits for (watchdog)
        self.error: Optional[BaseException] = None

    def run(self):
        while True:
            op = self.q.get()
            self.current, self.since, self.waiting_for = op, time.perf_counter(), ""
            try:
                if self.error is None:          # a failed lane runs nothing more
                    op.check("when its lane ran it")
                    op.run(self)
            except BaseException as e:          # reported to the host at its next wait
                self.error = self.error or e
                op.error = e
            finally:
                op.t_done = time.perf_counter()
                self.current = None
                op.finished.set()


class _Input:
    """What a comm op reads, as issued: a weak reference to its storage, the storage's
    size and the tensor's version. The op holds it strongly only if the lane keeps it."""

    def __init__(self, t: torch.Tensor, index: int):
        st = t.untyped_storage()
        self.ref = weakref.ref(st)
        self.nbytes, self.version, self.index = st.nbytes(), t._version, index
        self.shape, self.tensor = tuple(t.shape), weakref.ref(t)

    def broken(self) -> str:
        st, t = self.ref(), self.tensor()
        if st is None or st.nbytes() != self.nbytes:
            return "was freed"
        if t is None:
            return "was let go by the caller, and the lane kept no reference to it"
        if t._version != self.version:
            return f"was modified in place (version {self.version} -> {t._version})"
        return ""


class _Op:
    def __init__(self, name: str, lane: str, inputs, keep: bool, run, peer_text: str = ""):
        self.name, self.lane, self.peer_text = name, lane, peer_text
        self.inputs = [_Input(t, i) for i, t in enumerate(inputs)]
        self.keep = tuple(inputs) if keep else ()
        self._run = run
        self.finished = threading.Event()
        self.error: Optional[BaseException] = None
        self.t_done: Optional[float] = None

    def check(self, when: str):
        for i in self.inputs:
            why = i.broken()
            if why:
                raise StrictLaneError(
                    f"{self.name} ({self.lane} lane): its input {i.index} {list(i.shape)} "
                    f"{why} before the comm was waited for ({when}); on CUDA the lane "
                    f"stream may read it that late: the lane must keep its inputs alive "
                    f"and the caller must not write them until the comm is waited for")

    def run(self, worker: LaneWorker):
        xs = [i.tensor() for i in self.inputs]
        self._run(worker, *xs)

    def describe(self) -> str:
        return f"{self.name}" + (f" ({self.peer_text})" if self.peer_text else "")


_INSTANCES: "weakref.WeakSet[StrictLanes]" = weakref.WeakSet()   # what the guard asks
_GUARDED = False


def _guard_collectives() -> None:
    """On NCCL a collective on the compute stream and a lane's collective on the same
    communicator may run in either order, and in different orders on different ranks:
    a collective issued outside the lanes (megatron's own, inside an op) while a lane
    collective on its group is not yet waited for is an error naming both."""
    global _GUARDED
    if _GUARDED:
        return
    _GUARDED = True
    from dhelix.links.paced import METHODS, _PG

    def wrap(orig, name):
        def method(self, *a, **k):
            # lane threads (workers and their P2P helpers) are named dhelix-lane-*
            names = "" if threading.current_thread().name.startswith("dhelix-lane-") else \
                ", ".join(sorted({p.op for lanes in list(_INSTANCES)
                                  for p in list(lanes._in_flight.get(id(self), {}).values())}))
            if names:
                raise StrictLaneError(
                    f"a {name} on a process group whose lane still has {names} in flight: "
                    f"on NCCL the two may run in either order, and in different orders on "
                    f"different ranks; wait for the lane first (Lanes.quiesce(group))")
            return orig(self, *a, **k)
        method.__name__ = getattr(orig, "__name__", name)
        return method
    for name in METHODS:
        orig = getattr(_PG, name, None)
        if orig is not None:
            setattr(_PG, name, wrap(orig, name))


class StrictLanes(Lanes):
    name = "strict"

    def __init__(self, keep_inputs: bool = True, timeout_s: Optional[float] = None):
        super().__init__()
        # keep_inputs=False reproduces a lane that forgets its inputs (the old CudaLanes):
        # for the tests that show the check can fail
        self.keep_inputs = keep_inputs
        self.timeout_s = float(timeout_s if timeout_s is not None else
                               os.environ.get("DHELIX_STRICT_TIMEOUT", "30"))
        self.workers: Dict[str, LaneWorker] = {}
        self._posted: Dict[Tuple[int, int, str], int] = {}   # (group, peer, dir) -> count
        _guard_collectives()
        _INSTANCES.add(self)

    # ---- issue ---------------------------------------------------------------------------
    def _worker(self, lane: str) -> LaneWorker:
        w = self.workers.get(lane)
        if w is None:
            w = self.workers[lane] = LaneWorker(self, lane)
            w.start()
        return w

    def _submit(self, op: _Op, out, group) -> Pending:
        w = self._worker(op.lane)
        if w.error is not None:
            raise StrictLaneError(f"{op.name}: the {op.lane} lane failed earlier") from w.error
        for t in op.keep:
            if t.requires_grad:
                raise StrictLaneError(f"{op.name}: an input of a comm op requires grad; a "
                                      f"lane only moves data and never touches autograd")
        w.q.put(op)
        return self._track(Pending(op.name, out, op, keep=op.keep), group)

    def _launch(self, op, lane, out, inputs, fn, group):
        def run(worker, *xs):
            h = fn(*xs)
            if h is not None:
                h.wait()
        ranks = dist.get_process_group_ranks(group) if group is not None else []
        return self._submit(_Op(op, lane, inputs, self.keep_inputs, run,
                                peer_text=f"group of ranks {ranks}"), out, group)

    def _launch_p2p(self, op, lane, sends, recvs, group, outs):
        """Each message gets its place in the pair's posting order now, at issue (NCCL's
        order is the lane stream's, which is the issue order)."""
        gid = id(group)
        me = dist.get_rank()

        def seq(peer, direction):
            key = (gid, peer, direction)
            k = self._posted.get(key, 0)
            self._posted[key] = k + 1
            return k
        plan_s = [(peer, tag, seq(peer, "send")) for _, peer, tag in sends]
        plan_r = [(buf, peer, tag, seq(peer, "recv")) for buf, peer, tag in recvs]
        peers = sorted({p for p, _, _ in plan_s} | {p for _, p, _, _ in plan_r})
        text = ", ".join([f"send #{k} to rank {p}" for p, _, k in plan_s] +
                         [f"recv #{k} from rank {p}" for _, p, _, k in plan_r])

        def run(worker, *xs):
            _rendezvous(worker, op, me, group, list(zip(xs, plan_s)), plan_r)
        o = _Op(op, lane, tuple(x for x, _, _ in sends), self.keep_inputs, run,
                peer_text=text or f"peers {peers}")
        return self._submit(o, outs, group)

    # ---- wait ----------------------------------------------------------------------------
    def resolve(self, p: Pending):
        if p.done:
            return p.out
        op: _Op = p.handle
        t0 = time.perf_counter()
        while not op.finished.wait(0.05):
            if time.perf_counter() - t0 > self.timeout_s:
                raise LaneDeadlock(self._report(op, time.perf_counter() - t0))
        if op.error is not None:
            raise StrictLaneError(f"{op.name} failed on its lane: {op.error}") from op.error
        op.check("when it was waited for")
        self._untrack(p)
        p.done, p.keep = True, ()
        p.t_done = op.t_done
        op.keep = ()
        return p.out

    def _report(self, waited: _Op, seconds: float) -> str:
        rank = dist.get_rank() if dist.is_initialized() else 0
        lines = [f"rank {rank}: waited {seconds:.1f}s for {waited.describe()} on the "
                 f"{waited.lane} lane (watchdog, DHELIX_STRICT_TIMEOUT={self.timeout_s:g}s); "
                 f"a deadlock:"]
        for lane, w in sorted(self.workers.items()):
            cur = w.current
            if cur is None:
                lines.append(f"  {lane} lane: idle")
                continue
            lines.append(f"  {lane} lane: waits in {cur.describe()} for "
                         f"{time.perf_counter() - w.since:.1f}s"
                         + (f" ({w.waiting_for})" if w.waiting_for else ""))
            later = [o.describe() for o in list(w.q.queue)]
            if later:
                lines.append(f"    held behind it: {'; '.join(later[:6])}"
                             + (" ..." if len(later) > 6 else ""))
        return "\n".join(lines)


# ---- NCCL's point-to-point matching, played over gloo ---------------------------------------
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
           torch.int64: 5, torch.int32: 6, torch.uint8: 7, torch.bool: 8}
_BASE = 1 << 20          # strict tags stay clear of small tags other code may use


def _data_tag(k: int) -> int:
    return _BASE + 2 * k


def _ready_tag(k: int) -> int:
    return _BASE + 2 * k + 1


def _header(t: torch.Tensor, tag: int) -> torch.Tensor:
    # on the host: strict lanes are gloo only (make_lanes refuses them on CUDA)
    return torch.tensor([tag, t.numel(), _DTYPES.get(t.dtype, 0)], dtype=torch.int64)


def _rendezvous(worker: LaneWorker, op: str, me: int, group, sends, recvs):
    """One batch: every receive tells its sender it is there (with what it expects), every
    send waits for that before moving its data; all progress together, as a group call.
    Tags are the pair's posting order, so gloo matches what NCCL would."""
    works = []
    for buf, peer, tag, k in recvs:
        works.append(dist.isend(_header(buf, tag), dst=peer, group=group, tag=_ready_tag(k)))
        works.append(dist.irecv(buf, src=peer, group=group, tag=_data_tag(k)))
    by_peer: Dict[int, list] = {}
    for x, (peer, tag, k) in sends:
        by_peer.setdefault(peer, []).append((x, tag, k))
    worker.waiting_for = "the peer's matching receive"
    errors: List[BaseException] = []

    def send_to(peer, items):
        # to one peer in posting order; each waits for the peer's receive to be there
        try:
            for x, tag, k in items:
                hdr = torch.empty(3, dtype=torch.int64)
                dist.irecv(hdr, src=peer, group=group, tag=_ready_tag(k)).wait()
                if not torch.equal(hdr, _header(x, tag)):
                    raise StrictLaneError(
                        f"{op}: rank {me}'s send #{k} to rank {peer} (tag {tag}, "
                        f"{x.numel()} elements) meets rank {peer}'s receive #{k} from rank "
                        f"{me} (tag {int(hdr[0])}, {int(hdr[1])} elements): NCCL matches "
                        f"point-to-point messages in posting order, not by tag, so both "
                        f"ranks must post them in the same order")
                works.append(dist.isend(x, dst=peer, group=group, tag=_data_tag(k)))
        except BaseException as e:
            errors.append(e)
    if len(by_peer) == 1:
        send_to(*next(iter(by_peer.items())))
    else:       # different peers progress independently, as in a group call
        ts = [threading.Thread(target=send_to, args=kv, name=f"dhelix-lane-{worker.lane}-p2p",
                               daemon=True) for kv in by_peer.items()]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    if errors:
        raise errors[0]
    worker.waiting_for = "the peer's data or its taking of ours"
    for w in works:
        w.wait()
