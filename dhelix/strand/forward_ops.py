"""The forward ops of a DHelix layer (`strand.program.LayerProgram` binds them to the
planner's chain; DESIGN §1.1). Each op reads and writes a `StrandState`.

Compute ops that are not GEMMs (norms, the attention core, activation, bias-dropout-add)
build a local autograd graph on detached inputs (`_local`, `_bda`) that the matching
backward op differentiates, so their math is megatron's own; the linears are plain GEMMs
whose inputs the backward's dgrad/wgrad read. With `--dhelix-keep-gathered` the forward
keeps a column-parallel linear's gathered input for its wgrad (`_keep_gathered`).
"""
from __future__ import annotations

import torch

from dhelix.strand.state import RngStates
from dhelix.strand.traced import traced


class _Passthrough(torch.nn.Module):
    """Stands in for a linear so that megatron's SelfAttention runs only its core."""

    def forward(self, x, *args, **kwargs):
        return x, None


_PASSTHROUGH = _Passthrough()


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


class ForwardOps:
    """The forward ops of `LayerProgram` (a mixin: the program holds the weights, the TP
    group and the chain options these read)."""

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
        # the linears swapped for one pass-through in the module dicts directly (nn.Module's
        # __setattr__ costs ~10 µs a call, six a call here)
        mods, attrs = attn._modules, attn.__dict__
        saved = mods["linear_qkv"], mods["linear_proj"], attrs["checkpoint_core_attention"]
        mods["linear_qkv"] = mods["linear_proj"] = _PASSTHROUGH
        # selective recompute is the `attn` / `attn_b` ops' own (below): megatron's
        # checkpoint inside the op's local graph would need autograd's .backward()
        attrs["checkpoint_core_attention"] = False
        try:
            out, _ = attn(qkv, attention_mask=self._meta["attention_mask"],
                          rotary_pos_emb=self._meta["rotary_pos_emb"])
        finally:
            mods["linear_qkv"], mods["linear_proj"], attrs["checkpoint_core_attention"] = saved
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
