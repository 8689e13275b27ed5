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

from collections import deque

from dhelix.folding.order import FoldedOrder, folded_order, sends, travels_down
from dhelix.schedules.dhelix import DHelixSchedule, co_step
from dhelix.schedules.microbatch import Microbatch, MicrobatchSteps

ACT, GRAD = 0, 1


def _tag(m: int, chunk: int, kind: int) -> int:
    return 4 * m + 2 * chunk + kind


class FoldedSchedule(DHelixSchedule):
    name = "dhelix-fold"

    def __init__(self, options: dict):
        super().__init__(options)
        self._orders: Dict[Tuple[int, int], FoldedOrder] = {}

    def order(self, stages: int, microbatches: int) -> FoldedOrder:
        key = (stages, microbatches)
        if key not in self._orders:
            self._orders[key] = folded_order(stages, microbatches)
        return self._orders[key]

    def forward_backward(self, **kw):
        return forward_backward_folded(schedule=self, **kw)


class _Pipe:
    """This stage's pipeline traffic. Sends and receives are queued and go out as one
    batch a step (`flush`): the step's sends with the next step's receives, to both
    neighbours, as megatron's P2P does. On NCCL a lone blocking send or receive holds the
    lane stream until its peer's matching op runs; posted one by one, step k+1's receives
    ahead of step k's sends deadlock two stages that each wait for the other's."""

    def __init__(self, lanes, shape, dtype, device):
        import torch.distributed as dist
        from megatron.core import parallel_state
        from dhelix.strand.lanes import lane_of_group
        self.lanes, self.shape, self.dtype, self.device = lanes, shape, dtype, device
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.ranks = dist.get_process_group_ranks(self.group)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.lane = lane_of_group(self.group)
        self.to_send: List[tuple] = []        # (tensor, peer, tag) of the open batch
        self.to_recv: List[tuple] = []        # (buffer, peer, tag) of the open batch
        self.keys: List[Tuple[int, int, int]] = []
        self.batches = []                     # launched batches' Pendings
        self.posted: Dict[Tuple[int, int, int], tuple] = {}   # key -> (Pending|None, i)

    def send(self, t: torch.Tensor, to_stage: int, m: int, chunk: int, kind: int):
        self.to_send.append((t.detach(), self.ranks[to_stage], _tag(m, chunk, kind)))

    def post_recv(self, from_stage: int, m: int, chunk: int, kind: int):
        key = (m, chunk, kind)
        if key not in self.posted:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.to_recv.append((buf, self.ranks[from_stage], _tag(m, chunk, kind)))
            self.keys.append(key)
            self.posted[key] = (None, len(self.to_recv) - 1)

    def flush(self):
        """Launch the open batch (in the order every rank posts: NCCL matches by it)."""
        if not self.to_send and not self.to_recv:
            return
        p = self.lanes.p2p("p2p", self.to_send, self.to_recv, self.group, self.lane)
        for i, key in enumerate(self.keys):
            self.posted[key] = (p, i)
        self.batches.append(p)
        self.to_send, self.to_recv, self.keys = [], [], []

    def take(self, m: int, chunk: int, kind: int) -> torch.Tensor:
        key = (m, chunk, kind)
        if self.posted[key][0] is None:       # still in the open batch
            self.flush()
        p, i = self.posted.pop(key)
        return self.lanes.resolve(p)[i]

    def drain(self):
        self.flush()
        for p in self.batches:
            self.lanes.resolve(p)
        self.batches.clear()


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
    s_local = seq_length // tp if config.sequence_parallel else seq_length
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

    # the messages each neighbour will send here, in its send order: receives are posted
    # in that order (NCCL matches by order; gloo's tags would forgive a mismatch)
    expect = {n: deque(sends(order, n, g)) for n in (g - 1, g + 1) if 0 <= n < G}

    def item(kind, c, m):
        return ("F" if kind == ACT else "B", c, m)

    def post(kind, c, m):
        """Post the receive of (kind, c, m), and before it every message its sender
        sends earlier."""
        it = item(kind, c, m)
        src = g - 1 if travels_down(it) else g + 1
        if src not in expect or (m, c, kind) in pipe.posted:
            return
        queue = expect[src]
        while queue:
            k, cc, mm = queue.popleft()
            pipe.post_recv(src, mm, cc, ACT if k == "F" else GRAD)
            if (k, cc, mm) == it:
                return

    def receive(kind, c, m):
        """An item's input; None on stage 0 for F0 (the data) and B1 (the loss)."""
        if travels_down(item(kind, c, m)):
            if g == 0:
                return None
        elif g == G - 1:
            return turn[kind].pop(m)
        post(kind, c, m)
        return pipe.take(m, c, kind)

    def deliver(t, kind, c, m):
        if travels_down(item(kind, c, m)):
            if g == G - 1:
                turn[kind][m] = t.detach()
            else:
                pipe.send(t, g + 1, m, c, kind)
        elif g > 0:                                   # stage 0: the loss / the embedding
            pipe.send(t, g - 1, m, c, kind)

    def post_inputs(step):
        """Post the receives a step needs (ahead of time)."""
        if step.fwd:
            post(ACT, step.fwd[1], step.fwd[2])
        if step.bwd:
            post(GRAD, step.bwd[1], step.bwd[2])

    no_sync = config.no_sync_func or contextlib.nullcontext
    with no_sync():      # grads are reduced once, by finalize, after the last step
        if my_steps:
            post_inputs(my_steps[0])
            pipe.flush()
        for k, step in enumerate(my_steps):
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
            if k + 1 < len(my_steps):
                post_inputs(my_steps[k + 1])
            pipe.flush()              # this step's sends with the next step's receives
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
    """Evaluation: every micro-batch down through the front chunks and back up."""
    from megatron.core.pipeline_parallel import schedules as ms
    for m in range(N):
        for c in (0, 1):
            if c == 0:
                x = None if g == 0 else _recv_now(pipe, g - 1, m, 0)
            else:
                x = turn if g == G - 1 else _recv_now(pipe, g + 1, m, 1)
            s = steps[c]
            out, _ = ms.forward_step(s.fs, iter([batches[m]]), s.model, N, x, s.store,
                                     s.config, s.cp, s.collect, is_last_stage=(c == 1 and g == 0))
            if c == 0:
                if g == G - 1:
                    turn = out
                else:
                    pipe.send(out, g + 1, m, 0, ACT)
            elif g > 0:
                pipe.send(out, g - 1, m, 1, ACT)
    pipe.drain()
    return store


def _recv_now(pipe, stage, m, chunk):
    pipe.post_recv(stage, m, chunk, ACT)
    return pipe.take(m, chunk, ACT)
