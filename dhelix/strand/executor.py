"""The lane executor: run the steps of a plan for two strands (DESIGN §1.2).

A step holds at most one segment of each strand. Both are issued, interleaved: a strand
runs until it has launched a comm op (whose result its next op will wait for), then the
other strand runs. A segment may hold several comm ops, of one group or several: they are
issued in this one order on every rank, the lane runs them first-in first-out, and each
result is waited for by the op that reads it. The steps of a layer step run back to back:
a comm still in flight when its step's ops are issued is waited for by its reader only,
in a later step, and one barrier at the end of the layer step waits for what no op read
(the simulator's `Carry`). A step run alone (`execute_step`) ends at its own barrier.

A strand is one state, or the batch tiles of one node (`LayerNode(tiles=2)`): each op
then runs on every tile in turn. The executor does not care which way a strand runs:
α's forward with β's backward (`run_layer_step`), or the two batch halves of one node
round-robin (`run_tiles`, the intra-batch peer and DHelix's steps without a partner).

A (plan, program) pair is bound once into per-step op lists (`_bound`): a step costs a
few list operations beyond its ops, with no name lookups and no tracing branch per op
unless a tracer is given.
"""
from __future__ import annotations

import os
import weakref
from typing import List, Optional, Sequence, Tuple, Union

import torch

from dhelix.planner.opspec import COMM
from dhelix.planner.plan import Plan, comm_runs
from dhelix.strand.program import LayerProgram, Op
from dhelix.strand.state import StrandState
from dhelix.strand.trace import TraceEvent, Tracer  # noqa: F401  (imported from here)

# paced compute (`train/emulate.py`): runs each compute op and waits out the emulated
# op's duration; None (the rule) costs one test per op
PACE = None

# DHELIX_STEP_BARRIERS=1: a barrier after every step of a layer step, as before steps ran
# back to back (same values; for measuring what running them back to back gains)
STEP_BARRIERS = os.environ.get("DHELIX_STEP_BARRIERS", "0") == "1"

States = Union[StrandState, Sequence[StrandState]]
Segment = Tuple[States, Sequence[Op]]          # a strand's state(s) and its ops in a step
Item = Tuple[StrandState, Op]


def _items(seg: Optional[Segment]) -> List[Item]:
    """A segment in issue order: op by op, each on every tile of the strand."""
    if seg is None or not seg[1]:
        return []
    states, ops = seg
    if isinstance(states, StrandState):
        return [(states, op) for op in ops]
    return [(S, op) for op in ops for S in states]


def _first_comm(items: List[Item]) -> int:
    for i, (_, op) in enumerate(items):
        if op.spec.kind == COMM:
            return i
    return len(items)


def execute_step(a: Optional[Segment], b: Optional[Segment],
                 tracer: Optional[Tracer] = None, barrier: bool = True) -> list:
    """Issue two segments interleaved, then wait for all their comms (the barrier); with
    `barrier=False` return what was issued, for the caller's barrier."""
    qa, qb = _items(a), _items(b)
    if not qb:
        issued = _run_alone(qa, tracer)
    elif not qa:
        issued = _run_alone(qb, tracer)
    else:
        # start with the strand whose first comm comes earliest, to launch comm early
        qs = [qb, qa] if _first_comm(qb) < _first_comm(qa) else [qa, qb]
        issued = _run_two(qs, tracer)
    if tracer is not None:
        tracer.step += 1
    if not barrier:
        return issued
    _barrier(issued, {id(S): S for S, _ in qa + qb}.values(), tracer)
    return []


def _run_alone(q: List[Item], tracer: Optional[Tracer]) -> list:
    issued = []
    with torch.no_grad():
        for S, op in q:
            mark = tracer.begin(S) if tracer is not None else None
            if PACE is not None and op.spec.kind != COMM:
                PACE.run(op, S)
            else:
                op.run(S)
            if op.spec.kind == COMM:
                issued.append((S, op, mark, S.pending[-1] if S.pending else None,
                               tracer.step if tracer is not None else 0))
                continue
            if tracer is not None:
                tracer.compute(S, op, mark)
    return issued


def _run_two(qs: List[List[Item]], tracer: Optional[Tracer]) -> list:
    pos = [0, 0]
    ends = [len(qs[0]), len(qs[1])]
    cur = 0
    issued = []
    with torch.no_grad():
        while pos[0] < ends[0] or pos[1] < ends[1]:
            if pos[cur] >= ends[cur]:
                cur = 1 - cur
                continue
            S, op = qs[cur][pos[cur]]
            pos[cur] += 1
            mark = tracer.begin(S) if tracer is not None else None
            if PACE is not None and op.spec.kind != COMM:
                PACE.run(op, S)
            else:
                op.run(S)
            if op.spec.kind == COMM:
                issued.append((S, op, mark, S.pending[-1] if S.pending else None,
                               tracer.step if tracer is not None else 0))
                cur = 1 - cur
                continue
            if tracer is not None:     # timed from when the comm results it read arrived
                tracer.compute(S, op, mark)
    return issued


def _barrier(issued, states, tracer: Optional[Tracer]) -> None:
    for S, op, mark, p, step in issued:
        if p is not None:
            S.lanes.resolve(p)
        if tracer is not None:
            tracer.comm(S, op, mark, p, step)
    for S in states:
        S.barrier()


# program -> {id(plan): (plan, forward ops per step, backward ops per step, all forward
# ops, all backward ops)}
_BOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _bound(plan: Plan, program: LayerProgram):
    """The plan's steps as op lists of `program`, made once per (plan, program)."""
    per = _BOUND.get(program)
    if per is None:
        per = _BOUND[program] = {}
    got = per.get(id(plan))
    if got is None or got[0] is not plan:      # the plan is held: its id stays its own
        f = [[program.fwd[n] for n in s.fwd] for s in plan.steps]
        b = [[program.bwd[n] for n in s.bwd] for s in plan.steps]
        got = per[id(plan)] = (plan, f, b, [o for ops in f for o in ops],
                               [o for ops in b for o in ops])
    return got[1:]


def run_layer_step(plan: Plan,
                   fwd: Optional[Tuple[LayerProgram, States]] = None,
                   bwd: Optional[Tuple[LayerProgram, States]] = None,
                   tracer: Optional[Tracer] = None) -> None:
    """One layer step: α's forward ops of one layer and β's backward ops of one layer
    (the same layer or another of the same shape), in the order the plan gives. Each
    strand is one state or its node's tiles. A strand without a partner runs its ops in
    the plan's order as one step: no barrier is needed between its own ops (each comm is
    waited for by its reader), so its comm runs beside its next ops that do not read it
    (a dgrad's reduce-scatter beside the wgrad after it, as in megatron's layer)."""
    if fwd is None or bwd is None:
        if fwd is not None:
            execute_step((fwd[1], _bound(plan, fwd[0])[2]), None, tracer)
        elif bwd is not None:
            execute_step(None, (bwd[1], _bound(plan, bwd[0])[3]), tracer)
        return
    f_ops = _bound(plan, fwd[0])[0]
    b_ops = _bound(plan, bwd[0])[1]
    issued = []
    for k in range(len(plan.steps)):
        a = (fwd[1], f_ops[k]) if f_ops[k] else None
        b = (bwd[1], b_ops[k]) if b_ops[k] else None
        if a or b:
            # no barrier between the plan's steps: a comm is waited for by its reader
            issued += execute_step(a, b, tracer, barrier=STEP_BARRIERS)
    states = [fwd[1]] if isinstance(fwd[1], StrandState) else list(fwd[1])
    states += [bwd[1]] if isinstance(bwd[1], StrandState) else list(bwd[1])
    _barrier(issued, states, tracer)


def run_tiles(program: LayerProgram, states: Sequence[StrandState], kind: str,
              tracer: Optional[Tracer] = None) -> None:
    """The two batch halves of one layer's forward (kind "fwd") or backward ("bwd"),
    round-robin: half a's k-th segment beside half b's (k-1)-th, so that one half's comm
    runs beside the other half's compute (the intra-batch peer); the steps run back to
    back, one barrier at the end."""
    chain, by = (program.forward_ops, program.fwd) if kind == "fwd" else \
        (program.backward_ops, program.bwd)
    segs = [[by[n] for n in seg] for seg in comm_runs([o.spec for o in chain])]
    if len(states) == 1:
        for seg in segs:
            execute_step((states[0], seg), None, tracer)
        return
    a, b = states
    issued = []
    for k in range(len(segs) + 1):        # back to back, as a layer step's plan steps
        issued += execute_step((a, segs[k]) if k < len(segs) else None,
                               (b, segs[k - 1]) if k >= 1 else None, tracer,
                               barrier=STEP_BARRIERS)
    _barrier(issued, [a, b], tracer)
