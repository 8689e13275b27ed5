"""The fold's pipeline messages as batches every stage posts (plain data, no tensors).

On NCCL a send holds its lane stream until the peer's matching receive runs, a receive
until the data is there, and messages between two ranks match in posting order. Two
stages that each wait for the other's later message therefore deadlock — posting step
k+1's receives before step k's sends did (G=2, N=4), and so does one batch a step of the
step's sends and the next step's receives (G=4, N=4: the last stage's early F1 output
waits for a receive its neighbour posts three steps later, while holding the receive
that neighbour needs to get there).

What cannot deadlock: every stage posts its messages in one global order that puts a
step's inputs before its outputs — the unit-cost play's times (`order.play`: an input
ends before the step that reads it starts). Then the earliest unfinished message has
both ends posted: its sender computed it (its inputs are earlier, so done) and its
receiver posted everything earlier. Batches keep that order; a batch holds the receives
of one step only, so waiting for it never waits for a later step's input. `simulate`
plays the blocking rules and checks it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from dhelix.planner.pipeline_order import FoldedOrder, Item, travels_down


@dataclass(frozen=True)
class Message:
    item: Item            # its output (F) or input grad (B) travels
    src: int
    dst: int
    produced: int         # index of the step on `src` that makes it
    consumed: int         # index of the step on `dst` that reads it


@dataclass
class Batch:
    """One batch_isend_irecv, posted just before step `before` (after step before-1)."""
    before: int
    sends: List[Message] = field(default_factory=list)
    recvs: List[Message] = field(default_factory=list)


def _destination(item: Item, g: int, G: int) -> Optional[int]:
    if travels_down(item):
        return g + 1 if g < G - 1 else None      # the last stage turns it, no P2P
    return g - 1 if g > 0 else None              # stage 0: the loss / the embedding


def messages(order: FoldedOrder) -> List[Message]:
    """Every pipeline message, in the global order: by the unit-cost end of the step
    that makes it, then stage, then the step's forward output before its input grad."""
    G = order.stages
    consumer: Dict[Tuple[int, Item], int] = {}
    for g, steps in enumerate(order.steps):
        for k, s in enumerate(steps):
            for it in (s.fwd, s.bwd):
                if it is not None:
                    consumer[(g, it)] = k
    keyed = []
    for g, steps in enumerate(order.steps):
        for k, s in enumerate(steps):
            for j, it in enumerate((s.fwd, s.bwd)):
                dst = None if it is None else _destination(it, g, G)
                if dst is None:
                    continue
                m = Message(it, g, dst, k, consumer[(dst, it)])
                read_at = order.steps[dst][m.consumed].start
                if not s.end <= read_at:
                    raise ValueError(f"the fold's order reads {it} on stage {dst} at "
                                     f"{read_at} before stage {g} ends it at {s.end}")
                keyed.append(((s.end, g, j), m))
    return [m for _, m in sorted(keyed, key=lambda km: km[0])]


def batches(order: FoldedOrder) -> List[List[Batch]]:
    """Per stage, the batches it posts, each as early as its sends allow."""
    msgs = messages(order)
    out = []
    for g in range(order.stages):
        mine = [m for m in msgs if g in (m.src, m.dst)]
        plan: List[Batch] = []
        cur: Optional[Batch] = None
        for m in mine:
            before = m.produced + 1 if m.src == g else 0
            # a batch is posted once every send in it exists; a new one starts for a
            # later post point, or for the receives of another step
            if cur is None or before > cur.before or (
                    m.dst == g and cur.recvs and cur.recvs[-1].consumed != m.consumed):
                cur = Batch(max(before, cur.before if cur else 0))
                plan.append(cur)
            (cur.sends if m.src == g else cur.recvs).append(m)
        for b in plan:
            for m in b.recvs:
                if b.before > m.consumed:
                    raise AssertionError(f"stage {g}: the receive of {m.item} is posted "
                                         f"after the step that reads it")
        out.append(plan)
    return out


def simulate(plan: List[List[Batch]], steps_per_stage: List[int]) -> None:
    """Play NCCL's rules on `plan`: a stage runs its steps in order, posting each batch
    before its step; a lane runs its batches in order, a batch holding the lane until all
    its messages moved; a message moves once its send and its receive both run. A step
    waits for the batches holding its inputs. Raises RuntimeError if stages wait on each
    other forever."""
    G = len(plan)
    step = [0] * G                # the next step each stage runs
    posted = [0] * G              # batches posted
    head = [0] * G                # the batch each lane runs
    moved = set()
    where: Dict[Tuple[int, Message], int] = {}
    for g in range(G):
        for i, b in enumerate(plan[g]):
            for m in b.sends + b.recvs:
                where[(g, m)] = i

    def running(g, m):
        i = where[(g, m)]
        return i == head[g] and i < posted[g]

    progress = True
    while progress:
        progress = False
        for g in range(G):                             # post what is due
            while posted[g] < len(plan[g]) and plan[g][posted[g]].before <= step[g]:
                posted[g] += 1
                progress = True
        for g in range(G):                             # move messages
            if head[g] < posted[g]:
                b = plan[g][head[g]]
                for m in b.sends:
                    if m not in moved and running(m.dst, m):
                        moved.add(m)
                        progress = True
        for g in range(G):                             # lanes advance
            while head[g] < posted[g] and all(m in moved for m in plan[g][head[g]].sends +
                                              plan[g][head[g]].recvs):
                head[g] += 1
                progress = True
        for g in range(G):                             # steps run once inputs are in
            while step[g] < steps_per_stage[g]:
                need = [i for i, b in enumerate(plan[g]) if any(
                    m.consumed == step[g] for m in b.recvs)]
                if any(i >= head[g] for i in need) or (
                        posted[g] < len(plan[g]) and plan[g][posted[g]].before <= step[g]):
                    break
                step[g] += 1
                progress = True
    stuck = {g: (step[g], head[g]) for g in range(G)
             if step[g] < steps_per_stage[g] or head[g] < len(plan[g])}
    if stuck:
        raise RuntimeError("the fold's P2P deadlocks on NCCL: " + "; ".join(
            f"stage {g} at step {s}, its lane in batch {h} "
            f"({_describe(plan[g][h]) if h < len(plan[g]) else 'done'})"
            for g, (s, h) in stuck.items()))


def _describe(b: Batch) -> str:
    return ", ".join([f"send {m.item} to {m.dst}" for m in b.sends] +
                     [f"recv {m.item} from {m.src}" for m in b.recvs])


def step_batches(order: FoldedOrder) -> List[List[Batch]]:
    """The rejected design, kept to show `simulate` catches it: after each step one batch
    of its sends and the next step's receives."""
    msgs = messages(order)
    out = []
    for g in range(order.stages):
        plan = [Batch(k) for k in range(len(order.steps[g]) + 1)]
        for m in msgs:
            if m.src == g:
                plan[m.produced + 1].sends.append(m)
            elif m.dst == g:
                plan[m.consumed].recvs.append(m)
        out.append([b for b in plan if b.sends or b.recvs])
    return out
