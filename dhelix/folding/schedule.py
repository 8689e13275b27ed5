"""The U-folded pipeline schedule (DESIGN §1.6), with megatron-core's forward-backward
signature.

Every stage holds its front and back chunk in one `FoldedStage` (one DDP). The stage runs
its steps from `order.folded_order` — a forward work item of one micro-batch beside a
backward item of another, co-executed layer by layer by the layer plan exactly as
without a pipeline (`schedules.dhelix.co_step`), or one item alone. Between steps the
pipeline traffic moves as explicit comm ops on the lane of the pipeline group (`intra`
or `inter` by node membership): after each step, one batch carries the step's outputs
to both neighbours and posts the next step's receives (as megatron's P2P does; on NCCL
lone blocking sends and receives in one lane stream would deadlock), and it travels
while the stage waits for the next step's inputs. At the fold's turn (the last stage) the front chunk's output becomes
the back chunk's input, and the back chunk's input grad the front chunk's output grad,
with no P2P. Embedding and loss are both on stage 0.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch


from dhelix.planner.pipeline_order import FoldedOrder, folded_order, travels_down
from dhelix.folding.p2p import Batch, batches as p2p_batches
from dhelix.schedules.dhelix import DHelixSchedule, co_step
from dhelix.schedules.microbatch import Microbatch, MicrobatchSteps

ACT, GRAD = 0, 1


def _tag(item) -> int:
    kind, chunk, m = item
    return 4 * m + 2 * chunk + (0 if kind == "F" else 1)


class FoldedSchedule(DHelixSchedule):
    name = "dhelix-fold"

    def __init__(self, options: dict):
        super().__init__(options)
        self._orders: Dict[Tuple[int, int], FoldedOrder] = {}
        self._p2p: Dict[Tuple[int, int], List[List[Batch]]] = {}

    def order(self, stages: int, microbatches: int) -> FoldedOrder:
        key = (stages, microbatches)
        if key not in self._orders:
            self._orders[key] = folded_order(stages, microbatches)
        return self._orders[key]

    def p2p_plan(self, stages: int, microbatches: int) -> List[List[Batch]]:
        key = (stages, microbatches)
        if key not in self._p2p:
            self._p2p[key] = p2p_batches(self.order(stages, microbatches))
        return self._p2p[key]

    def forward_backward(self, **kw):
        return forward_backward_folded(schedule=self, **kw)


class _Pipe:
    """This stage's pipeline traffic, as the batches `folding.p2p.batches` plans: each
    posted before its step, in the one global order every stage keeps (NCCL matches
    point-to-point messages by posting order and blocks the lane in each; see p2p.py)."""

    def __init__(self, lanes, shape, dtype, device, plan=()):
        import torch.distributed as dist
        from megatron.core import parallel_state
        from dhelix.strand.lanes import lane_of_group
        self.lanes, self.shape, self.dtype, self.device = lanes, shape, dtype, device
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.ranks = dist.get_process_group_ranks(self.group)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.lane = lane_of_group(self.group)
        self.plan, self.next = list(plan), 0
        self.outbox: Dict[tuple, torch.Tensor] = {}      # item -> output to send
        self.inbox: Dict[tuple, tuple] = {}              # item -> (Pending, index)
        self.launched = []

    def deliver(self, item, t: torch.Tensor):
        self.outbox[item] = t.detach()

    def post(self, step: int):
        """Post the batches due before `step` (len(steps): the last sends)."""
        while self.next < len(self.plan) and self.plan[self.next].before <= step:
            b = self.plan[self.next]
            self.next += 1
            sends = [(self.outbox.pop(m.item), self.ranks[m.dst], _tag(m.item))
                     for m in b.sends]
            recvs = [(torch.empty(self.shape, dtype=self.dtype, device=self.device),
                      self.ranks[m.src], _tag(m.item)) for m in b.recvs]
            p = self.lanes.p2p("p2p", sends, recvs, self.group, self.lane)
            for i, m in enumerate(b.recvs):
                self.inbox[m.item] = (p, i)
            self.launched.append(p)

    def send_now(self, item, t: torch.Tensor, to_stage: int):
        self.launched.append(self.lanes.p2p("p2p", [(t.detach(), self.ranks[to_stage],
                                                      _tag(item))], [], self.group, self.lane))

    def recv_now(self, item, from_stage: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        p = self.lanes.p2p("p2p", [], [(buf, self.ranks[from_stage], _tag(item))],
                           self.group, self.lane)
        return self.lanes.resolve(p)[0]

    def take(self, item) -> torch.Tensor:
        p, i = self.inbox.pop(item)
        return self.lanes.resolve(p)[i]

    def drain(self):
        for p in self.launched:
            self.lanes.resolve(p)
        self.launched.clear()
        assert not self.outbox and not self.inbox, "pipeline messages left unsent"


def forward_backward_folded(*, forward_step_func, data_iterator, model, num_microbatches,
                            seq_length, micro_batch_size, decoder_seq_length=None,
                            forward_only=False, collect_non_loss_data=False,
                            first_val_step=None, schedule: Optional[FoldedSchedule] = None,
                            **unused):
    """megatron-core's forward-backward signature; `model` is [DDP(FoldedStage)]."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    stage_ddp = model[0] if isinstance(model, list) else model
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    front, back = stage_ddp.module.front, stage_ddp.module.back
    if schedule.lanes is None:
        schedule.prepare([stage_ddp], None)
    config = get_model_config(front)
    G = parallel_state.get_pipeline_model_parallel_world_size()
    g = parallel_state.get_pipeline_model_parallel_rank()
    N = num_microbatches
    tp = parallel_state.get_tensor_model_parallel_world_size()
    # what travels between stages is this rank's part of the sequence, as megatron's
    # `get_tensor_shapes`: 1/CP of it (its two load-balanced chunks), 1/TP of that with SP
    s_local = seq_length // parallel_state.get_context_parallel_world_size()
    if config.sequence_parallel:
        s_local //= tp
    pipe = _Pipe(schedule.lanes, (s_local, micro_batch_size, config.hidden_size),
                 config.pipeline_dtype or config.params_dtype,
                 next(stage_ddp.parameters()).device)
    # every stage reads the step's micro-batches once, in order; both chunks see them
    batches = [next(data_iterator) for _ in range(N)]
    tracer = schedule.tracer
    if tracer is not None:
        tracer.reset()
    steps = [MicrobatchSteps(forward_step_func, None, chunk, N, schedule.lanes, tracer,
                             collect_non_loss_data, first_val_step) for chunk in (front, back)]
    store = steps[1].store if g == 0 else []

    if forward_only:
        return _forward_only(steps, pipe, batches, G, g, N, store)

    plans = schedule.plan_book(seq_length, micro_batch_size)
    order = schedule.order(G, N)
    records: Dict[Tuple[int, int], Microbatch] = {}
    # stage G-1 turns a micro-batch around: front output -> back input (ACT), back input
    # grad -> front output grad (GRAD), without P2P
    turn: Dict[int, Dict[int, torch.Tensor]] = {ACT: {}, GRAD: {}}
    my_steps = order.steps[g]

    pipe.plan, pipe.next = schedule.p2p_plan(G, N)[g], 0

    def item(kind, c, m):
        return ("F" if kind == ACT else "B", c, m)

    def receive(kind, c, m):
        """An item's input; None on stage 0 for F0 (the data) and B1 (the loss)."""
        if travels_down(item(kind, c, m)):
            if g == 0:
                return None
        elif g == G - 1:
            return turn[kind].pop(m)
        return pipe.take(item(kind, c, m))

    def deliver(t, kind, c, m):
        it = item(kind, c, m)
        if travels_down(it):
            if g == G - 1:
                turn[kind][m] = t.detach()
            else:
                pipe.deliver(it, t)
        elif g > 0:                                   # stage 0: the loss / the embedding
            pipe.deliver(it, t)

    no_sync = config.no_sync_func or contextlib.nullcontext
    with no_sync():      # grads are reduced once, by finalize, after the last step
        for k, step in enumerate(my_steps):
            pipe.post(k)                  # the batches due: earlier sends, k's receives
            walk = None
            if step.bwd:
                _, cb, mb = step.bwd
                walk = steps[cb].backward(records.pop((cb, mb)),
                                          grad_output=receive(GRAD, cb, mb))
            forward = None
            if step.fwd:
                _, cf, mf = step.fwd
                x = receive(ACT, cf, mf)
                if x is not None:
                    x = x.detach().requires_grad_()
                forward = _forward(steps[cf], mf, batches[mf], x,
                                   is_last=(cf == 1 and g == 0))
            out = co_step(plans, tracer, forward, walk)
            if step.fwd:
                records[(cf, mf)] = out
                deliver(out.output, ACT, cf, mf)      # stage 0's F1 output: the loss, kept
            if walk is not None:
                deliver(walk.input_grad, GRAD, cb, mb)
        pipe.post(len(my_steps))
        pipe.drain()
    tokens = steps[0].tokens + steps[1].tokens
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([stage_ddp],
                                         tokens if config.calculate_per_token_loss else None)
    return store


def _forward(steps: MicrobatchSteps, m: int, batch, x, is_last: bool):
    def run(execute):
        return steps.forward(m, execute, data=iter([batch]), input_tensor=x,
                             is_last_stage=is_last)
    return run


def _forward_only(steps, pipe, batches, G, g, N, store):
    """Evaluation: every micro-batch down through the front chunks and back up; each
    message a batch of its own, posted in time order on every stage."""
    from megatron.core.pipeline_parallel import schedules as ms
    turn = None                   # the last stage: its front output is its back input
    for m in range(N):
        for c in (0, 1):
            it = ("F", c, m)
            if c == 0:
                x = None if g == 0 else pipe.recv_now(it, g - 1)
            else:
                x = turn if g == G - 1 else pipe.recv_now(it, g + 1)
            s = steps[c]
            out, _ = ms.forward_step(s.fs, iter([batches[m]]), s.model, N, x, s.store,
                                     s.config, s.cp, s.collect, is_last_stage=(c == 1 and g == 0))
            if c == 0:
                if g == G - 1:
                    turn = out
                else:
                    pipe.send_now(it, out, g + 1)
            elif g > 0:
                pipe.send_now(it, out, g - 1)
    pipe.drain()
    return store
