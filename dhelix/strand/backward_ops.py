"""The backward ops of a DHelix layer (`strand.program.LayerProgram` binds them to the
planner's chain; DESIGN §1.1): each differentiates a forward op's local graph (`_grad`) or
is one of a linear's two GEMMs, the dgrad and the deferrable wgrad, as megatron's
`LinearWithGradAccumulationAndAsyncCommunication` computes them.

Each `_grad` is one call into autograd's engine, which on a GPU hands the work to its
device thread and waits. A bias-dropout-add without dropout (`_bda_grad`) is added
values only: its gradient is the incoming one, passed to both inputs, and the bias's is
its sum over the tokens (autograd's `sum_to`), so it is written here without the engine.

A chunked MLP's (`--dhelix-mlp-chunks`) tensors are put back in megatron's row order
(`_join`) where a sum runs over the tokens, so that sum is megatron's too.
"""
from __future__ import annotations

from typing import List

import torch

from dhelix.strand.traced import local_grad, traced


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


class BackwardOps:
    """The backward ops of `LayerProgram` (a mixin, as `ForwardOps`)."""

    def _grad(self, S, key_graph, g, inputs_extra):
        graph = S.get(key_graph)
        *ins, y = graph
        params = [p for p in inputs_extra if p is not None]
        grads = local_grad((y,), list(ins) + params, (g,))
        for p, gp in zip(params, grads[len(ins):]):
            S.acc_grad(p, gp)
        S.drop(key_graph)
        return grads[:len(ins)]

    def _bda_grad(self, S, key_graph, g, bias):
        """The bias-dropout-add's backward: the identity when nothing is dropped and no
        dtype changes (what autograd's add and p=0 dropout give, bit for bit), else its
        local graph through the engine."""
        x, r, y = S.get(key_graph)
        plain = ((self.layer.hidden_dropout == 0 or not self.layer.training)
                 and x.dtype == r.dtype == y.dtype == g.dtype and x.shape == r.shape == g.shape
                 and (bias is None or bias.dtype == g.dtype))
        if not plain:
            return self._grad(S, key_graph, g, [bias])
        if bias is not None:
            S.acc_grad(bias, g.sum_to_size(bias.shape))
        S.drop(key_graph)
        return g, g

    def _bda_mlp_b(self, S):
        gx, gr = self._bda_grad(S, "g:bda2", S.get("g_out"), self.b_fc2)
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
        gx, gr = self._bda_grad(S, "g:bda1", S.get("g_h1"), self.b_proj)
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
