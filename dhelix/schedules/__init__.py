"""Forward-backward schedules with megatron-core's signature, driven as nodes on one thread.

    megatron.py     the baseline: megatron-core's own schedule and layer
    microbatch.py   a micro-batch's forward (megatron's forward_step, DHelix layers as
                    nodes) and its backward as an explicit node walk
    dhelix.py       DHelix: F(1); [F(k+1) ∥ B(k)]; B(N), layers paired by the plan
    intra_batch.py  the intra-batch peer: each layer node's two batch halves round-robin
    plans.py        which plan each layer runs (from the --dhelix* options)
The folded pipeline schedule (PP > 1) lives with the fold, in `dhelix.folding`.
"""
from __future__ import annotations


def make_schedule(options: dict):
    """The schedule for a run's `--dhelix*` options (plain dict)."""
    if options.get("peer") == "intra-batch":
        from dhelix.schedules.intra_batch import IntraBatchSchedule
        return IntraBatchSchedule(options)
    if options.get("enabled") and options.get("fold"):
        from dhelix.folding.schedule import FoldedSchedule
        return FoldedSchedule(options)
    if options.get("enabled"):
        from dhelix.schedules.dhelix import DHelixSchedule
        return DHelixSchedule(options)
    from dhelix.schedules.megatron import MegatronSchedule
    return MegatronSchedule()
