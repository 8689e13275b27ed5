"""A transformer layer as two chains of ops (DESIGN §1.1): forward and backward.

Each op is a small function of a `StrandState`. Compute ops that are not GEMMs (norms,
the attention core, activation, bias-dropout-add) build a local autograd graph on
detached inputs in forward and differentiate it in their backward op, so their math is
megatron's own; the linears are explicit GEMMs with the dgrad and wgrad of megatron's
`LinearWithGradAccumulationAndAsyncCommunication`, the wgrad a separate, deferrable op;
TP collectives are explicit comm ops on the lanes, never inside a linear.

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
from dhelix.strand.state import RngStates, StrandState
from dhelix.strand.traced import traced


@dataclass
class Op:
    spec: OpSpec
    run: Callable[[StrandState], None]

    @property
    def name(self):
        return self.spec.name


class _Passthrough(torch.nn.Module):
    """Stands in for a linear so that megatron's SelfAttention runs only its core."""

    def forward(self, x, *args, **kwargs):
        return x, None


def _wgrad(g: torch.Tensor, x: torch.Tensor):
    """megatron's wgrad GEMM: grad_output and input flattened to 2-D."""
    g = g.contiguous()
    x = x.contiguous()
    if g.dim() == 3:
        g = g.view(g.shape[0] * g.shape[1], g.shape[2])
        x = x.view(x.shape[0] * x.shape[1], x.shape[2])
    return g, g.t().matmul(x)


def _part(t: torch.Tensor, tp: int, C: int, c: int) -> torch.Tensor:
    """Chunk c of a gathered tensor in megatron's row order ([s, ...], s = tp·C·m): every
    rank's c-th block of m rows, rank by rank ([tp·m, ...], what chunk c's ops see)."""
    m = t.shape[0] // (tp * C)
    return t.view(tp, C, m, *t.shape[1:])[:, c].reshape(tp * m, *t.shape[1:])


def _join(parts: List[torch.Tensor], tp: int) -> torch.Tensor:
    """The chunks ([tp·m, ...] each) back in megatron's row order ([tp·C·m, ...])."""
    m = parts[0].shape[0] // tp
    rest = parts[0].shape[1:]
    return torch.stack([p.view(tp, m, *rest) for p in parts], 1).reshape(-1, *rest)


def mlp_activation(cfg, x, bias, activation_func):
    """megatron MLP's unfused bias + activation (incl. gated linear units)."""
    if bias is not None:
        x = x + bias
    if cfg.gated_linear_unit:
        x_glu, x_lin = torch.chunk(x, 2, dim=-1)
        val = getattr(cfg, "activation_func_clamp_value", None)
        if val is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_lin = x_lin.clamp(min=-val, max=val)
        return cfg.activation_func(x_glu) * (x_lin + getattr(cfg, "glu_linear_offset", 0.0))
    return activation_func(x)


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


class LayerProgram:
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
        # the forward's gathered inputs kept for the wgrads (`--dhelix-keep-gathered`)
        self.keep_gathered = bool(getattr(layer, "dhelix_keep_gathered", False))
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
                            mlp_chunks=self.chunks, keep_gathered=self.keep_gathered and keep)

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

    # ---- forward compute -------------------------------------------------------------------
    def _local(self, S, key_in, key_graph, fn, owned=False):
        """Run fn on a detached copy of S[key_in] with autograd, keep the local graph
        (none in a recomputed layer's first forward: `StrandState.graphs`)."""
        if not S.graphs:
            return fn(S.get(key_in))
        x = S.get(key_in).detach().requires_grad_()
        y = traced(fn, x, owned=(x,) if owned else ())
        S.put(key_graph, (x, y))
        return y.detach()

    def _ln_attn(self, S):
        S.put("ln1", self._local(S, "x", "g:ln1", self.layer.input_layernorm))

    def _qkv(self, S):
        x = S.get("ln1_full" if self.sp else "ln1")
        out = torch.matmul(x, self.w_qkv.t())
        if self.b_qkv is not None:
            out = out + self.b_qkv
        S.put("qkv", out)
        if "attn" in self.kept:          # for qkv_wgrad, instead of gathering it again
            self._keep_gathered(S, x, "ln1", "g:ln1", "ln1_w")
        S.drop("ln1_full")

    def _attn_core(self, qkv):
        attn = self.attn
        saved = attn.linear_qkv, attn.linear_proj, attn.checkpoint_core_attention
        attn.linear_qkv, attn.linear_proj = _Passthrough(), _Passthrough()
        # selective recompute is the `attn` / `attn_b` ops' own (below): megatron's
        # checkpoint inside the op's local graph would need autograd's .backward()
        attn.checkpoint_core_attention = False
        try:
            out, _ = attn(qkv, attention_mask=self._meta["attention_mask"],
                          rotary_pos_emb=self._meta["rotary_pos_emb"])
        finally:
            attn.linear_qkv, attn.linear_proj, attn.checkpoint_core_attention = saved
        return out

    def _attn(self, S):
        self._meta = S.meta
        if self.selective:
            # selective recompute: no graph now (the executor runs ops without grad), so
            # the core's own saved state is not kept; its input `qkv` is, with the
            # generator states, and `attn_b` runs the core again (megatron's
            # `_checkpointed_attention_forward`)
            S.put("rng:attn", RngStates())
            S.put("core", self._attn_core(S.get("qkv")))
            return
        S.put("core", self._local(S, "qkv", "g:attn", self._attn_core, owned=True))
        S.drop("qkv")

    def _proj(self, S):
        S.put("proj_out" if self.tp > 1 else "attn_out",
              torch.matmul(S.get("core"), self.w_proj.t()))

    def _bda(self, S, key_x, key_res, bias, bda, key_graph):
        x = S.get(key_x).detach().requires_grad_()
        r = S.get(key_res).detach().requires_grad_()
        layer = self.layer
        run = lambda x_: bda(layer.training, self.cfg.bias_dropout_fusion)(  # noqa: E731
            (x_, bias), r, layer.hidden_dropout)
        if not S.graphs:
            S.drop(key_x)
            return run(x)
        y = traced(run, x, owned=(x,))
        S.put(key_graph, (x, r, y))
        S.drop(key_x)
        return y.detach()

    def _bda_attn(self, S):
        S.put("h1", self._bda(S, "attn_out", "x", self.b_proj, self.layer.self_attn_bda,
                              "g:bda1"))

    def _keep_gathered(self, S, full, key_local, key_graph, key_kept):
        """Keep the gathered `full` for the wgrad. Its rows of this rank are the norm's
        output bit for bit (the all-gather copied them), so the norm's output in its local
        graph becomes a view of them and its own storage is freed: the kept tensor costs
        (TP−1)/TP of a gathered input, not a whole one. The graph's backward does not
        read the output's values (a norm saves its input and statistics)."""
        S.put(key_kept, full)
        local = S.get(key_local)
        _, y = S.get(key_graph)
        m = y.shape[0]
        mine = full[self.tp_rank * m:(self.tp_rank + 1) * m]
        if mine.shape != y.shape:
            raise RuntimeError(f"{key_kept}: gathered rows {tuple(mine.shape)} are not the "
                               f"norm's output {tuple(y.shape)}")
        from dhelix.base.memory import METER
        METER.forget(local)           # its storage goes with the last of these references
        y.data = mine
        S.drop(key_local)

    def _ln_mlp(self, S):
        S.put("ln2", self._local(S, "h1", "g:ln2", self.layer.pre_mlp_layernorm))

    def _fc1(self, S):
        x = S.get("ln2_full" if self.sp else "ln2")
        S.put("fc1_out", torch.matmul(x, self.w_fc1.t()))
        if "mlp" in self.kept:           # for fc1_wgrad, instead of gathering it again
            self._keep_gathered(S, x, "ln2", "g:ln2", "ln2_w")
        S.drop("ln2_full")

    def _activation(self, x):
        return mlp_activation(self.cfg, x, self.b_fc1, self.mlp.activation_func)

    def _act(self, S):
        S.put("act", self._local(S, "fc1_out", "g:act", self._activation, owned=True))
        S.drop("fc1_out")

    def _fc2(self, S):
        S.put("fc2_out" if self.tp > 1 else "mlp_out",
              torch.matmul(S.get("act"), self.w_fc2.t()))

    def _bda_mlp(self, S):
        if self.chunks > 1:      # each chunk's reduce-scatter: the rank's rows of it, in order
            keys = [f"mlp_out.{c}" for c in range(self.chunks)]
            S.put("mlp_out", torch.cat([S.get(k) for k in keys]))
            S.drop(*keys)
        S.put("out", self._bda(S, "mlp_out", "h1", self.b_fc2, self.layer.mlp_bda, "g:bda2"))

    # ---- backward compute ------------------------------------------------------------------
    def _grad(self, S, key_graph, g, inputs_extra):
        graph = S.get(key_graph)
        *ins, y = graph
        params = [p for p in inputs_extra if p is not None]
        grads = torch.autograd.grad(y, list(ins) + params, g)
        for p, gp in zip(params, grads[len(ins):]):
            S.acc_grad(p, gp)
        S.drop(key_graph)
        return grads[:len(ins)]

    def _bda_mlp_b(self, S):
        gx, gr = self._grad(S, "g:bda2", S.get("g_out"), [self.b_fc2])
        S.put("g_mlp_out", gx)
        S.put("g_h1_res", gr)
        S.drop("g_out")

    def _fc2_dgrad(self, S):
        g = S.get("g_fc2_out" if self.sp else "g_mlp_out")
        S.put("g_act", g.matmul(self.w_fc2))

    def _fc2_wgrad(self, S):
        if self.chunks > 1:
            keys = [f"act.{c}" for c in range(self.chunks)]
            act = _join([S.get(k) for k in keys], self.tp)
            S.drop(*keys)
        else:
            act = S.get("act")
        _, gw = _wgrad(S.get("g_fc2_out" if self.sp else "g_mlp_out"), act)
        S.acc_grad(self.w_fc2, gw)
        S.drop("act", "g_fc2_out", "g_mlp_out")

    def _act_b(self, S):
        if self.chunks > 1:
            g_act = S.get("g_act")
            g = _join([self._grad(S, f"g:act.{c}", _part(g_act, self.tp, self.chunks, c),
                                  [])[0] for c in range(self.chunks)], self.tp)
            if self.b_fc1 is not None:   # summed over the tokens as autograd's add does
                S.acc_grad(self.b_fc1, g.sum_to_size(self.b_fc1.shape))
        else:
            (g,) = self._grad(S, "g:act", S.get("g_act"), [self.b_fc1])
        S.put("g_fc1_out", g)
        S.drop("g_act")

    def _fc1_dgrad(self, S):
        S.put("g_ln2_full", S.get("g_fc1_out").matmul(self.w_fc1))
        S.consume("g_fc1_out", "fc1_dgrad", ("fc1_dgrad", "fc1_wgrad"))

    def _fc1_wgrad(self, S):
        _, gw = _wgrad(S.get("g_fc1_out"), S.get("ln2_w" if self.sp else "ln2"))
        S.acc_grad(self.w_fc1, gw)
        S.consume("g_fc1_out", "fc1_wgrad", ("fc1_dgrad", "fc1_wgrad"))
        S.drop("ln2_w", "ln2")

    def _ln_mlp_b(self, S):
        (g,) = self._grad(S, "g:ln2", S.get("g_ln2" if self.tp > 1 else "g_ln2_full"),
                          [self.layer.pre_mlp_layernorm.weight,
                           getattr(self.layer.pre_mlp_layernorm, "bias", None)])
        S.put("g_h1", g + S.get("g_h1_res"))
        S.drop("g_ln2", "g_ln2_full", "g_h1_res")

    def _bda_attn_b(self, S):
        gx, gr = self._grad(S, "g:bda1", S.get("g_h1"), [self.b_proj])
        S.put("g_attn_out", gx)
        S.put("g_x_res", gr)
        S.drop("g_h1")

    def _proj_dgrad(self, S):
        g = S.get("g_proj_out" if self.sp else "g_attn_out")
        S.put("g_core", g.matmul(self.w_proj))

    def _proj_wgrad(self, S):
        _, gw = _wgrad(S.get("g_proj_out" if self.sp else "g_attn_out"), S.get("core"))
        S.acc_grad(self.w_proj, gw)
        S.drop("core", "g_proj_out", "g_attn_out")

    def _attn_b(self, S):
        if self.selective:      # the core again, from the same input and generator states
            self._meta = S.meta
            x = S.get("qkv").detach().requires_grad_()
            with S.get("rng:attn").restored():
                y = traced(self._attn_core, x)
            S.put("g:attn", (x, y))
            S.drop("qkv", "rng:attn")
        (g,) = self._grad(S, "g:attn", S.get("g_core"), [])
        S.put("g_qkv", g)
        S.drop("g_core")

    def _qkv_dgrad(self, S):
        S.put("g_ln1_full", S.get("g_qkv").matmul(self.w_qkv))
        S.consume("g_qkv", "qkv_dgrad", ("qkv_dgrad", "qkv_wgrad"))

    def _qkv_wgrad(self, S):
        g2, gw = _wgrad(S.get("g_qkv"), S.get("ln1_w" if self.sp else "ln1"))
        S.acc_grad(self.w_qkv, gw)
        if self.b_qkv is not None:
            S.acc_grad(self.b_qkv, g2.sum(dim=0))
        S.consume("g_qkv", "qkv_wgrad", ("qkv_dgrad", "qkv_wgrad"))
        S.drop("ln1_w", "ln1")

    def _ln_attn_b(self, S):
        (g,) = self._grad(S, "g:ln1", S.get("g_ln1" if self.tp > 1 else "g_ln1_full"),
                          [self.layer.input_layernorm.weight,
                           getattr(self.layer.input_layernorm, "bias", None)])
        S.put("g_x", g + S.get("g_x_res"))
        S.drop("g_ln1", "g_ln1_full", "g_x_res", "x")

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

