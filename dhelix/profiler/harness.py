"""One DHelix layer on the real ranks, ready to time ops, pairs and whole plans.

Shared by `dhelix profile` (op and pair times), `dhelix validate-model` (plans) and
scripts/measure_layer_step.py. Every rank runs the same calls in the same order.
"""
from __future__ import annotations

import statistics
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from dhelix.models.config import ModelConfig
from dhelix.planner.opspec import COMM
from dhelix.planner.plan import Plan, trivial_plan
from dhelix.strand.executor import execute_step, run_layer_step
from dhelix.strand.lanes import make_lanes
from dhelix.strand.state import StrandState


class LayerHarness:
    def __init__(self, m: ModelConfig, tp: int, sp: bool, seq: int, mbs: int,
                 bf16: bool = False, seed: int = 1234, device: Optional[torch.device] = None,
                 ep: int = 1, cp: int = 1, mlp_chunks: int = 1):
        from megatron.core import parallel_state
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer.spec_utils import build_module

        from dhelix.compat import cpu as cpu_compat
        from dhelix.models.gpt import transformer_config
        from dhelix.models.spec import layer_spec
        from dhelix.strand.layer import DHelixLayer

        cpu_compat.apply()
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        # a MoE layer keeps its experts whole (expert-tensor-parallel 1), as DHelix trains it
        etp = 1 if m.num_experts else None
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp,
                                                 context_parallel_size=cp)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        self.device = device or torch.device("cpu")
        self.cfg = transformer_config(m, tp=tp, sequence_parallel=sp, bf16=bf16, ep=ep, etp=etp,
                                      cp=cp)
        # the spec `dhelix train` builds its layers from (train/build.py), on every device:
        # the times are those of the layer that trains
        spec = layer_spec(DHelixLayer, m.num_experts, cp)
        self.layer = build_module(spec, config=self.cfg, layer_number=1).to(self.device)
        self.layer.dhelix_mlp_chunks = mlp_chunks     # before its program is built
        self.program = self.layer.program
        self.ops = self.program.layer_ops(seq, mbs)
        self.seq, self.mbs, self.tp, self.sp, self.ep = seq, mbs, tp, sp and tp > 1, ep
        self.cp = cp
        rope = None
        if m.position_embedding_type == "rope":    # megatron slices it for the CP rank
            rope = RotaryEmbedding(kv_channels=self.cfg.kv_channels, rotary_percent=1.0,
                                   use_cpu_initialization=True)(seq).to(self.device)
        self.meta = {"attention_mask": None, "rotary_pos_emb": rope}
        s_local = seq // cp // tp if self.sp else seq // cp
        g = torch.Generator().manual_seed(seed)
        shape = (s_local, mbs, m.hidden_size)
        self.x = torch.randn(shape, generator=g).to(self.cfg.params_dtype).to(self.device)
        self.g = torch.randn(shape, generator=g).to(self.cfg.params_dtype).to(self.device)
        self.lanes = make_lanes(self.device)
        self._trivial = trivial_plan(self.ops)

    # -- states ------------------------------------------------------------------------------
    def state(self, strand: str) -> StrandState:
        S = StrandState(self.lanes, strand)
        S.meta = self.meta
        return S

    def fwd_state(self, upto: int = 0) -> StrandState:
        """α with its first `upto` forward ops done."""
        S = self.state("α")
        S.put("x", self.x)
        for op in self.program.forward_ops[:upto]:
            execute_step((S, [op]), None)
        return S

    def bwd_state(self, upto: int = 0) -> StrandState:
        """β after its whole forward and its first `upto` backward ops."""
        S = self.state("β")
        S.put("x", self.x)
        run_layer_step(self._trivial, fwd=(self.program, S))
        S.counting = False
        S.put("g_out", self.g)
        for op in self.program.backward_ops[:upto]:
            execute_step(None, (S, [op]))
        return S

    # -- timing ---------------------------------------------------------------------------------
    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    def _max_across_ranks(self, v: float) -> float:
        t = torch.tensor([v], dtype=torch.float64, device=self.device)   # NCCL: on device
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def time_ops(self, f: Optional[int], b: Optional[int], warmup: int, repeats: int) -> float:
        """Median time of forward op #f and/or backward op #b launched together as one
        step (slowest rank)."""
        ts: List[float] = []
        for r in range(warmup + repeats):
            Sa = self.fwd_state(f) if f is not None else None
            Sb = self.bwd_state(b) if b is not None else None
            self._sync()
            t = time.perf_counter()
            execute_step((Sa, [self.program.forward_ops[f]]) if f is not None else None,
                         (Sb, [self.program.backward_ops[b]]) if b is not None else None)
            self._sync_device()
            if r >= warmup:
                ts.append(time.perf_counter() - t)
        return self._max_across_ranks(statistics.median(ts))

    def time_in_step(self, warmup: int, repeats: int):
        """Median duration of every compute op inside whole layer steps (the trivial plan,
        α's forward then β's backward, as `time_plans` runs plans): (forward, backward)
        dicts of seconds, slowest rank. A compute op's time is counted from when the comm
        results it reads had arrived. On CUDA the ops are timed by CUDA events on their
        streams (the host clock would time kernel launches)."""
        from dhelix.strand.trace import Tracer, clock_for
        got: dict = {}
        for r in range(warmup + repeats):
            Sb = self.bwd_state(0)
            Sa = self.fwd_state(0)
            self._sync()
            tracer = Tracer(clock=clock_for(self.lanes))
            run_layer_step(self._trivial, fwd=(self.program, Sa), bwd=(self.program, Sb),
                           tracer=tracer)
            self._sync_device()
            if r >= warmup:
                for e in tracer.events:
                    if e.lane == "compute":
                        got.setdefault((e.strand, e.op), []).append(e.end - e.start)
        med = {k: self._max_across_ranks(statistics.median(v)) for k, v in sorted(got.items())}
        return ({op: v for (s, op), v in med.items() if s == "α"},
                {op: v for (s, op), v in med.items() if s == "β"})

    def time_comm_host(self, warmup: int, repeats: int):
        """The thread's own work for every comm op: the thread CPU seconds of issuing it
        plus those of waiting for it once its data is surely there (on the paced link:
        the shared-memory copy in and the copy or sum out; the sleep until the modelled
        end holds no core and is not counted). Median, slowest rank; (forward, backward)
        dicts. Empty on CUDA: there the host only launches, and the compute stream the
        simulator's thread stands for does not wait for it."""
        if self.device.type == "cuda":
            return {}, {}
        out = []
        for chain, state, idx in ((self.program.forward_ops, self.fwd_state, 0),
                                  (self.program.backward_ops, self.bwd_state, 1)):
            got = {}
            for k, op in enumerate(chain):
                if op.spec.kind != COMM:
                    continue
                ts = []
                for r in range(warmup + repeats):
                    S = state(k)
                    self._sync()
                    c0 = time.thread_time()
                    execute_step((S, [op]) if idx == 0 else None,
                                 (S, [op]) if idx == 1 else None, barrier=False)
                    c1 = time.thread_time()
                    self._sync()          # every rank has issued: the data is there
                    _past_modelled_end()
                    c2 = time.thread_time()
                    S.barrier()
                    c3 = time.thread_time()
                    if r >= warmup:
                        ts.append((c1 - c0) + (c3 - c2))
                got[op.name] = self._max_across_ranks(statistics.median(ts))
            out.append(got)
        return out[0], out[1]

    def time_plans(self, plans: Sequence[Plan], warmup: int, repeats: int,
                   progress=None) -> List[float]:
        """Median layer-step time (α forward ∥ β backward) of each plan; plans are
        interleaved within each repeat so drift hits all alike."""
        times: List[List[float]] = [[] for _ in plans]
        for r in range(warmup + repeats):
            for k, plan in enumerate(plans):
                Sb = self.bwd_state(0)
                Sa = self.fwd_state(0)
                self._sync()
                t = time.perf_counter()
                run_layer_step(plan, fwd=(self.program, Sa), bwd=(self.program, Sb))
                self._sync_device()
                if r >= warmup:
                    times[k].append(time.perf_counter() - t)
            if progress is not None:
                progress.update(1)
        return [self._max_across_ranks(statistics.median(t)) for t in times]

    def _sync_device(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _past_modelled_end() -> None:
    """Sleep until the paced link's last modelled transfer has ended, so that a wait timed
    next only copies or sums: the link's wait spins through the last ~80 µs before the
    modelled end (`links/clock.py`), thread time that is not the collective's own work and
    that the host times once counted (~45 µs a collective here)."""
    from dhelix.links import paced
    link = paced.active()
    if link is not None:
        left = link.in_flight_until() - time.perf_counter()
        if left > 0:
            time.sleep(left)
