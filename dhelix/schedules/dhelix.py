"""The co-executing 1F1B schedule without pipeline parallelism (DESIGN §1.6).

    F(1);  [F(k+1) ∥ B(k)] for k = 1..N-1;  B(N)

One thread drives every step, as a walk over nodes (`schedules.microbatch`): α's forward
is megatron's own forward_step, each of its DHelix layers a node; β's backward is an
explicit walk over the nodes its forward recorded. Inside a co-executed step, α's layer i
runs beside β's layer L−i+1 by the layer's plan. Every rank walks the same nodes in the
same order, so collectives never interleave differently across ranks.

A rotated plan (`Plan.rotation`) shifts β by part of a layer (`RotatedWalk`): α's layer
runs beside the end of one β node and the start of the next, so the two strands never
drain together at a layer step's end (`schedules/rotated.py`).

F(1) and B(N) have no partner. With `--dhelix-pair-last` the schedule runs one
micro-batch further ahead, so that the last two backwards pair with each other:

    F(1); F(2);  [F(k+2) ∥ B(k)] for k = 1..N-2;  B(N-1) ∥ B(N)

the tail's two walks round-robin, layer by layer (`run_tiles`, one's comm beside the
other's compute). What that buys is time after the last gradient: megatron DDP reduces a
bucket once B(N) has passed its layer, and the DP traffic left when the backward ends is
exposed; paired, there are two backwards' worth of compute behind it. What it costs: F(2)
runs alone, and one more micro-batch's activations are held from F(2) on. B(N-1)'s
gradients are handed over inside megatron's no_sync (`BackwardWalk.hold`), as they were
in its co-step: only B(N)'s ready a bucket, and each parameter's sum is megatron's, in
megatron's order (B(N-1)'s part always first: its walk runs one segment ahead).

With `--dhelix-halves` the last micro-batch's layer nodes
hold two batch halves: B(N) runs them round-robin (one half's comm beside the other's
compute), and F(N), in the co-step before, runs each op on both halves in turn. F(1)
stays whole: its halves would make B(1) run op by op on two halves beside F(2), which
costs that co-step more than the halves save F(1) (measured: F(1) 57 ms shorter, its
co-step 76 ms longer; halving B(N)'s micro-batch alone was 3% faster than halving both).
"""
from __future__ import annotations

import contextlib
from typing import Optional

from dhelix.schedules.microbatch import (BackwardWalk, Microbatch, MicrobatchSteps,
                                         unwrap_and_evaluate)
from dhelix.schedules.grad_hooks import use_ddp_grad_hooks
from dhelix.schedules.plans import PlanBook
from dhelix.schedules.rotated import RotatedWalk
from dhelix.strand.executor import Tracer, run_layer_step, run_tiles
from dhelix.strand.lanes import Lanes, make_lanes
from dhelix.strand.layer import DHelixLayer


HALVES = 2          # --dhelix-halves: B(N)'s micro-batch as two batch halves


class DHelixSchedule:
    """A forward-backward function with megatron-core's signature (and the trainer's
    schedule interface): F(1); [F(k+1) ∥ B(k)]; B(N)."""
    name = "dhelix"
    layer_module = DHelixLayer

    def __init__(self, options: dict):
        self.options = options
        self.plans: Optional[PlanBook] = None
        self.lanes: Optional[Lanes] = None
        self.tracer: Optional[Tracer] = Tracer() if options.get("trace") else None

    def prepare(self, chunks, tconfig):
        """`chunks`: the model, or the list of this rank's model chunks."""
        chunks = chunks if isinstance(chunks, list) else [chunks]
        self.lanes = make_lanes(next(chunks[0].parameters()).device)
        use_ddp_grad_hooks(chunks)     # weight gradients straight to megatron DDP's hook
        # the layers' op chains (`--dhelix-mlp-chunks`, `--dhelix-keep-gathered`), read
        # when a program is built
        for c in chunks:
            for layer in [m for m in c.modules() if isinstance(m, DHelixLayer)]:
                layer.dhelix_mlp_chunks = int(self.options.get("mlp_chunks") or 1)
                layer.dhelix_keep_gathered = self.options.get("keep_gathered") or False

    def check(self, chunks, seq_length, micro_batch_size):
        """Validate the plan against every DHelix layer now, before the first step."""
        if self.options.get("halves") and self.options.get("pair_last"):
            raise ValueError("--dhelix-halves and --dhelix-pair-last both change B(N), the "
                             "backward without a partner: give one of them")
        if self.options.get("halves") and micro_batch_size % HALVES:
            raise ValueError(f"--dhelix-halves splits the micro-batch of B(N) in "
                             f"{HALVES}: --micro-batch-size must be even (got "
                             f"{micro_batch_size})")
        chunks = chunks if isinstance(chunks, list) else [chunks]
        book = self.plan_book(seq_length, micro_batch_size)
        for c in chunks:
            for layer in [m for m in c.modules() if isinstance(m, DHelixLayer)]:
                book.for_layer(layer)
        return book

    def plan_book(self, seq_length, micro_batch_size) -> PlanBook:
        if self.plans is None or (self.plans.seq_length, self.plans.micro_batch_size) != \
                (seq_length, micro_batch_size):
            from dhelix.schedules.plans import plan_book_from_options
            self.plans = plan_book_from_options(self.options, seq_length, micro_batch_size)
        return self.plans

    def forward_backward(self, **kw):
        return forward_backward_dhelix(schedule=self, **kw)

    def finish(self, rank: int = 0):
        """Write the last iteration's trace (Chrome JSON + PNG, where the time went as
        markdown) if --dhelix-trace; on the paced link with the link's transfers."""
        path = self.options.get("trace")
        if path and self.tracer is not None and self.tracer.events:
            from dhelix.strand.trace import paced_link_events, write_trace
            events = self.tracer.events
            return write_trace(events + paced_link_events(self.tracer, events), path, rank)


def co_step(plans: PlanBook, tracer: Optional[Tracer], forward=None,
            walk: Optional[BackwardWalk] = None) -> Optional[Microbatch]:
    """One co-executed step: a forward (`forward(execute)` runs α's micro-batch with the
    given layer executor and returns its record) beside a backward walk (β). Either may
    be None. Returns α's recorded micro-batch. A node without a partner whose micro-batch
    is split in halves (`--dhelix-halves`) runs its halves round-robin (`run_tiles`)."""
    # 1. β's post-process node: its loss (or received grad) → its last layer's output grad.
    if walk is not None:
        walk.post()
    beta = RotatedWalk(walk, tracer)

    # 2. α's forward (embedding, layers, loss); each α layer runs beside β's next layer
    #    backward, by the layer's plan (a rotated plan: beside the rest of β's open node
    #    and the first ops of the node below it).
    def execute(node):
        plan = plans.for_layer(node.layer)
        if beta.pair(plan, node):
            return
        b = walk.next() if walk is not None and walk.remaining() else None
        if b is None and len(node.states) > 1:
            run_tiles(node.program, node.states, "fwd", tracer)
            return
        run_layer_step(plan, fwd=(node.program, node.states),
                       bwd=(b.program, b.states) if b is not None else None, tracer=tracer)
        if b is not None:
            walk.done(b)
    out = forward(execute) if forward is not None else None

    # 3. β's layers that found no α partner (the last step, B(N), runs alone).
    beta.close()
    while walk is not None and walk.remaining():
        b = walk.next()
        if len(b.states) > 1:
            run_tiles(b.program, b.states, "bwd", tracer)
        else:
            run_layer_step(plans.for_layer(b.layer), bwd=(b.program, b.states), tracer=tracer)
        walk.done(b)

    # 4. β's pre-process node: the embedding's gradients (or the input's, to send back).
    if walk is not None:
        walk.pre()
    return out


def co_tail(tracer: Optional[Tracer], first: BackwardWalk, last: BackwardWalk) -> None:
    """B(N−1) ∥ B(N), `--dhelix-pair-last`: both walks' post-process nodes, then each layer
    of both round-robin (`first` one segment ahead), then both pre-process nodes; each
    walk's parts in the order a walk alone runs them (module doc)."""
    first.post()
    last.post()
    while last.remaining():
        a, b = first.next(), last.next()
        run_tiles(a.program, a.states + b.states, "bwd", tracer)
        first.done(a)
        last.done(b)
    first.pre()
    last.pre()


def forward_backward_dhelix(*, forward_step_func, data_iterator, model, num_microbatches,
                            seq_length, micro_batch_size, decoder_seq_length=None,
                            forward_only=False, collect_non_loss_data=False,
                            first_val_step=None, schedule: Optional[DHelixSchedule] = None,
                            **unused):
    """megatron-core's forward-backward signature; PP = 1."""
    from megatron.core.utils import get_model_config

    model, data_iterator, evaluated = unwrap_and_evaluate(
        model, data_iterator, forward_only, forward_step_func=forward_step_func,
        num_microbatches=num_microbatches, seq_length=seq_length,
        micro_batch_size=micro_batch_size, collect_non_loss_data=collect_non_loss_data)
    if forward_only:
        return evaluated
    schedule = schedule or DHelixSchedule({"enabled": True})
    if schedule.lanes is None:
        schedule.prepare(model, None)
    plans = schedule.plan_book(seq_length, micro_batch_size)
    tracer = schedule.tracer
    if tracer is not None:
        tracer.reset()                       # keep the last iteration's trace
    steps = MicrobatchSteps(forward_step_func, data_iterator, model, num_microbatches,
                            schedule.lanes, tracer, collect_non_loss_data, first_val_step)
    no_sync = get_model_config(model).no_sync_func or contextlib.nullcontext
    N = num_microbatches
    halves = HALVES if schedule.options.get("halves") else 1

    def fwd(k):
        # B(N) will run alone: with --dhelix-halves its micro-batch is split in two, so
        # that one half's comm hides behind the other half's compute (module doc: why
        # not F(1)'s)
        tiles = halves if k == N - 1 else 1
        return lambda execute: steps.forward(k, execute, tiles=tiles)
    ahead = 2 if schedule.options.get("pair_last") and N > 1 else 1   # forwards before B(1)
    with no_sync():
        done = [co_step(plans, tracer, fwd(k)) for k in range(ahead)]   # F(1) (and F(2))
        for k in range(ahead, N):                                       # F(k+1) ∥ B(k+1−ahead)
            done.append(co_step(plans, tracer, fwd(k), steps.backward(done.pop(0))))
    # outside no_sync: megatron DDP reduces the gradients as the last backward readies them
    if ahead == 2:                                                      # B(N−1) ∥ B(N)
        co_tail(tracer, steps.backward(done[0], hold=no_sync), steps.backward(done[1]))
    else:                                                               # B(N)
        co_step(plans, tracer, None, steps.backward(done[0]))
    steps.finalize()
    return steps.store
