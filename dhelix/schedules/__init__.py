"""Forward-backward schedules with megatron-core's signature, driven as nodes on one thread.

    megatron.py     the baseline: megatron-core's own schedule and layer
    microbatch.py   a micro-batch's forward (megatron's forward_step, DHelix layers as
                    nodes) and its backward as an explicit node walk
    dhelix.py       DHelix: F(1); [F(k+1) ∥ B(k)]; B(N), layers paired by the plan
    intra_batch.py  the intra-batch peer: each layer node's two batch halves round-robin
    plans.py        which plan each layer runs (from the --dhelix* options)
The folded pipeline schedule (PP > 1) lives with the fold, in `dhelix.folding`; the
choice among them all in `dhelix.train.schedules`.
"""
from __future__ import annotations

