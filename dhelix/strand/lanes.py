"""The lane interface (DESIGN §1.1): where ops run, and how a step's barrier waits.

Ops run on three lanes: `compute`, `intra` (collectives inside a node) and `inter`
(collectives across nodes). A comm op returns a `Pending` at once; reading it later
(`resolve`) makes the reader wait for it; `barrier` waits for all of a step's pendings.
A comm op names the tensors it reads (`inputs`): the lane keeps them alive until the op
is waited for, since on CUDA the lane's stream reads them later than the host issued it.
Three backends share this interface (`lane_api.py`: `Pending`, `Lanes`):
  - CpuLanes: compute runs in the calling thread; a comm is an async gloo work.
  - CudaLanes: compute on the current stream; one stream per comm lane, events between.
  - StrictLanes (`strand/strict.py`, DHELIX_LANES=strict): gloo run by CUDA's and NCCL's
    rules, so that the bugs only a GPU would show fail on CPU.
Everything CUDA- or gloo-specific in DHelix lives here and in strict.py.
"""
from __future__ import annotations

import time
from typing import Dict, Optional

import torch

# the interface, re-exported: the rest of DHelix imports it from here
from dhelix.strand.lane_api import Lanes, Message, Pending, _AllWorks, lane_of_group  # noqa: F401


class CpuLanes(Lanes):
    """gloo: a comm is an async work running on gloo's own threads. On the paced link an
    all-gather or reduce-scatter goes to the link directly (`links.paced.direct`: the
    same model and data path without torch.distributed's Python wrapper)."""
    name = "cpu"

    def __init__(self):
        super().__init__()
        self._direct: Dict[tuple, object] = {}      # (id(group), kind) -> fn or None

    def _collective(self, kind, out, x, group):
        from dhelix.links import paced
        k = (id(group), kind)
        fn = self._direct.get(k, False)
        if fn is False:
            fn = self._direct[k] = paced.direct(group, kind)
        if fn is not None and paced.DIRECT:
            return fn(out, x)
        return super()._collective(kind, out, x, group)

    def _launch(self, op, lane, out, inputs, fn, group):
        return self._track(Pending(op, out, fn(*inputs), keep=inputs), group)

    def resolve(self, p):
        if not p.done:
            p.handle.wait()
            self._untrack(p)
            p.done, p.keep = True, ()
            p.t_done = time.perf_counter()
        return p.out


class CudaLanes(Lanes):
    """NCCL: compute on the current stream, each comm lane on a stream of its own."""
    name = "cuda"
    async_op = False   # the collective is enqueued on the lane stream; events order it

    def __init__(self):
        super().__init__()
        self.streams: Dict[str, torch.cuda.Stream] = {}
        # timestamps on the comm events only while a trace reads them (`trace.clock_for`
        # turns it on): an event without timing is cheaper to record and to wait on
        self.timing = False

    def _stream(self, lane):
        if lane not in self.streams:
            self.streams[lane] = torch.cuda.Stream(priority=-1)
        return self.streams[lane]

    def _launch(self, op, lane, out, inputs, fn, group):
        compute = torch.cuda.current_stream()
        s = self._stream(lane)
        s.wait_stream(compute)          # the inputs were produced on the compute stream
        with torch.cuda.stream(s):
            h = fn(*inputs)
            if isinstance(h, _AllWorks):
                h.wait()        # NCCL: makes the lane stream wait, not the host
            ev = torch.cuda.Event(enable_timing=self.timing)
            ev.record(s)
        # The allocator may hand a block freed on the compute stream to the compute
        # stream's next op at once: the lane stream's use of the inputs (NCCL keeps no
        # reference to them since torch 2.8) and of the outputs must be recorded.
        for t in tuple(inputs) + tuple(out if isinstance(out, list) else [out]):
            t.record_stream(s)
        return self._track(Pending(op, out, ev, keep=inputs), group)

    def resolve(self, p):
        if not p.done:
            torch.cuda.current_stream().wait_event(p.handle)
            self._untrack(p)
            p.done, p.keep = True, ()
            p.t_done = time.perf_counter()   # host time of the wait, not of the kernel
        return p.out


def make_lanes(device: Optional[torch.device] = None) -> Lanes:
    """CUDA lanes on a CUDA device; on CPU the gloo lanes, or the strict ones with
    DHELIX_LANES=strict."""
    from dhelix.base.strict import lanes_mode
    mode = lanes_mode()
    if device is not None and device.type == "cuda":
        if mode == "strict":
            raise ValueError("DHELIX_LANES=strict emulates CUDA's rules on CPU; on a CUDA "
                             "device the CUDA lanes run (unset DHELIX_LANES)")
        return CudaLanes()
    if mode == "strict":
        from dhelix.strand.strict import StrictLanes
        return StrictLanes()
    return CpuLanes()
