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

A rotated plan (`Plan.rotation` r > 0) pairs α's layer with the ops of β's node from r
on, then the first r ops of the node below; between them a hand-off op finishes the node
above and begins the one below (its input gradient), so the boundary of the layer step
falls inside β's chain (`schedules/dhelix.py` walks β so).

A (plan, program) pair is bound once into per-step op lists (`_bound`): a step costs a
few list operations beyond its ops, with no name lookups and no tracing branch per op
unless a tracer is given.
"""
from __future__ import annotations

import os
import weakref
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from dhelix.planner.opspec import COMM, COMPUTE, OpSpec
from dhelix.planner.plan import Plan, comm_runs, node_order
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
Part = Tuple[States, Sequence[Op]]             # a strand's state(s) and its ops in a step
Segment = Union[Part, List[Part]]              # a rotated β: parts of two nodes
Item = Tuple[StrandState, Op]

# the op between β's two nodes in a rotated layer step (neither traced nor paced: no op
# of the plan)
HANDOFF = OpSpec("handoff", COMPUTE, "compute")


def _items(seg: Optional[Segment]) -> List[Item]:
    """A segment in issue order: op by op, each on every tile of the strand."""
    if isinstance(seg, list):
        return [it for part in seg for it in _items(part)]
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
            if PACE is not None and op.spec.kind != COMM and op.spec is not HANDOFF:
                PACE.run(op, S)
            else:
                op.run(S)
            if op.spec.kind == COMM:
                issued.append((S, op, mark, S.pending[-1] if S.pending else None,
                               tracer.step if tracer is not None else 0))
                continue
            if tracer is not None and op.spec is not HANDOFF:
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
            if PACE is not None and op.spec.kind != COMM and op.spec is not HANDOFF:
                PACE.run(op, S)
            else:
                op.run(S)
            if op.spec.kind == COMM:
                issued.append((S, op, mark, S.pending[-1] if S.pending else None,
                               tracer.step if tracer is not None else 0))
                cur = 1 - cur
                continue
            if tracer is not None and op.spec is not HANDOFF:
                tracer.compute(S, op, mark)   # timed from when the comm results it read arrived
    return issued


def _barrier(issued, states, tracer: Optional[Tracer]) -> None:
    for S, op, mark, p, step in issued:
        if p is not None:
            S.lanes.resolve(p)
        if tracer is not None:
            tracer.comm(S, op, mark, p, step)
    for S in states:
        S.barrier()


# program -> {id(plan): _Bound}
_BOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Bound:
    """A plan's steps as op lists of one program: α's per step (`f`) and all (`f_all`);
    β's per step (`b`), and all in the node's own order (`b_all`, for a node alone). A
    rotated plan splits β's per step into the ops of the node above (`tail`, from op r
    on) and of the node below (`head`, its first r ops); `tail_end` is the step of the
    tail's last op, after which the hand-off runs."""

    def __init__(self, plan: Plan, program: LayerProgram):
        self.plan = plan                # held: its id stays its own
        self.f = [[program.fwd[n] for n in s.fwd] for s in plan.steps]
        self.b = [[program.bwd[n] for n in s.bwd] for s in plan.steps]
        self.f_all = [o for ops in self.f for o in ops]
        self.b_all = [program.bwd[n] for n in node_order(plan)]
        head = set(plan.backward[:plan.rotation])
        self.head = [[o for o in ops if o.name in head] for ops in self.b]
        self.tail = [[o for o in ops if o.name not in head] for ops in self.b]
        self.tail_all = [o for ops in self.tail for o in ops]
        self.head_all = [o for ops in self.head for o in ops]
        self.tail_end = max((k for k, ops in enumerate(self.tail) if ops), default=-1)
        # one node beside α by a rotated plan (no hand-off: a recomputed node): the
        # node's ops in its own order, as many per step as the plan's β ops there
        it = iter(self.b_all)
        self.b_node = [[next(it) for _ in ops] for ops in self.b]


def _bound(plan: Plan, program: LayerProgram) -> _Bound:
    """The plan's steps as op lists of `program`, made once per (plan, program)."""
    per = _BOUND.get(program)
    if per is None:
        per = _BOUND[program] = {}
    got = per.get(id(plan))
    if got is None or got.plan is not plan:
        got = per[id(plan)] = _Bound(plan, program)
    return got


def _states(*strands) -> List[StrandState]:
    out = []
    for st in strands:
        if st is not None:
            out += [st] if isinstance(st, StrandState) else list(st)
    return out


def run_layer_step(plan: Plan,
                   fwd: Optional[Tuple[LayerProgram, States]] = None,
                   bwd: Optional[Tuple[LayerProgram, States]] = None,
                   tracer: Optional[Tracer] = None,
                   below: Optional[Tuple[LayerProgram, States]] = None,
                   handoff: Optional[Callable[[], None]] = None) -> None:
    """One layer step: α's forward ops of one layer and β's backward ops of one layer
    (the same layer or another of the same shape), in the order the plan gives. Each
    strand is one state or its node's tiles. A strand without a partner runs its ops in
    the plan's order as one step: no barrier is needed between its own ops (each comm is
    waited for by its reader), so its comm runs beside its next ops that do not read it
    (a dgrad's reduce-scatter beside the wgrad after it, as in megatron's layer).

    A rotated plan with `handoff` given: `bwd` runs its ops from op r on, then
    `handoff()`, then `below` (None: no node follows) its first r ops. Without one, β's
    one node runs its ops in its own order, as many per step as the plan has there."""
    if handoff is not None and plan.rotation:
        return _run_rotated(plan, fwd, bwd, below, handoff, tracer)
    if fwd is None or bwd is None:
        if fwd is not None:
            execute_step((fwd[1], _bound(plan, fwd[0]).f_all), None, tracer)
        elif bwd is not None:
            execute_step(None, (bwd[1], _bound(plan, bwd[0]).b_all), tracer)
        return
    f_ops = _bound(plan, fwd[0]).f
    bb = _bound(plan, bwd[0])
    b_ops = bb.b_node if plan.rotation else bb.b
    issued = []
    for k in range(len(plan.steps)):
        a = (fwd[1], f_ops[k]) if f_ops[k] else None
        b = (bwd[1], b_ops[k]) if b_ops[k] else None
        if a or b:
            # no barrier between the plan's steps: a comm is waited for by its reader
            issued += execute_step(a, b, tracer, barrier=STEP_BARRIERS)
    _barrier(issued, _states(fwd[1], bwd[1]), tracer)


def run_head(plan: Plan, bwd: Tuple[LayerProgram, States],
             tracer: Optional[Tracer] = None) -> None:
    """A rotated plan's first r backward ops of β's first node, alone, in the plan's
    order (before α's first layer step of a co-step)."""
    execute_step(None, (bwd[1], _bound(plan, bwd[0]).head_all), tracer)


def _run_rotated(plan, fwd, bwd, below, handoff, tracer) -> None:
    """β from op r of `bwd` on, the hand-off, `below`'s first r ops; beside α's `fwd`
    (None: β alone)."""
    tb = _bound(plan, bwd[0])
    hb = _bound(plan, below[0]) if below is not None else None
    # once, on one state (an op of a tiled strand runs on every tile)
    hand = (_states(below[1] if below is not None else bwd[1])[0],
            [Op(HANDOFF, lambda S: handoff())])
    if fwd is None:         # alone: the rest of the node, then the hand-off
        execute_step(None, [(bwd[1], tb.tail_all), hand], tracer)
        return
    f_ops = _bound(plan, fwd[0]).f
    issued = []
    for k in range(len(plan.steps)):
        parts = [(bwd[1], tb.tail[k])]
        if k == tb.tail_end:
            parts.append(hand)
        if hb is not None:
            parts.append((below[1], hb.head[k]))
        b = [p for p in parts if p[1]]
        a = (fwd[1], f_ops[k]) if f_ops[k] else None
        if a or b:
            issued += execute_step(a, b or None, tracer, barrier=STEP_BARRIERS)
    _barrier(issued, _states(fwd[1], bwd[1], below[1] if below is not None else None),
             tracer)


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
