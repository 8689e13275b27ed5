"""The co-executing 1F1B schedule without pipeline parallelism (DESIGN §1.6).

    F(1);  [F(k+1) ∥ B(k)] for k = 1..N-1;  B(N)

Each micro-batch's forward and backward are megatron's own `forward_step` and
`backward_step` (embedding, loss, DDP hooks unchanged), each run as a *strand*: a
coroutine on a thread of its own. Whenever a strand reaches a DHelix layer it parks with
a request ("run my forward of layer i" / "my backward of layer j") and the scheduler,
holding one request from each strand, runs both as one layer step by the plan — α's
layer i beside β's layer L−i+1 — then resumes the strands, α first. Only one thread
runs at a time, in the same order on every rank, so collectives never interleave
differently across ranks.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from dhelix.strand.executor import Tracer, execute_step, run_layer_step
from dhelix.strand.lanes import Lanes, make_lanes
from dhelix.strand.layer import DHelixLayer, set_backward_runner, use_runner
from dhelix.strand.runner import PlanBook
from dhelix.strand.state import StrandState
from dhelix.train.memory import METER


@dataclass
class Request:
    kind: str          # "fwd" | "bwd"
    layer: Any
    S: StrandState


class Strand:
    """A function run as a coroutine: it parks at each layer request."""

    def __init__(self, name: str, fn: Callable[[], Any], lanes: Lanes, timeout: float,
                 label: str = ""):
        self.name, self.fn, self.lanes, self.timeout = name, fn, lanes, timeout
        self.label = label
        self.cv = threading.Condition()
        self.turn = "scheduler"
        self.request: Optional[Request] = None
        self.done = False
        self.result = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._main, name=f"strand-{name}", daemon=True)
        self.thread.start()

    # -- strand side ----------------------------------------------------------------------
    def _main(self):
        self._wait_for("strand")
        try:
            with use_runner(self), METER.autograd():
                self.result = self.fn()
        except BaseException as e:   # handed to the scheduler, re-raised there
            self.error = e
        self.done = True
        self._hand_to("scheduler")

    def new_state(self, layer) -> StrandState:
        return StrandState(self.lanes, self.name, self.label)

    def forward(self, layer, S):
        self._park(Request("fwd", layer, S))

    def backward(self, layer, S):
        S.strand, S.label = self.name, self.label   # S was made by the forward's strand
        self._park(Request("bwd", layer, S))

    def _park(self, req: Request):
        self.request = req
        self._hand_to("scheduler")
        self._wait_for("strand")

    # -- scheduler side ---------------------------------------------------------------------
    def resume(self):
        """Let the strand run until it parks again or finishes."""
        if self.done:
            return
        self.request = None
        self._hand_to("strand")
        self._wait_for("scheduler")
        if self.error is not None:
            raise self.error

    # -- hand-off ----------------------------------------------------------------------------
    def _hand_to(self, who):
        with self.cv:
            self.turn = who
            self.cv.notify_all()

    def _wait_for(self, who):
        with self.cv:
            if not self.cv.wait_for(lambda: self.turn == who, timeout=self.timeout):
                raise TimeoutError(f"strand {self.name}: no hand-off within {self.timeout}s")


class CoExecutor:
    """Runs one or two strands to completion, pairing their layer requests."""

    def __init__(self, plans: PlanBook, lanes: Lanes, tracer: Optional[Tracer] = None,
                 timeout: float = 600.0):
        self.plans, self.lanes, self.tracer, self.timeout = plans, lanes, tracer, timeout

    def run(self, alpha: Optional[Callable] = None, beta: Optional[Callable] = None,
            labels=("", "")):
        a = Strand("α", alpha, self.lanes, self.timeout, labels[0]) if alpha else None
        b = Strand("β", beta, self.lanes, self.timeout, labels[1]) if beta else None
        with set_backward_runner(b):
            for s in (a, b):
                if s is not None:
                    s.resume()
            while True:
                ra = a.request if a is not None and not a.done else None
                rb = b.request if b is not None and not b.done else None
                if ra is None and rb is None:
                    break
                self._step(ra, rb)
                for s, r in ((a, ra), (b, rb)):
                    if r is not None:
                        s.resume()
        return (a.result if a else None), (b.result if b else None)

    def _step(self, ra: Optional[Request], rb: Optional[Request]):
        """One layer step: each request is a forward or a backward; a forward is paired
        with a backward by the plan; two of a kind (not produced by 1F1B) run in turn."""
        reqs = [r for r in (ra, rb) if r is not None]
        fwd = [r for r in reqs if r.kind == "fwd"]
        bwd = [r for r in reqs if r.kind == "bwd"]
        if len(fwd) <= 1 and len(bwd) <= 1:
            f = fwd[0] if fwd else None
            b = bwd[0] if bwd else None
            plan = self.plans.for_layer((f or b).layer)
            run_layer_step(plan, fwd=(f.layer.program, f.S) if f else None,
                           bwd=(b.layer.program, b.S) if b else None, tracer=self.tracer)
            return
        round_robin(reqs[0], reqs[1], self.tracer)


def round_robin(a: Request, b: Request, tracer: Optional[Tracer] = None) -> None:
    """Two requests of one kind (two forward halves of a micro-batch, or two backward
    halves): segment by segment, a's k-th segment beside b's (k-1)-th, so that one
    half's comm runs beside the other half's compute (the intra-batch peer)."""
    from dhelix.planner.plan import comm_runs

    def segs(r):
        prog = r.layer.program
        chain = prog.forward_ops if r.kind == "fwd" else prog.backward_ops
        by = prog.fwd if r.kind == "fwd" else prog.bwd
        return [[by[n] for n in seg] for seg in comm_runs([o.spec for o in chain])]
    sa, sb = segs(a), segs(b)
    for k in range(max(len(sa), len(sb) + 1)):
        execute_step((a.S, sa[k]) if k < len(sa) else None,
                     (b.S, sb[k - 1]) if 1 <= k <= len(sb) else None, tracer)


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

    def prepare(self, model, tconfig):
        self.device = next(model.parameters()).device
        self.lanes = make_lanes(self.device)

    def check(self, model, seq_length, micro_batch_size):
        """Validate the plan against every DHelix layer now, before the first step."""
        book = self.plan_book(seq_length, micro_batch_size)
        layers = [m for m in model.modules() if isinstance(m, DHelixLayer)]
        for layer in layers:
            book.for_layer(layer)
        return book

    def plan_book(self, seq_length, micro_batch_size) -> PlanBook:
        if self.plans is None or (self.plans.seq_length, self.plans.micro_batch_size) != \
                (seq_length, micro_batch_size):
            from dhelix.megatron.plans import plan_book_from_options
            self.plans = plan_book_from_options(self.options, seq_length, micro_batch_size)
        return self.plans

    def forward_backward(self, **kw):
        return forward_backward_dhelix(schedule=self, **kw)

    def finish(self, rank: int = 0):
        """Write the last iteration's trace (Chrome JSON + PNG) if --dhelix-trace."""
        path = self.options.get("trace")
        if path and self.tracer is not None and self.tracer.events:
            from dhelix.strand.trace import write_trace
            return write_trace(self.tracer.events, path, rank)


def forward_backward_dhelix(*, forward_step_func, data_iterator, model, num_microbatches,
                            seq_length, micro_batch_size, decoder_seq_length=None,
                            forward_only=False, collect_non_loss_data=False,
                            first_val_step=None, schedule: Optional[DHelixSchedule] = None,
                            **unused):
    """megatron-core's forward-backward signature; PP = 1."""
    from megatron.core.pipeline_parallel import schedules as ms
    from megatron.core.utils import get_model_config

    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("DHelix without pipeline parallelism takes one model chunk")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    if forward_only:
        # evaluation: nothing to pair; megatron's own schedule, layers run plainly
        return ms.forward_backward_no_pipelining(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=num_microbatches, seq_length=seq_length,
            micro_batch_size=micro_batch_size, forward_only=True,
            collect_non_loss_data=collect_non_loss_data)
    schedule = schedule or _default_schedule()
    if schedule.lanes is None:
        schedule.prepare(model, None)
    config = get_model_config(model)
    plans = schedule.plan_book(seq_length, micro_batch_size)
    co = CoExecutor(plans, schedule.lanes, schedule.tracer)
    no_sync = config.no_sync_func or contextlib.nullcontext
    mb = MicrobatchSteps(forward_step_func, data_iterator, model, num_microbatches,
                         collect_non_loss_data, first_val_step)
    N = num_microbatches
    with no_sync():
        if schedule.tracer is not None:
            schedule.tracer.reset()       # keep the last iteration's trace
        mb.count(co.run(alpha=mb.F(0), labels=("F1", "")))
        for k in range(N - 1):
            mb.count(co.run(alpha=mb.F(k + 1), beta=mb.B(k),
                            labels=(f"F{k + 2}", f"B{k + 1}")))
    co.run(beta=mb.B(N - 1), labels=("", f"B{N}"))   # outside no_sync: grads reduced here
    mb.finalize()
    return mb.store


class MicrobatchSteps:
    """megatron's own forward_step and backward_step of micro-batch k, as strand bodies,
    and the bookkeeping megatron's schedules do around them (tokens, finalize)."""

    def __init__(self, forward_step_func, data_iterator, model, num_microbatches,
                 collect_non_loss_data=False, first_val_step=None):
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config, get_model_type
        self.fs, self.data, self.model = forward_step_func, data_iterator, model
        self.n, self.collect, self.first_val = num_microbatches, collect_non_loss_data, \
            first_val_step
        self.config, self.model_type = get_model_config(model), get_model_type(model)
        self.cp = parallel_state.get_context_parallel_world_size()
        self.store, self.outputs = [], {}
        self.tokens = torch.zeros([], dtype=torch.int)

    def F(self, k):
        from megatron.core.pipeline_parallel import schedules as ms

        def run():
            out, ntok = ms.forward_step(
                self.fs, self.data, self.model, self.n, None, self.store, self.config,
                self.cp, self.collect,
                is_first_microbatch=ms.check_first_val_step(self.first_val, False, k == 0),
                current_microbatch=k)
            self.outputs[k] = out
            return ntok
        return run

    def B(self, k):
        from megatron.core.pipeline_parallel import schedules as ms

        def run():
            ms.backward_step(None, self.outputs.pop(k), None, self.model_type, self.config)
        return run

    def count(self, results):
        for ntok in results:
            if ntok is not None:
                self.tokens += ntok.to(self.tokens.device) if torch.is_tensor(ntok) else ntok

    def finalize(self):
        c = self.config
        if c.finalize_model_grads_func is not None:
            c.finalize_model_grads_func([self.model],
                                        self.tokens if c.calculate_per_token_loss else None)


def _default_schedule():
    return DHelixSchedule({"enabled": True})
