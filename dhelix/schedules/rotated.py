"""β's walk under a rotated plan (`Plan.rotation`, DESIGN "Steps and plans").

At a layer step's end both strands drain at once: α waits for its last reduce-scatter, β
for its own, and the link idles while both begin the next layer. A rotated plan shifts β
by r ops: each α layer runs beside the end of one β node and the first r ops of the node
below, joined by a hand-off op (`strand.executor`). Each strand's op order is unchanged.
"""
from __future__ import annotations

from typing import Optional

from dhelix.schedules.microbatch import BackwardWalk
from dhelix.strand.executor import Tracer, run_head, run_layer_step


class RotatedWalk:
    """β's side of a co-step under a rotated plan (`Plan.rotation` r): the open node has
    run its first r ops; each α layer runs beside the open node's other ops and the first
    r ops of the node below, which then is the open one. The first node's first r ops run
    alone, before α's first layer; the last node's rest after α's last (`close`)."""

    def __init__(self, walk: Optional[BackwardWalk], tracer: Optional[Tracer]):
        self.walk, self.tracer = walk, tracer
        self.open = None                  # β's node whose first r ops have run
        self.plan = None                  # ... by this plan

    def pair(self, plan, node) -> bool:
        """Run α's `node` beside β by a rotated `plan`; False where it does not apply (no
        rotation, no β node left, or a recomputed β node, whose forward reruns first)."""
        walk = self.walk
        if self.open is not None and self.plan.rotation != plan.rotation:
            self.close()                  # layers of another plan: finish the open node
        if not plan.rotation or walk is None or \
                (self.open is None and not _can_rotate(walk)):
            return False
        if self.open is None:             # β's first node: its first r ops alone
            self.open, self.plan = walk.next(), plan
            run_head(plan, (self.open.program, self.open.states), self.tracer)
        top = self.open
        below = walk.pending[-1] if _can_rotate(walk) else None

        def handoff():                    # the node above done, the one below begun
            walk.done(top)
            self.open = walk.next() if below is not None else None
            assert self.open is below
        run_layer_step(plan, fwd=(node.program, node.states),
                       bwd=(top.program, top.states), tracer=self.tracer,
                       below=(below.program, below.states) if below is not None else None,
                       handoff=handoff)
        return True

    def close(self) -> None:
        """The open node's remaining ops, alone."""
        if self.open is None:
            return
        top, walk = self.open, self.walk

        def handoff():
            walk.done(top)
            self.open = None
        run_layer_step(self.plan, bwd=(top.program, top.states), tracer=self.tracer,
                       handoff=handoff)


def _can_rotate(walk: BackwardWalk) -> bool:
    """β's next node exists and is not recomputed (a recomputed node reruns its forward
    when it begins: the hand-off stays at a layer step's end)."""
    return walk.remaining() > 0 and not walk.pending[-1].recompute
