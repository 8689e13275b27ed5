"""The MoE layer as op chains: megatron-core's MoE block (router, all-to-all token
dispatcher, `SequentialMLP` experts) taken apart into DHelix ops.

The attention half is the dense layer's (`LayerProgram`). The MLP half runs megatron's
own pieces on local autograd graphs — `MoELayer.route`, the dispatcher's
`dispatch_preprocess` (permute), `dispatch_postprocess` (sort by local expert),
`combine_preprocess` (unsort) and `combine_postprocess` (unpermute) — while the two
all-to-alls are comm ops on the EP group's lane and the experts' GEMMs are explicit, with
each expert's dgrad and wgrad apart, as megatron's linears compute them.

The dispatcher keeps a micro-batch's routing (splits, permutation) on itself between
those calls. One strand runs a layer's forward at a time, but the other strand's forward
of the same layer may come before this one's backward, so what the later ops need is
snapshotted into the strand's state after permute and put back before each later call.

The dispatcher copies its counts (split sizes, tokens per expert) to the host without
blocking at its dtoh point, inside `dispatch_preprocess`, and synchronizes the event it
records after them (`d2h_event`) at its sync point: with EP > 1 that is
`before_ep_alltoall`, inside `token_dispatch`, which DHelix replaces by `a2a_dispatch`;
so `a2a_dispatch` synchronizes it (`_d2h_synchronize`) before any count is read. The
event is part of the strand's snapshot, since the other strand's permute records its own.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.distributed as dist

from dhelix.compat.cpu import D2H_POISON
from dhelix.planner.chains import layer_chains
from dhelix.strand.backward_ops import _wgrad
from dhelix.strand.forward_ops import mlp_activation
from dhelix.strand.program import LayerProgram
from dhelix.strand.traced import local_grad, traced

# the dispatcher's per-micro-batch routing, set by dispatch_preprocess
_ROUTING = ("hidden_shape", "probs", "routing_map", "tokens_per_expert",
            "hidden_shape_before_permute", "reversed_local_input_permutation_mapping",
            "input_splits", "output_splits", "output_splits_tp",
            "num_global_tokens_per_local_expert", "num_out_tokens", "d2h_event")


class MoEProgram(LayerProgram):
    """Op chains of a DHelix layer whose MLP is megatron's MoELayer (all-to-all)."""

    def _bind_mlp(self, moe):
        from dhelix.strand.lanes import lane_of_group
        # (the Megatron-LM path refuses these by flag before training: megatron/args.py)
        if self.cp > 1:
            raise ValueError("DHelix MoE layer: context parallel is not supported yet "
                             "(drop --context-parallel-size)")
        self.mlp = moe
        self.moe = moe
        self.disp = moe.token_dispatcher
        cfg = moe.config
        if cfg.moe_token_dispatcher_type != "alltoall":
            raise ValueError("DHelix MoE layer: the all-to-all token dispatcher only "
                             f"(moe_token_dispatcher_type is {cfg.moe_token_dispatcher_type}; "
                             f"pass --moe-token-dispatcher-type alltoall)")
        if self.disp.tp_size > 1:
            raise ValueError("DHelix MoE layer: experts split over TP are not supported; "
                             "use --expert-tensor-parallel-size 1")
        self.shared = bool(getattr(moe, "use_shared_expert", False))
        if self.shared and (moe.shared_expert_overlap or moe.shared_experts.use_shared_expert_gate):
            raise ValueError("DHelix MoE layer: shared experts with megatron's own overlap "
                             "or a gate are not supported (drop --moe-shared-expert-overlap "
                             "and --moe-shared-expert-gate)")
        if self.disp.drop_and_pad or cfg.moe_expert_capacity_factor is not None:
            raise ValueError("DHelix MoE layer: token dropping (capacity factor) is not "
                             "supported (drop --moe-expert-capacity-factor and "
                             "--moe-pad-expert-input-to-capacity)")
        if getattr(cfg, "moe_apply_probs_on_input", False):
            # megatron's SequentialMLP then weighs the input and multiplies the activation
            # by ones: experts_act would weigh the activation instead, silently otherwise
            raise ValueError("DHelix MoE layer: routing weights applied on the expert input "
                             "are not supported (drop --moe-apply-probs-on-input)")
        self.ep_group = self.disp.ep_group
        self.ep = dist.get_world_size(self.ep_group)
        self.ep_lane = lane_of_group(self.ep_group) if self.ep > 1 else "intra"
        experts = list(moe.experts.local_experts)
        self.w1 = [e.linear_fc1.weight for e in experts]
        self.w2 = [e.linear_fc2.weight for e in experts]
        if not all(e.linear_fc1.skip_bias_add and e.linear_fc2.skip_bias_add
                   for e in experts):
            raise ValueError("DHelix MoE layer expects megatron's skip_bias_add expert "
                             "linears (linear_fc1, linear_fc2)")
        # Expert biases (add_bias_linear, as GPT-OSS): megatron's expert MLP adds fc1's
        # before the activation and fc2's times the routing weight onto the output (the
        # MoE block then returns no bias). None without add_bias_linear.
        self.b1 = [e.linear_fc1.bias for e in experts]
        self.b2 = [e.linear_fc2.bias for e in experts]
        self.fc2_bias = any(b is not None for b in self.b2)
        self.b_fc2 = None                     # the MoE block returns no bias
        self.router_params = [p for p in moe.router.parameters() if p.requires_grad]

    def _chains(self, keep: bool = True):
        return layer_chains(self.tp, self.sp, self.lane, moe=True, ep_lane=self.ep_lane,
                            shared_experts=self.shared, mlp_chunks=self.chunks,
                            keep_gathered=self.keep_gathered if keep else False)

    def _mlp_fns(self) -> Dict[str, Callable]:
        return {
            "router": self._router, "permute": self._permute,
            "a2a_dispatch": self._a2a_dispatch, "sort_chunks": self._sort_chunks,
            "experts_fc1": self._experts_fc1, "experts_act": self._experts_act,
            "experts_fc2": self._experts_fc2, "unsort_chunks": self._unsort_chunks,
            "a2a_combine": self._a2a_combine, "unpermute": self._unpermute,
            "unpermute_b": self._unpermute_b, "a2a_combine_b": self._a2a_combine_b,
            "unsort_chunks_b": self._unsort_chunks_b,
            "experts_fc2_dgrad": self._experts_fc2_dgrad,
            "experts_fc2_wgrad": self._experts_fc2_wgrad,
            "experts_act_b": self._experts_act_b,
            "experts_fc1_dgrad": self._experts_fc1_dgrad,
            "experts_fc1_wgrad": self._experts_fc1_wgrad,
            "sort_chunks_b": self._sort_chunks_b, "a2a_dispatch_b": self._a2a_dispatch_b,
            "permute_b": self._permute_b, "router_b": self._router_b,
            "ln_mlp_b": self._moe_ln_mlp_b,
            "shared_experts": self._shared, "shared_experts_b": self._shared_b,
        }

    # ---- helpers ---------------------------------------------------------------------------
    def _graph(self, S, inputs, key_graph, fn):
        """fn(*inputs) on detached leaves of `inputs` (tensors, or keys of S) with
        autograd; the outputs (a tuple) are kept as the local graph and returned
        detached. Outputs that need no grad (the routing map) pass through."""
        xs = tuple((S.get(k) if isinstance(k, str) else k).detach().requires_grad_()
                   for k in inputs)
        ys = traced(lambda a: fn(*a), xs)
        ys = ys if isinstance(ys, tuple) else (ys,)
        S.put(key_graph, (xs, ys))
        return tuple(y.detach() for y in ys)

    def _graph_grad(self, S, key_graph, grads, params=()):
        """The local graph's input grads for output grads `grads` (None: no grad);
        the grads of `params` go to the strand's accumulation."""
        xs, ys = S.get(key_graph)
        outs = [(y, g) for y, g in zip(ys, grads) if y.requires_grad and g is not None]
        params = [p for p in params if p is not None]
        res = local_grad([y for y, _ in outs], list(xs) + params, [g for _, g in outs],
                         allow_unused=True)
        for p, gp in zip(params, res[len(xs):]):
            if gp is not None:
                S.acc_grad(p, gp)
        S.drop(key_graph)
        return [g if g is not None else torch.zeros_like(x) for g, x in zip(res[:len(xs)], xs)]

    def _restore(self, S):
        for k, v in S.get("moe_routing").items():
            setattr(self.disp, k, v)

    def _quiesce_tp(self, S):
        """The shared experts are megatron's MLP: with TP its linears run their own
        collectives on the TP group, which must not race a lane's TP comm (strict.py)."""
        if self.tp > 1:
            S.lanes.quiesce(self.group)

    def _d2h_synchronize(self, S, point):
        """megatron's `_maybe_dtoh_and_synchronize(point)` for this strand's host copies:
        wait for the event recorded after them if `point` is the dispatcher's sync point.
        Sync points inside `dispatch_preprocess` / `dispatch_postprocess` megatron keeps
        itself (on the event `_restore` puts back); this one DHelix took apart."""
        ev = S.get("moe_routing").get("d2h_event")
        if ev is not None and getattr(self.disp, "cuda_sync_point", None) == point:
            ev.synchronize()

    @staticmethod
    def _host_counts(op, what, values):
        """Counts the dispatcher copied to the host, as ints; its strict-mode poison
        (compat/cpu.py) means they were read before the copy was known done."""
        values = [int(v) for v in values]
        if D2H_POISON in values:
            raise RuntimeError(
                f"{op}: {what} read on the host before the device-to-host copy's event "
                f"(the MoE dispatcher's d2h_event) was synchronized: they hold the "
                f"DHELIX_LANES=strict poison {D2H_POISON} ({values})")
        return values

    def _a2a(self, S, op, key, out_splits, in_splits):
        if self.ep == 1:
            return S.get(key)
        return S.lanes.all_to_all(op, S.get(key),
                                  self._host_counts(op, "all-to-all split sizes", out_splits),
                                  self._host_counts(op, "all-to-all split sizes", in_splits),
                                  self.ep_group, self.ep_lane)

    def _split(self, S, t, op):
        if len(self.w1) == 1:
            return [t]
        return list(torch.split(t, self._host_counts(op, "tokens_per_expert",
                                                     S.get("moe_tpe"))))

    # ---- forward ---------------------------------------------------------------------------
    def _router(self, S):
        probs, rmap = self._graph(S, ("ln2",), "g:router", self.moe.route)
        S.put("moe_probs", probs)
        S.put("moe_map", rmap)

    def _shared(self, S):
        self._quiesce_tp(S)
        (out,) = self._graph(S, ("ln2",), "g:shared", lambda x: (self.moe.shared_experts(x),))
        S.put("moe_shared", out)

    def _permute(self, S):
        rmap = S.get("moe_map")
        tokens, pprobs = self._graph(
            S, ("ln2", "moe_probs"), "g:permute",
            lambda x, p: self.disp.dispatch_preprocess(x, rmap, p))
        S.put("moe_routing", {k: getattr(self.disp, k, None) for k in _ROUTING})
        S.put("moe_tokens", tokens)
        S.put("moe_pprobs", pprobs)
        S.drop("moe_probs", "moe_map")
        if not self.shared:
            S.drop("ln2")

    def _a2a_dispatch(self, S):
        self._d2h_synchronize(S, "before_ep_alltoall")      # token_dispatch's, EP > 1
        r = S.get("moe_routing")
        S.put("moe_gtokens", self._a2a(S, "a2a_dispatch", "moe_tokens", r["output_splits"],
                                       r["input_splits"]))
        S.put("moe_gprobs", self._a2a(S, "a2a_dispatch", "moe_pprobs", r["output_splits"],
                                      r["input_splits"]))
        S.drop("moe_tokens", "moe_pprobs")

    def _sort_chunks(self, S):
        self._restore(S)
        out = {}

        def fn(t, p):
            tokens, tpe, probs = self.disp.dispatch_postprocess(t, p)
            out["tpe"] = tpe
            return tokens, probs
        # tokens_per_expert (and the counts the sort reads) are host copies too. With
        # EP > 1 the sync point stays before_ep_alltoall even with several local experts,
        # so dispatch_postprocess does not synchronize: this strand's a2a_dispatch, an
        # earlier op, did. With EP = 1 dispatch_postprocess does (before_permutation_2 or
        # before_finish), on this strand's event, which _restore put back.
        tokens, probs = self._graph(S, ("moe_gtokens", "moe_gprobs"), "g:sort", fn)
        tpe = out["tpe"]
        S.put("moe_tpe", self._host_counts(
            "sort_chunks", "tokens_per_expert", tpe.tolist() if torch.is_tensor(tpe) else tpe))
        S.put("moe_etokens", tokens)
        S.put("moe_eprobs", probs)
        S.drop("moe_gtokens", "moe_gprobs")

    def _experts_fc1(self, S):
        xs = self._split(S, S.get("moe_etokens"), "experts_fc1")
        S.put("moe_fc1", [torch.matmul(x, w.t()) for x, w in zip(xs, self.w1)])

    def _act_one(self, x, b, probs):
        """megatron MLP's unfused activation (fc1's bias `b`, if any, added first), then
        the per-token routing weight."""
        y = mlp_activation(self.cfg, x, b, self.cfg.activation_func)
        return (y * probs.unsqueeze(-1)).to(y.dtype)

    def _experts_act(self, S):
        """One local graph over every local expert: (fc1 outputs..., routing weights);
        fc1's biases are its parameters (their grads go to the strand in experts_act_b)."""
        n = len(self.w1)

        def fn(*a):
            ps = self._split(S, a[n], "experts_act")
            return tuple(self._act_one(x, b, p) for x, b, p in zip(a[:n], self.b1, ps))
        acts = self._graph(S, [*S.get("moe_fc1"), "moe_eprobs"], "g:experts_act", fn)
        S.put("moe_act", list(acts))
        S.drop("moe_fc1")
        if not self.fc2_bias:               # else experts_fc2 weighs its bias by them
            S.drop("moe_eprobs")

    def _experts_fc2(self, S):
        outs = [torch.matmul(a, w.t()) for a, w in zip(S.get("moe_act"), self.w2)]
        if self.fc2_bias:
            # megatron's expert MLP: `output += output_bias.unsqueeze(0) *
            # per_token_scale.unsqueeze(-1)`. The product is a local graph over the routing
            # weights (fc2's biases its parameters); the in-place add, as megatron's,
            # rounds to the output's dtype and passes the output grad through unchanged.
            def fn(p):
                ps = self._split(S, p, "experts_fc2")
                return tuple(b.unsqueeze(0) * q.unsqueeze(-1) for b, q in zip(self.b2, ps))
            terms = self._graph(S, ("moe_eprobs",), "g:experts_bias", fn)
            for o, t in zip(outs, terms):
                o += t
            S.drop("moe_eprobs")
        S.put("moe_eout", torch.cat(outs, dim=0) if len(outs) > 1 else outs[0])

    def _unsort_chunks(self, S):
        self._restore(S)
        (out,) = self._graph(S, ("moe_eout",), "g:unsort",
                             lambda t: (self.disp.combine_preprocess(t),))
        S.put("moe_cout", out)
        S.drop("moe_eout")

    def _a2a_combine(self, S):
        r = S.get("moe_routing")
        S.put("moe_ctokens", self._a2a(S, "a2a_combine", "moe_cout", r["input_splits"],
                                       r["output_splits"]))
        S.drop("moe_cout")

    def _unpermute(self, S):
        self._restore(S)
        (out,) = self._graph(S, ("moe_ctokens",), "g:unpermute",
                             lambda t: (self.disp.combine_postprocess(t),))
        if self.shared:                      # megatron: output + shared_expert_output
            out = out + S.get("moe_shared")
            S.drop("moe_shared")
        S.put("mlp_out", out)
        S.drop("moe_ctokens")

    # ---- backward --------------------------------------------------------------------------
    def _unpermute_b(self, S):
        (g,) = self._graph_grad(S, "g:unpermute", [S.get("g_mlp_out")])
        S.put("g_moe_ctokens", g)
        if not self.shared:
            S.drop("g_mlp_out")

    def _shared_b(self, S):
        self._quiesce_tp(S)
        (g,) = self._graph_grad(S, "g:shared", [S.get("g_mlp_out")],
                                list(self.moe.shared_experts.parameters()))
        S.put("g_ln2_shared", g)
        S.drop("g_mlp_out")

    def _a2a_combine_b(self, S):
        r = S.get("moe_routing")
        S.put("g_moe_cout", self._a2a(S, "a2a_combine_b", "g_moe_ctokens",
                                      r["output_splits"], r["input_splits"]))
        S.drop("g_moe_ctokens")

    def _unsort_chunks_b(self, S):
        (g,) = self._graph_grad(S, "g:unsort", [S.get("g_moe_cout")])
        S.put("g_moe_eout", self._split(S, g, "unsort_chunks_b"))
        S.drop("g_moe_cout")

    def _experts_fc2_dgrad(self, S):
        S.put("g_moe_act", [g.matmul(w) for g, w in zip(S.get("g_moe_eout"), self.w2)])
        if self.fc2_bias:
            # the bias term's grads: the routing weights' part (added to the activation's
            # in experts_act_b) and fc2's biases' (to the strand)
            (gp,) = self._graph_grad(S, "g:experts_bias", S.get("g_moe_eout"), self.b2)
            S.put("g_moe_eprobs_bias", gp)

    def _experts_fc2_wgrad(self, S):
        for g, a, w in zip(S.get("g_moe_eout"), S.get("moe_act"), self.w2):
            S.acc_grad(w, _wgrad(g, a)[1])
        S.drop("g_moe_eout", "moe_act")

    def _experts_act_b(self, S):
        grads = self._graph_grad(S, "g:experts_act", S.get("g_moe_act"), self.b1)
        S.put("g_moe_fc1", grads[:-1])
        g_probs = grads[-1]
        if self.fc2_bias:
            # Each expert's routing weights feed its activation and its fc2 bias term;
            # megatron's autograd sums the two grads per expert before the split's
            # backward concatenates them: summing the concatenations elementwise is the
            # same. The bias term is the later node, so its grad arrives first in
            # autograd's buffer: bias + activation (a sum of two is commutative in IEEE
            # arithmetic anyway).
            g_probs = S.get("g_moe_eprobs_bias") + g_probs
            S.drop("g_moe_eprobs_bias")
        S.put("g_moe_eprobs", g_probs)
        S.drop("g_moe_act")

    def _experts_fc1_dgrad(self, S):
        gs = [g.matmul(w) for g, w in zip(S.get("g_moe_fc1"), self.w1)]
        S.put("g_moe_etokens", torch.cat(gs, dim=0) if len(gs) > 1 else gs[0])
        S.consume("g_moe_fc1", "experts_fc1_dgrad", ("experts_fc1_dgrad", "experts_fc1_wgrad"))

    def _experts_fc1_wgrad(self, S):
        xs = self._split(S, S.get("moe_etokens"), "experts_fc1_wgrad")
        for g, x, w in zip(S.get("g_moe_fc1"), xs, self.w1):
            S.acc_grad(w, _wgrad(g, x)[1])
        S.consume("g_moe_fc1", "experts_fc1_wgrad", ("experts_fc1_dgrad", "experts_fc1_wgrad"))
        S.drop("moe_etokens")

    def _sort_chunks_b(self, S):
        gt, gp = self._graph_grad(S, "g:sort", [S.get("g_moe_etokens"), S.get("g_moe_eprobs")])
        S.put("g_moe_gtokens", gt)
        S.put("g_moe_gprobs", gp)
        S.drop("g_moe_etokens", "g_moe_eprobs")

    def _a2a_dispatch_b(self, S):
        r = S.get("moe_routing")
        S.put("g_moe_tokens", self._a2a(S, "a2a_dispatch_b", "g_moe_gtokens",
                                        r["input_splits"], r["output_splits"]))
        S.put("g_moe_pprobs", self._a2a(S, "a2a_dispatch_b", "g_moe_gprobs",
                                        r["input_splits"], r["output_splits"]))
        S.drop("g_moe_gtokens", "g_moe_gprobs")

    def _permute_b(self, S):
        gx, gp = self._graph_grad(S, "g:permute", [S.get("g_moe_tokens"),
                                                   S.get("g_moe_pprobs")])
        S.put("g_ln2_perm", gx)
        S.put("g_moe_probs", gp)
        S.drop("g_moe_tokens", "g_moe_pprobs", "moe_routing")

    def _router_b(self, S):
        (gx,) = self._graph_grad(S, "g:router", [S.get("g_moe_probs")], self.router_params)
        S.put("g_ln2_router", gx)
        S.drop("g_moe_probs")

    def _moe_ln_mlp_b(self, S):
        # the norm's output fed the router and the permute (and the shared experts): its
        # grad is their sum, in the order megatron's autograd adds them
        g = S.get("g_ln2_perm") + S.get("g_ln2_router")
        if self.shared:
            g = g + S.get("g_ln2_shared")
        S.drop("g_ln2_perm", "g_ln2_router", "g_ln2_shared")
        (gx,) = self._grad(S, "g:ln2", g.view(S.get("g_h1_res").shape),
                           [self.layer.pre_mlp_layernorm.weight,
                            getattr(self.layer.pre_mlp_layernorm, "bias", None)])
        S.put("g_h1", gx + S.get("g_h1_res"))
        S.drop("g_h1_res")
