"""The intra-batch overlap peer (a baseline to compare DHelix with, not DHelix).

Each micro-batch is split into two halves whose ops the same executor interleaves,
segment by segment in round-robin: the two forward halves together, then the two
backward halves together — the approach of Domino and of graph-level schedulers that
tile the batch. Megatron's forward_step/backward_step run each half; the loss of a half
is scaled by 1/(2N), so the step's gradient equals the full micro-batches' gradient.
"""
from __future__ import annotations

import contextlib


from dhelix.strand.schedule import CoExecutor, DHelixSchedule, MicrobatchSteps


class IntraBatchSchedule(DHelixSchedule):
    name = "intra-batch"

    def forward_backward(self, **kw):
        return forward_backward_intra_batch(schedule=self, **kw)


def _halves(data_iterator):
    for batch in data_iterator:
        b = next(iter(batch.values())).shape[0]
        if b < 2 or b % 2:
            raise ValueError(f"the intra-batch peer splits each micro-batch in two: "
                             f"--micro-batch-size must be even (got {b})")
        yield {k: v[: b // 2] for k, v in batch.items()}
        yield {k: v[b // 2:] for k, v in batch.items()}


def forward_backward_intra_batch(*, forward_step_func, data_iterator, model,
                                 num_microbatches, seq_length, micro_batch_size,
                                 forward_only=False, schedule=None, **unused):
    from megatron.core.pipeline_parallel import schedules as ms
    from megatron.core.utils import get_model_config

    if isinstance(model, list):
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if forward_only:
        return ms.forward_backward_no_pipelining(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, forward_only=True)
    if schedule.lanes is None:
        schedule.prepare(model, None)
    config = get_model_config(model)
    plans = schedule.plan_book(seq_length, micro_batch_size // 2)
    co = CoExecutor(plans, schedule.lanes, schedule.tracer)
    no_sync = config.no_sync_func or contextlib.nullcontext
    # the halves are 2N micro-batches to megatron: each loss is scaled by 1/(2N)
    mb = MicrobatchSteps(forward_step_func, _halves(data_iterator), model,
                         2 * num_microbatches)
    F, B = mb.F, mb.B
    overlap_reduce = getattr(getattr(model, "ddp_config", None), "overlap_grad_reduce", False)
    if schedule.tracer is not None:
        schedule.tracer.reset()
    for m in range(num_microbatches):
        last = m == num_microbatches - 1
        with no_sync():
            mb.count(co.run(alpha=F(2 * m), beta=F(2 * m + 1),
                            labels=(f"F{m + 1}a", f"F{m + 1}b")))
            if not last:
                co.run(alpha=B(2 * m), beta=B(2 * m + 1), labels=(f"B{m + 1}a", f"B{m + 1}b"))
            elif overlap_reduce:
                # megatron DDP registers each grad once while reducing: the last
                # half-batch's backward runs alone, outside no_sync
                co.run(alpha=B(2 * m), labels=(f"B{m + 1}a", ""))
        if last:
            if overlap_reduce:
                co.run(beta=B(2 * m + 1), labels=("", f"B{m + 1}b"))
            else:
                co.run(alpha=B(2 * m), beta=B(2 * m + 1), labels=(f"B{m + 1}a", f"B{m + 1}b"))
    mb.finalize()
    return mb.store
