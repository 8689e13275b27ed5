"""The lane interface (DESIGN §1.1): where ops run, and how a step's barrier waits.

Ops run on three lanes: `compute`, `intra` (collectives inside a node) and `inter`
(collectives across nodes). A comm op returns a `Pending` at once; reading it later
(`resolve`) makes the reader wait for it; `barrier` waits for all of a step's pendings.
Two backends share this interface:
  - CpuLanes: compute runs in the calling thread; a comm is an async gloo work.
  - CudaLanes: compute on the current stream; one stream per comm lane, events between.
Everything CUDA- or gloo-specific in DHelix lives here.
"""
from __future__ import annotations

import abc
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from dhelix.base.nodes import node_ids


class Pending:
    """The future result of a comm op."""
    __slots__ = ("op", "out", "handle", "done", "t_done", "keep")

    def __init__(self, op: str, out: torch.Tensor, handle):
        self.op, self.out, self.handle, self.done = op, out, handle, False
        self.keep = None     # a tensor being sent: alive until the comm is waited for
        self.t_done = None   # when a reader first had the result (host clock), for traces


class _AllWorks:
    """Several works waited as one (a ring step's send and receive)."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True


def lane_of_group(group) -> str:
    """'intra' if every rank of the group sits on one node, else 'inter'."""
    ranks = dist.get_process_group_ranks(group)
    ids = node_ids(dist.get_world_size())
    return "intra" if len({ids[r] for r in ranks}) == 1 else "inter"


class Lanes(abc.ABC):
    """Backend-neutral part: the collectives DHelix ops use."""

    def all_gather(self, op: str, x: torch.Tensor, group, lane: str) -> Pending:
        n = dist.get_world_size(group)
        out = x.new_empty((x.shape[0] * n,) + tuple(x.shape[1:]))
        return self._launch(op, lane, out, lambda: dist.all_gather_into_tensor(
            out, x.contiguous(), group=group, async_op=self.async_op))

    def reduce_scatter(self, op: str, x: torch.Tensor, group, lane: str) -> Pending:
        n = dist.get_world_size(group)
        out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
        return self._launch(op, lane, out, lambda: dist.reduce_scatter_tensor(
            out, x.contiguous(), group=group, async_op=self.async_op))

    def all_reduce(self, op: str, x: torch.Tensor, group, lane: str) -> Pending:
        out = x.contiguous().clone() if not x.is_contiguous() else x
        return self._launch(op, lane, out, lambda: dist.all_reduce(
            out, group=group, async_op=self.async_op))

    def all_to_all(self, op: str, x: torch.Tensor, out_splits, in_splits, group,
                   lane: str) -> Pending:
        """Rows of `x` in `in_splits` go to the group's ranks; `out_splits` rows come back
        (the MoE token exchange)."""
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        x = x.contiguous()
        return self._launch(op, lane, out, lambda: dist.all_to_all_single(
            out, x, list(out_splits), list(in_splits), group=group, async_op=self.async_op))

    def send(self, op: str, x: torch.Tensor, peer: int, group, lane: str,
             tag: int = 0) -> Pending:
        """Point-to-point send to global rank `peer` (pipeline traffic)."""
        x = x.contiguous()
        fn = dist.isend if self.async_op else dist.send
        return self._launch(op, lane, x, lambda: fn(x, dst=peer, group=group, tag=tag))

    def recv(self, op: str, out: torch.Tensor, peer: int, group, lane: str,
             tag: int = 0) -> Pending:
        """Point-to-point receive into `out` from global rank `peer`."""
        fn = dist.irecv if self.async_op else dist.recv
        return self._launch(op, lane, out, lambda: fn(out, src=peer, group=group, tag=tag))

    def ring_exchange(self, op: str, x: torch.Tensor, to: int, frm: int, group,
                      lane: str) -> Pending:
        """Send `x` to global rank `to` while receiving a tensor like it from `frm`: one
        ring step. Both go in one batch (NCCL's group call), so a ring of blocking sends
        cannot deadlock."""
        x = x.contiguous()
        out = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, to, group), dist.P2POp(dist.irecv, out, frm, group)]
        p = self._launch(op, lane, out, lambda: _AllWorks(dist.batch_isend_irecv(ops)))
        p.keep = x
        return p

    # backend hooks
    async_op = True

    @abc.abstractmethod
    def _launch(self, op, lane, out, fn) -> Pending:
        """Start the collective `fn` on `lane`; return its Pending."""

    @abc.abstractmethod
    def resolve(self, p: Pending) -> torch.Tensor:
        """Make the caller wait for `p`; return its result."""

    def barrier(self, pendings: List[Pending]) -> None:
        for p in pendings:
            self.resolve(p)


class CpuLanes(Lanes):
    """gloo: a comm is an async work running on gloo's own threads."""
    name = "cpu"

    def _launch(self, op, lane, out, fn):
        return Pending(op, out, fn())

    def resolve(self, p):
        if not p.done:
            p.handle.wait()
            p.done = True
            p.t_done = time.perf_counter()
        return p.out


class CudaLanes(Lanes):
    """NCCL: compute on the current stream, each comm lane on a stream of its own."""
    name = "cuda"
    async_op = False   # the collective is enqueued on the lane stream; events order it

    def __init__(self):
        self.streams: Dict[str, torch.cuda.Stream] = {}

    def _stream(self, lane):
        if lane not in self.streams:
            self.streams[lane] = torch.cuda.Stream(priority=-1)
        return self.streams[lane]

    def _launch(self, op, lane, out, fn):
        compute = torch.cuda.current_stream()
        s = self._stream(lane)
        s.wait_stream(compute)          # the input was produced on the compute stream
        with torch.cuda.stream(s):
            h = fn()
            if isinstance(h, _AllWorks):
                h.wait()        # NCCL: makes the lane stream wait, not the host
            ev = torch.cuda.Event()
            ev.record(s)
        out.record_stream(s)
        return Pending(op, out, ev)

    def resolve(self, p):
        if not p.done:
            torch.cuda.current_stream().wait_event(p.handle)
            p.done = True
            p.t_done = time.perf_counter()   # host time of the wait, not of the kernel
        return p.out


def make_lanes(device: Optional[torch.device] = None) -> Lanes:
    if device is not None and device.type == "cuda":
        return CudaLanes()
    return CpuLanes()
