"""The lane executor: run the steps of a plan for two strands (DESIGN §1.2).

A step holds at most one segment of each strand. Both are issued, interleaved: a strand
runs until it has launched a comm op (whose result its next op will wait for), then the
other strand runs; when both are issued, the step's barrier waits for every comm in
flight. The executor does not care which way a strand runs: α's forward with β's
backward (`run_layer_step`), or the two batch halves of one node (`run_tiles`, the
intra-batch peer).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from dhelix.planner.opspec import COMM
from dhelix.planner.plan import Plan, comm_runs
from dhelix.strand.program import LayerProgram, Op
from dhelix.strand.state import StrandState
from dhelix.strand.trace import TraceEvent, Tracer  # noqa: F401  (imported from here)


Segment = Tuple[StrandState, Sequence[Op]]


def execute_step(a: Optional[Segment], b: Optional[Segment],
                 tracer: Optional[Tracer] = None) -> None:
    """Issue two segments interleaved, then wait for all their comms (the barrier)."""
    queues = [(seg[0], list(seg[1])) for seg in (a, b) if seg is not None and seg[1]]
    # start with the strand whose first comm comes earliest, to launch comm early
    queues.sort(key=lambda q: next((i for i, o in enumerate(q[1]) if o.spec.kind == COMM),
                                   len(q[1])))
    pos = [0] * len(queues)
    cur = 0
    issued_comm = []
    with torch.no_grad():
        while any(pos[i] < len(q[1]) for i, q in enumerate(queues)):
            if pos[cur] >= len(queues[cur][1]):
                cur = 1 - cur
                continue
            S, ops = queues[cur]
            op = ops[pos[cur]]
            pos[cur] += 1
            mark = tracer.begin(S) if tracer is not None else None
            op.run(S)
            if op.spec.kind == COMM:
                issued_comm.append((S, op, mark, S.pending[-1] if S.pending else None))
                if len(queues) == 2:
                    cur = 1 - cur
            elif tracer is not None:     # timed from when the comm results it read arrived
                tracer.compute(S, op, mark)
        # barrier
        for S, op, mark, p in issued_comm:
            if p is not None:
                S.lanes.resolve(p)
            if tracer is not None:
                tracer.comm(S, op, mark, p)
        for S, _ in queues:
            S.barrier()
    if tracer is not None:
        tracer.step += 1


def run_layer_step(plan: Plan,
                   fwd: Optional[Tuple[LayerProgram, StrandState]] = None,
                   bwd: Optional[Tuple[LayerProgram, StrandState]] = None,
                   tracer: Optional[Tracer] = None) -> None:
    """One layer step: α's forward ops of one layer and β's backward ops of one layer
    (the same layer or another of the same shape), in the order the plan gives."""
    for step in plan.steps:
        a = (fwd[1], [fwd[0].fwd[n] for n in step.fwd]) if fwd and step.fwd else None
        b = (bwd[1], [bwd[0].bwd[n] for n in step.bwd]) if bwd and step.bwd else None
        if a or b:
            execute_step(a, b, tracer)


def run_tiles(program: LayerProgram, states: Sequence[StrandState], kind: str,
              tracer: Optional[Tracer] = None) -> None:
    """The two batch halves of one layer's forward (kind "fwd") or backward ("bwd"),
    round-robin: half a's k-th segment beside half b's (k-1)-th, so that one half's comm
    runs beside the other half's compute (the intra-batch peer)."""
    chain, by = (program.forward_ops, program.fwd) if kind == "fwd" else \
        (program.backward_ops, program.bwd)
    segs = [[by[n] for n in seg] for seg in comm_runs([o.spec for o in chain])]
    if len(states) == 1:
        for seg in segs:
            execute_step((states[0], seg), None, tracer)
        return
    a, b = states
    for k in range(len(segs) + 1):
        execute_step((a, segs[k]) if k < len(segs) else None,
                     (b, segs[k - 1]) if k >= 1 else None, tracer)
