"""The lane interface (DESIGN §1.1): a comm op's `Pending` and the backend-neutral
`Lanes`, whose backends (`CpuLanes`, `CudaLanes` in lanes.py, `StrictLanes` in strict.py)
start and wait for the collectives; `lanes.py` re-exports these names."""
from __future__ import annotations

import abc
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from dhelix.base.nodes import node_ids

# a point-to-point message: (tensor, global rank of the peer, tag)
Message = Tuple[torch.Tensor, int, int]


class Pending:
    """The future result of a comm op."""
    __slots__ = ("op", "out", "handle", "done", "t_done", "keep", "group", "__weakref__")

    def __init__(self, op: str, out, handle, keep: Tuple[torch.Tensor, ...] = ()):
        self.op, self.out, self.handle, self.done = op, out, handle, False
        self.keep = keep     # the tensors the comm reads: alive until it is waited for
        self.t_done = None   # when a reader first had the result (host clock), for traces
        self.group = 0       # id of its process group (Lanes.quiesce)


class _AllWorks:
    """Several works waited as one (a batch of sends and receives)."""

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
    """Backend-neutral part: the collectives DHelix ops use. Inputs are made contiguous
    here, by the caller (on CUDA: on the compute stream that produced them), and handed
    to the collective as arguments, never captured, so the backend decides their life."""

    def __init__(self):
        self._in_flight: Dict[int, Dict[int, Pending]] = {}   # id(group) -> unresolved

    def all_gather(self, op: str, x: torch.Tensor, group, lane: str) -> Pending:
        n = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((x.shape[0] * n,) + tuple(x.shape[1:]))
        return self._launch(op, lane, out, (x,), lambda x: self._collective(
            "all_gather", out, x, group), group)

    def reduce_scatter(self, op: str, x: torch.Tensor, group, lane: str) -> Pending:
        n = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
        return self._launch(op, lane, out, (x,), lambda x: self._collective(
            "reduce_scatter", out, x, group), group)

    def all_reduce(self, op: str, x: torch.Tensor, group, lane: str) -> Pending:
        """In place on `x` (a contiguous copy if it is not): the caller hands it over."""
        out = x.contiguous().clone() if not x.is_contiguous() else x
        return self._launch(op, lane, out, (), lambda: dist.all_reduce(
            out, group=group, async_op=self.async_op), group)

    def all_to_all(self, op: str, x: torch.Tensor, out_splits, in_splits, group,
                   lane: str) -> Pending:
        """Rows of `x` in `in_splits` go to the group's ranks; `out_splits` rows come back
        (the MoE token exchange)."""
        out_splits, in_splits = [int(v) for v in out_splits], [int(v) for v in in_splits]
        if min(out_splits + in_splits, default=0) < 0:
            raise ValueError(f"{op}: negative all-to-all split sizes {in_splits} -> "
                             f"{out_splits}: read before their device-to-host copy ended?")
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        return self._launch(op, lane, out, (x,), lambda x: dist.all_to_all_single(
            out, x, out_splits, in_splits, group=group, async_op=self.async_op), group)

    def p2p(self, op: str, sends: Sequence[Message], recvs: Sequence[Message], group,
            lane: str) -> Pending:
        """One batch of point-to-point sends and receives (NCCL's group call): they all
        progress together, so two ranks that send to each other in one batch cannot
        deadlock. The Pending's `out` is the list of receive buffers, in `recvs` order."""
        sends = [(x.contiguous(), peer, tag) for x, peer, tag in sends]
        outs = [buf for buf, _, _ in recvs]
        return self._launch_p2p(op, lane, sends, list(recvs), group, outs)

    def send(self, op: str, x: torch.Tensor, peer: int, group, lane: str,
             tag: int = 0) -> Pending:
        """Point-to-point send to global rank `peer` (pipeline traffic)."""
        return self.p2p(op, [(x, peer, tag)], [], group, lane)

    def recv(self, op: str, out: torch.Tensor, peer: int, group, lane: str,
             tag: int = 0) -> Pending:
        """Point-to-point receive into `out` from global rank `peer`."""
        p = self.p2p(op, [], [(out, peer, tag)], group, lane)
        p.out = out
        return p

    def ring_exchange(self, op: str, x: torch.Tensor, to: int, frm: int, group,
                      lane: str) -> Pending:
        """Send `x` to global rank `to` while receiving a tensor like it from `frm`: one
        ring step, as one batch."""
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        p = self.p2p(op, [(x, to, 0)], [(out, frm, 0)], group, lane)
        p.out = out
        return p

    # backend hooks
    async_op = True

    def _collective(self, kind: str, out, x, group):
        """Start the all-gather or reduce-scatter `kind` of `x` into `out`."""
        fn = dist.all_gather_into_tensor if kind == "all_gather" else dist.reduce_scatter_tensor
        return fn(out, x, group=group, async_op=self.async_op)

    @abc.abstractmethod
    def _launch(self, op: str, lane: str, out, inputs: Tuple[torch.Tensor, ...],
                fn: Callable, group) -> Pending:
        """Start the collective `fn(*inputs)` on `lane`; return its Pending."""

    def _launch_p2p(self, op, lane, sends, recvs, group, outs) -> Pending:
        def fn(*xs):
            ops = [dist.P2POp(dist.isend, x, peer, group, tag)
                   for x, (_, peer, tag) in zip(xs, sends)]
            ops += [dist.P2POp(dist.irecv, buf, peer, group, tag) for buf, peer, tag in recvs]
            return _AllWorks(dist.batch_isend_irecv(ops))
        return self._launch(op, lane, outs, tuple(x for x, _, _ in sends), fn, group)

    @abc.abstractmethod
    def resolve(self, p: Pending):
        """Make the caller wait for `p`; return its result."""

    def barrier(self, pendings: List[Pending]) -> None:
        for p in pendings:
            self.resolve(p)

    def quiesce(self, group) -> None:
        """Wait for every comm on `group` not yet waited for, whichever strand issued
        it: before code that issues its own collective on that group (megatron's
        linears inside an op), since on NCCL a compute-stream collective and a lane's
        on one communicator may otherwise run in different orders on different ranks."""
        for p in list(self._in_flight.get(id(group), {}).values()):
            self.resolve(p)

    def _track(self, p: Pending, group) -> Pending:
        """Remember `p` until it is resolved (`quiesce`)."""
        self._in_flight.setdefault(id(group), {})[id(p)] = p
        p.group = id(group)
        return p

    def _untrack(self, p: Pending) -> None:
        self._in_flight.get(p.group, {}).pop(id(p), None)
