"""A transformer layer as two chains of ops (DESIGN §1.1): forward and backward.

Each op is a small function of a `StrandState`. `LayerProgram` binds a function to every
op of the planner's chains (`planner.chains`, one source for both): the compute ops are
in `strand/forward_ops.py` and `strand/backward_ops.py`, the comm ops (TP collectives,
explicit ops on the lanes, never inside a linear) here. The linears' dgrad and wgrad are
megatron's `LinearWithGradAccumulationAndAsyncCommunication`'s, the wgrad a separate,
deferrable op.

With sequence parallel the column-parallel linears keep only their local input for the
weight gradient and gather it again in backward (`ag_*_w`), as megatron does, so
DHelix saves no more activations than megatron. With `--dhelix-keep-gathered` they keep
the forward's gathered input instead and the backward gathers nothing again
(`planner.chains`): the same values, one collective fewer per linear, more memory.

A chunked MLP (`mlp_chunks` C > 1, `planner.chains`) gathers each rank's shard in C row
chunks; chunk c of the gathered tensor holds every rank's c-th part, rank by rank. The
MLP is row-wise and a GEMM's rows do not depend on the others, so each chunk's values are
the unchunked ones; where a sum runs over the tokens (the weight gradient of fc2, the
bias gradient of fc1's activation) the chunks are put back in megatron's row order first
(`_join`), so that sum is megatron's too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List

import torch

from dhelix.planner.chains import layer_chains
from dhelix.planner.opspec import LayerOps, OpSpec
from dhelix.planner.shapes import LayerShape, estimate_layer_ops
from dhelix.strand.backward_ops import BackwardOps
from dhelix.strand.forward_ops import ForwardOps
from dhelix.strand.state import StrandState


@dataclass
class Op:
    spec: OpSpec
    run: Callable[[StrandState], None]

    @property
    def name(self):
        return self.spec.name


def recompute_of(layer):
    """What megatron's recompute settings (the layer's TransformerConfig) make of this
    layer: None, "full" (the node recomputes the whole layer, `strand.node`) or
    "selective" (the attention core, `attn` / `attn_b`). Which layers: `planner.recompute.
    recomputed_layers`, from the layer's index in its model chunk."""
    cfg = layer.config
    g = getattr(cfg, "recompute_granularity", None)
    if g is None:
        return None
    if g == "selective":
        mods = list(cfg.recompute_modules or ["core_attn"])
        if mods != ["core_attn"]:
            raise ValueError(f"DHelix recomputes the attention core only (recompute_modules "
                             f"['core_attn']), not {mods}")
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from dhelix.planner.recompute import recomputed_layers
    vp = getattr(layer, "vp_stage", None)
    offset = get_transformer_layer_offset(cfg, vp_stage=vp)
    return recomputed_layers(g, cfg.recompute_method, cfg.recompute_num_layers,
                             layers_per_chunk(cfg))[layer.layer_number - 1 - offset]


def layers_per_chunk(cfg) -> int:
    """The layers of one model chunk (a pipeline stage's, or its virtual stage's)."""
    pp = max(int(getattr(cfg, "pipeline_model_parallel_size", 1) or 1), 1)
    vpp = max(int(getattr(cfg, "virtual_pipeline_model_parallel_size", None) or 1), 1)
    return max(int(cfg.num_layers) // (pp * vpp), 1)


class LayerProgram(ForwardOps, BackwardOps):
    """The op chains of one DHelix layer, bound to its parameters and TP group."""

    def __init__(self, layer):
        from megatron.core import parallel_state
        from dhelix.strand.lanes import lane_of_group

        self.layer = layer
        cfg = layer.config
        self.cfg = cfg
        self.group = parallel_state.get_tensor_model_parallel_group()
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.sp = bool(cfg.sequence_parallel) and self.tp > 1
        self.lane = lane_of_group(self.group) if self.tp > 1 else "intra"
        attn = layer.self_attention
        self.attn = attn
        self.cp = parallel_state.get_context_parallel_world_size()
        self.ring = None
        if self.cp > 1:     # the attention core is a ring of ops (strand/ring.py)
            from dhelix.strand.ring import RingOps
            self.ring = RingOps(self, parallel_state.get_context_parallel_group())
        self.w_qkv = attn.linear_qkv.weight
        self.b_qkv = None if attn.linear_qkv.skip_bias_add else attn.linear_qkv.bias
        self.w_proj, self.b_proj = attn.linear_proj.weight, attn.linear_proj.bias
        if not attn.linear_proj.skip_bias_add:
            raise ValueError("DHelix layer expects megatron's skip_bias_add linear_proj")
        self._bind_mlp(layer.mlp)
        # chunks of the MLP's forward (`planner.chains`), set on the layer by the schedule
        # (`--dhelix-mlp-chunks`) or the profiler before its program is built
        self.chunks = int(getattr(layer, "dhelix_mlp_chunks", 1) or 1)
        # the forward's gathered inputs kept for the wgrads (`--dhelix-keep-gathered`:
        # True for both parts, or "attn" / "mlp" / "attn,mlp", `chains.keep_parts`)
        self.keep_gathered = getattr(layer, "dhelix_keep_gathered", False) or False
        self.recompute = recompute_of(layer)     # None | "full" | "selective"
        if self.recompute and self.keep_gathered:
            raise ValueError(f"activation recompute ({self.recompute}) saves memory that "
                             f"--dhelix-keep-gathered spends: use one of the two")
        if self.recompute and (self.ring is not None or type(self) is not LayerProgram):
            raise ValueError(f"activation recompute ({self.recompute}) of a DHelix layer with "
                             f"context parallel or MoE is not built: drop the recompute "
                             f"flags (docs/recompute.md)")
        self.selective = self.recompute == "selective"
        self.params: List[torch.nn.Parameter] = [p for p in layer.parameters()]
        self.forward_ops, self.backward_ops = self._build()
        self.fwd: Dict[str, Op] = {o.name: o for o in self.forward_ops}
        self.bwd: Dict[str, Op] = {o.name: o for o in self.backward_ops}

    def _bind_mlp(self, mlp):
        self.mlp = mlp
        self.w_fc1 = mlp.linear_fc1.weight
        self.b_fc1 = mlp.linear_fc1.bias    # skip_bias_add: added by the activation op
        self.w_fc2, self.b_fc2 = mlp.linear_fc2.weight, mlp.linear_fc2.bias
        if not mlp.linear_fc1.skip_bias_add or not mlp.linear_fc2.skip_bias_add:
            raise ValueError("DHelix layer expects megatron's skip_bias_add linears "
                             "(linear_fc1, linear_fc2)")

    # ---- the chains ----------------------------------------------------------------------
    def _build(self):
        """Bind a function to every op of the planner's chains (one source for both)."""
        fwd, bwd = self._chains()
        # the parts whose gathered input the backward keeps: no re-gather in its chain
        names = {o.name for o in fwd} | {o.name for o in bwd}
        self.kept = {p for p in ("attn", "mlp")
                     if self.keep_gathered and f"ag_{p}" in names and f"ag_{p}_w" not in names}
        fns = {
            "ln_attn": self._ln_attn, "qkv": self._qkv, "attn": self._attn, "proj": self._proj,
            "bda_attn": self._bda_attn, "ln_mlp": self._ln_mlp, "fc1": self._fc1,
            "act": self._act, "fc2": self._fc2, "bda_mlp": self._bda_mlp,
            "ag_attn": self._gather("ln1", "ln1_full", "ag_attn"),
            "ag_mlp": self._gather("ln2", "ln2_full", "ag_mlp"),
            "rs_attn": self._rscatter("proj_out", "attn_out", "rs_attn"),
            "rs_mlp": self._rscatter("fc2_out", "mlp_out", "rs_mlp"),
            "ar_attn": self._allreduce("proj_out", "attn_out", "ar_attn"),
            "ar_mlp": self._allreduce("fc2_out", "mlp_out", "ar_mlp"),
            "bda_mlp_b": self._bda_mlp_b, "fc2_dgrad": self._fc2_dgrad,
            "fc2_wgrad": self._fc2_wgrad, "act_b": self._act_b, "fc1_dgrad": self._fc1_dgrad,
            "fc1_wgrad": self._fc1_wgrad, "ln_mlp_b": self._ln_mlp_b,
            "bda_attn_b": self._bda_attn_b, "proj_dgrad": self._proj_dgrad,
            "proj_wgrad": self._proj_wgrad, "attn_b": self._attn_b,
            "qkv_dgrad": self._qkv_dgrad, "qkv_wgrad": self._qkv_wgrad,
            "ln_attn_b": self._ln_attn_b,
            "ag_mlp_b": self._gather("g_mlp_out", "g_fc2_out", "ag_mlp_b"),
            "ag_attn_b": self._gather("g_attn_out", "g_proj_out", "ag_attn_b"),
            "ag_mlp_w": self._gather("ln2", "ln2_w", "ag_mlp_w"),
            "ag_attn_w": self._gather("ln1", "ln1_w", "ag_attn_w"),
            "rs_mlp_b": self._rscatter("g_ln2_full", "g_ln2", "rs_mlp_b"),
            "rs_attn_b": self._rscatter("g_ln1_full", "g_ln1", "rs_attn_b"),
            "ar_mlp_b": self._allreduce("g_ln2_full", "g_ln2", "ar_mlp_b"),
            "ar_attn_b": self._allreduce("g_ln1_full", "g_ln1", "ar_attn_b"),
        }
        fns.update(self._mlp_fns())
        if self.chunks > 1:
            fns.update(self._chunk_fns())
        if self.ring is not None:
            fns.update(self.ring.fns())
        return [Op(o, fns[o.name]) for o in fwd], [Op(o, fns[o.name]) for o in bwd]

    def _chains(self, keep: bool = True):
        """(forward, backward) OpSpecs; `keep=False`: without the kept gathers."""
        return layer_chains(self.tp, self.sp, self.lane, cp=self.cp,
                            cp_lane=self.ring.ring.lane if self.ring else "intra",
                            mlp_chunks=self.chunks, keep_gathered=self.keep_gathered if keep else False)

    def _mlp_fns(self) -> Dict[str, Callable]:
        """Ops of the MLP part beyond the shared ones (none for the dense layer)."""
        return {}

    def _chunk_fns(self) -> Dict[str, Callable]:
        """The chunked MLP's forward ops (`planner.chains`): chunk c gathers rows
        [c·m, (c+1)·m) of every rank's shard."""
        C = self.chunks
        fns = {}
        for c in range(C):
            def gather(S, c=c):
                x = S.get("ln2")
                m = x.shape[0] // C
                S.put(f"ln2_full.{c}", S.lanes.all_gather(f"ag_mlp.{c}", x[c * m:(c + 1) * m],
                                                         self.group, self.lane))

            def fc1(S, c=c):
                S.put(f"fc1_out.{c}", torch.matmul(S.get(f"ln2_full.{c}"), self.w_fc1.t()))
                S.drop(f"ln2_full.{c}")

            def act(S, c=c):
                S.put(f"act.{c}", self._local(S, f"fc1_out.{c}", f"g:act.{c}",
                                              self._activation, owned=True))
                S.drop(f"fc1_out.{c}")

            def fc2(S, c=c):
                S.put(f"fc2_out.{c}", torch.matmul(S.get(f"act.{c}"), self.w_fc2.t()))
            fns.update({f"ag_mlp.{c}": gather, f"fc1.{c}": fc1, f"act.{c}": act,
                        f"fc2.{c}": fc2,
                        f"rs_mlp.{c}": self._rscatter(f"fc2_out.{c}", f"mlp_out.{c}",
                                                      f"rs_mlp.{c}")})
        return fns

    # ---- comm ops ------------------------------------------------------------------------
    def _gather(self, src, dst, op):
        def run(S):
            S.put(dst, S.lanes.all_gather(op, S.get(src), self.group, self.lane))
        return run

    def _rscatter(self, src, dst, op):
        def run(S):
            S.put(dst, S.lanes.reduce_scatter(op, S.get(src), self.group, self.lane))
            S.drop(src)
        return run

    def _allreduce(self, src, dst, op):
        def run(S):
            S.put(dst, S.lanes.all_reduce(op, S.get(src), self.group, self.lane))
            S.drop(src)
        return run

    # ---- plain-data view ----------------------------------------------------------------------
    def layer_ops(self, seq_length: int, micro_batch_size: int) -> LayerOps:
        """OpSpecs with FLOP/byte estimates for this layer at a given input shape; the
        signature ties plans and tables to the shape, dtype and parallel sizes."""
        from dhelix.planner.shapes import check_mlp_chunk_rows
        check_mlp_chunk_rows(seq_length // self.cp // (self.tp if self.sp else 1), self.chunks)

        def estimate(fwd, bwd):
            return estimate_layer_ops(fwd, bwd, LayerShape.of(self.cfg), self.tp, self.sp,
                                      seq_length, micro_batch_size, getattr(self, "ep", 1),
                                      cp=self.cp)
        lo = estimate([o.spec for o in self.forward_ops], [o.spec for o in self.backward_ops])
        if self.kept:        # its table is the one of the layer that gathers again
            lo.table_signature = estimate(*self._chains(keep=False)).signature()
        return lo

