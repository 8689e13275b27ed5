"""A realistic layer for planner tests and benchmarks: the canonical TP + sequence-parallel
transformer layer of DESIGN §1.1 (14 forward ops, 18 backward ops), with per-rank FLOP
and byte estimates.

Estimates (s = seq, b = batch, h = hidden, f = ffn, t = tp, d = dtype_bytes):
* GEMMs: 2·rows·in·out FLOPs on all s·b tokens with 1/t of the weight; dgrad and wgrad
  each cost as much as the forward GEMM.  Core attention: 4·b·s²·h/t forward (QKᵀ and
  AV, no causal discount), twice that backward.  Norms, activation, bias-dropout-add:
  a few FLOPs per element on the rank's 1/t share.
* ``comm_bytes`` is the whole collective buffer (see `costmodel`): s·b·h·d for each
  sequence-parallel all-gather / reduce-scatter.
* ``saved_bytes``: what the forward op keeps for backward; the backward op that last
  needs it frees the same amount (wgrad ops free GEMM inputs), so a layer's backward
  frees exactly what its forward saved.  ``temp_bytes``: the op's transient output /
  workspace.
"""
from __future__ import annotations

from dhelix.planner.opspec import COMM, COMPUTE, LayerOps, OpSpec


def tp_sp_layer(hidden: int = 4096, ffn: int = 16384, seq: int = 4096, batch: int = 1,
                heads: int = 32, tp: int = 8, dtype_bytes: int = 2) -> LayerOps:
    h, f, s, b, t, d = hidden, ffn, seq, batch, tp, dtype_bytes
    if h % t or f % t or heads % t or s % t:
        raise ValueError(f"hidden ({h}), ffn ({f}), heads ({heads}) and seq ({s}) must be "
                         f"divisible by tp ({t})")
    tok = s * b                      # tokens in the (gathered) sequence
    act_sp = tok * h // t * d        # a [s/t, b, h] activation (sequence-parallel shard)
    act_full = tok * h * d           # a gathered [s, b, h] activation
    ffn_loc = tok * f // t * d       # a [s, b, f/t] activation
    qkv_out = tok * 3 * h // t * d
    attn_saved = 4 * tok * h // t * d + b * (heads // t) * s * 4   # q, k, v, out + lse (fp32)
    mask = tok * h // t              # dropout mask, 1 byte per element

    g_qkv = 2.0 * tok * h * 3 * h / t
    g_proj = 2.0 * tok * h * h / t
    g_fc1 = 2.0 * tok * h * f / t
    g_fc2 = 2.0 * tok * f * h / t
    attn = 4.0 * b * s * s * h / t
    ln = 8.0 * tok * h / t
    bda = 4.0 * tok * h / t
    act = 8.0 * tok * f / t

    def c(name, flops, saved=0, temp=0, **kw):
        return OpSpec(name, COMPUTE, "compute", flops=float(flops), saved_bytes=float(saved),
                      temp_bytes=float(temp), **kw)

    def m(name, coll, temp):
        return OpSpec(name, COMM, "intra", group="tp", comm_bytes=float(act_full),
                      collective=coll, temp_bytes=float(temp))

    forward = [
        c("ln_attn", ln, saved=act_sp, temp=act_sp),
        m("ag_attn", "all_gather", act_full),
        c("qkv", g_qkv, saved=act_full, temp=qkv_out),
        c("attn", attn, saved=attn_saved, temp=act_sp),
        c("proj", g_proj, saved=act_sp, temp=act_full),
        m("rs_attn", "reduce_scatter", act_sp),
        c("bda_attn", bda, saved=mask, temp=act_sp),
        c("ln_mlp", ln, saved=act_sp, temp=act_sp),
        m("ag_mlp", "all_gather", act_full),
        c("fc1", g_fc1, saved=act_full, temp=ffn_loc),
        c("act", act, saved=ffn_loc, temp=ffn_loc),
        c("fc2", g_fc2, saved=ffn_loc, temp=act_full),
        m("rs_mlp", "reduce_scatter", act_sp),
        c("bda_mlp", bda, saved=mask, temp=act_sp),
    ]
    backward = [
        c("bda_mlp_b", bda, saved=mask, temp=act_sp),
        m("ag_mlp_b", "all_gather", act_full),
        c("fc2_dgrad", g_fc2, temp=ffn_loc),
        c("fc2_wgrad", g_fc2, saved=ffn_loc, wgrad=True, after="fc2_dgrad"),
        c("act_b", act, saved=ffn_loc, temp=ffn_loc),
        c("fc1_dgrad", g_fc1, temp=act_full),
        c("fc1_wgrad", g_fc1, saved=act_full, wgrad=True, after="fc1_dgrad"),
        m("rs_mlp_b", "reduce_scatter", act_sp),
        c("ln_mlp_b", ln, saved=act_sp, temp=act_sp),
        c("bda_attn_b", bda, saved=mask, temp=act_sp),
        m("ag_attn_b", "all_gather", act_full),
        c("proj_dgrad", g_proj, temp=act_sp),
        c("proj_wgrad", g_proj, saved=act_sp, wgrad=True, after="proj_dgrad"),
        c("attn_b", 2 * attn, saved=attn_saved, temp=qkv_out),
        c("qkv_dgrad", g_qkv, temp=act_full),
        c("qkv_wgrad", g_qkv, saved=act_full, wgrad=True, after="qkv_dgrad"),
        m("rs_attn_b", "reduce_scatter", act_sp),
        c("ln_attn_b", ln, saved=act_sp, temp=act_sp),
    ]
    return LayerOps(forward, backward)


# ---- random small layers and tables (tests, fuzzing) --------------------------------------

def random_layer(rng, n_fwd=None, n_bwd=None, groups=None, regathers=False) -> LayerOps:
    """A small random layer: 3-5 forward ops, 3-6 backward ops (some wgrad), comm ops on 1-2
    groups on the intra/inter lanes.  ``rng`` is a `random.Random`. With ``regathers``
    every wgrad op reads a floating comm op (a sequence-parallel re-gather: `after` None,
    `reader` the wgrad), placed before its dgrad as megatron issues it."""
    n_fwd = n_fwd if n_fwd is not None else rng.randint(3, 5)
    n_bwd = n_bwd if n_bwd is not None else rng.randint(3, 6)
    groups = groups if groups is not None else ["tp", "cp"][:rng.randint(1, 2)]
    lane_of = {g: ("intra" if k == 0 else "inter") for k, g in enumerate(groups)}

    def op(prefix, k, allow_wgrad, prev_dgrad):
        u = rng.random()
        if u < 0.4:
            g = rng.choice(groups)
            return OpSpec(f"{prefix}{k}", COMM, lane_of[g], group=g,
                          comm_bytes=float(rng.randint(1, 9) * 1024),
                          collective=rng.choice(["all_gather", "reduce_scatter", "all_reduce"]),
                          temp_bytes=float(rng.randint(0, 4) * 64))
        if allow_wgrad and prev_dgrad is not None and u < 0.65:
            return OpSpec(f"{prefix}{k}_wgrad", COMPUTE, "compute", flops=float(rng.randint(1, 9)),
                          saved_bytes=float(rng.randint(0, 4) * 128),
                          temp_bytes=float(rng.randint(0, 4) * 64),
                          wgrad=True, after=prev_dgrad)
        return OpSpec(f"{prefix}{k}", COMPUTE, "compute", flops=float(rng.randint(1, 9)),
                      saved_bytes=float(rng.randint(0, 4) * 128),
                      temp_bytes=float(rng.randint(0, 4) * 64))

    fwd = [op("f", k, False, None) for k in range(n_fwd)]
    bwd = []
    prev_dgrad = None
    for k in range(n_bwd):
        o = op("b", k, True, prev_dgrad)
        bwd.append(o)
        # a wgrad op sits right after its dgrad: the next op may be a wgrad of this one
        prev_dgrad = o.name if (o.kind == COMPUTE and not o.wgrad) else None
    if regathers:
        for w in [o for o in bwd if o.wgrad]:
            g = rng.choice(groups)
            bwd.insert(next(k for k, o in enumerate(bwd) if o.name == w.after),
                       OpSpec(f"{w.name}_ag", COMM, lane_of[g], group=g,
                              comm_bytes=float(rng.randint(1, 9) * 1024),
                              collective="all_gather", wgrad=True, reader=w.name))
    return LayerOps(fwd, bwd)


def random_table(layer: LayerOps, rng, same_lane_sum: bool = True, host: bool = False):
    """A random, complete CostTable for ``layer``: alone times in [0.1, 2] (some exact
    zeros), pair times between max(T_f, T_b) and 1.3 (T_f + T_b) for ops on different
    lanes, T_f + T_b on the same lane (with ``same_lane_sum``); with ``host``, most comm
    ops get a host time in [0, 0.3] (drawn after the rest: the other entries are those
    of the same rng without it)."""
    from dhelix.planner.costs import CostTable
    t = CostTable.empty(layer, provenance={"source": "random"})
    for o in layer.forward:
        t.alone_f[o.name] = 0.0 if rng.random() < 0.05 else round(rng.uniform(0.1, 2.0), 3)
    for o in layer.backward:
        t.alone_b[o.name] = 0.0 if rng.random() < 0.05 else round(rng.uniform(0.1, 2.0), 3)
    for f in layer.forward:
        for b in layer.backward:
            tf, tb = t.alone_f[f.name], t.alone_b[b.name]
            if f.lane == b.lane and same_lane_sum:
                p = tf + tb
            else:
                p = max(tf, tb) + rng.uniform(0.0, 1.3) * min(tf, tb)
            t.pair[(f.name, b.name)] = p
    if host:
        for ops, out in ((layer.forward, t.host_f), (layer.backward, t.host_b)):
            for o in ops:
                if o.lane != "compute" and rng.random() < 0.8:
                    out[o.name] = round(rng.uniform(0.0, 0.3), 3)
    return t
