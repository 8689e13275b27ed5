"""The intra-batch overlap peer (a baseline to compare DHelix with, not DHelix).

megatron's own order — F(k) then B(k) — with each layer node holding the two halves of
its micro-batch, whose op chains the executor runs round-robin, segment by segment: one
half's comm beside the other half's compute. That is the approach of Domino and of the
graph-level schedulers that tile the batch (tiling K = 2). Embedding and loss run on the
whole micro-batch, so losses and gradient scaling are megatron's.
"""
from __future__ import annotations

import contextlib

from dhelix.schedules.dhelix import DHelixSchedule
from dhelix.schedules.microbatch import MicrobatchSteps, unwrap_and_evaluate
from dhelix.strand.executor import run_tiles

TILES = 2


class IntraBatchSchedule(DHelixSchedule):
    name = "intra-batch"

    def check(self, model, seq_length, micro_batch_size):
        if micro_batch_size % TILES:
            raise ValueError(f"the intra-batch peer splits each micro-batch in two: "
                             f"--micro-batch-size must be even (got {micro_batch_size})")

    def forward_backward(self, **kw):
        return forward_backward_intra_batch(schedule=self, **kw)


def forward_backward_intra_batch(*, forward_step_func, data_iterator, model,
                                 num_microbatches, seq_length, micro_batch_size,
                                 forward_only=False, schedule=None, **unused):
    from megatron.core.utils import get_model_config

    model, data_iterator, evaluated = unwrap_and_evaluate(
        model, data_iterator, forward_only, forward_step_func=forward_step_func,
        num_microbatches=num_microbatches, seq_length=seq_length,
        micro_batch_size=micro_batch_size)
    if forward_only:
        return evaluated
    if schedule.lanes is None:
        schedule.prepare(model, None)
    schedule.check(model, seq_length, micro_batch_size)
    tracer = schedule.tracer
    if tracer is not None:
        tracer.reset()
    steps = MicrobatchSteps(forward_step_func, data_iterator, model, num_microbatches,
                            schedule.lanes, tracer)
    no_sync = get_model_config(model).no_sync_func or contextlib.nullcontext
    for k in range(num_microbatches):
        last = k == num_microbatches - 1
        with (contextlib.nullcontext() if last else no_sync()):   # megatron: last outside
            mb = steps.forward(k, lambda node: run_tiles(node.program, node.states, "fwd",
                                                         tracer), tiles=TILES)
            walk = steps.backward(mb)
            walk.post()
            while walk.remaining():
                node = walk.next()
                run_tiles(node.program, node.states, "bwd", tracer)
                walk.done(node)
            walk.pre()
    steps.finalize()
    return steps.store
