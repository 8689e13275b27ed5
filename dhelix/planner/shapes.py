"""FLOP, byte and memory estimates for a layer's ops from its shape (plain arithmetic).

Used to fill OpSpecs so the cost model can price ops for a cluster you do not have, and
so that a plan or table is tied (by the LayerOps signature) to the shape it was made for.
"""
from __future__ import annotations

from dataclasses import replace

from dhelix.planner.opspec import LayerOps


def _sizes(cfg, tp, sp, s, b):
    h = cfg.hidden_size
    hn = cfg.kv_channels or h // cfg.num_attention_heads
    ng = cfg.num_query_groups or cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * ng) * hn
    f1 = cfg.ffn_hidden_size * (2 if cfg.gated_linear_unit else 1)
    dt = 2 if cfg.bf16 or cfg.fp16 else 4
    s_loc = s // tp if sp else s
    return dict(h=h, qkv=qkv, ap=cfg.num_attention_heads * hn, f=cfg.ffn_hidden_size, f1=f1,
                dt=dt, s=s, b=b, tp=tp, s_loc=s_loc)


def op_estimates(cfg, tp, sp, s, b):
    """name -> dict(flops, comm_bytes, saved_bytes) for every op either chain can hold."""
    z = _sizes(cfg, tp, sp, s, b)
    h, dt, T, Tl = z["h"], z["dt"], s * b, z["s_loc"] * b
    qkv, ap, f, f1 = z["qkv"] // tp, z["ap"] // tp, z["f"] // tp, z["f1"] // tp
    g = lambda m, k, n: 2.0 * m * k * n  # noqa: GEMM flops
    attn = 4.0 * T * s * ap                # QK^T and PV
    ew = lambda n: 8.0 * n                 # noqa: elementwise op, a few flops per element
    full = T * h * dt
    e = {
        "ln_attn": (ew(Tl * h), 0, Tl * h * dt), "ln_mlp": (ew(Tl * h), 0, Tl * h * dt),
        "qkv": (g(T, h, qkv), 0, T * qkv * dt), "attn": (attn, 0, T * ap * dt),
        "proj": (g(T, ap, h), 0, 0), "bda_attn": (ew(Tl * h), 0, Tl * h * dt),
        "fc1": (g(T, h, f1), 0, T * f1 * dt), "act": (ew(T * f1), 0, T * f * dt),
        "fc2": (g(T, f, h), 0, 0), "bda_mlp": (ew(Tl * h), 0, 0),
        "bda_mlp_b": (ew(Tl * h), 0, 0), "fc2_dgrad": (g(T, h, f), 0, 0),
        "fc2_wgrad": (g(f, T, h), 0, T * f * dt), "act_b": (ew(T * f1) * 2, 0, T * f1 * dt),
        "fc1_dgrad": (g(T, f1, h), 0, 0), "fc1_wgrad": (g(f1, T, h), 0, Tl * h * dt),
        "ln_mlp_b": (ew(Tl * h) * 2, 0, Tl * h * dt), "bda_attn_b": (ew(Tl * h), 0, Tl * h * dt),
        "proj_dgrad": (g(T, h, ap), 0, 0), "proj_wgrad": (g(h, T, ap), 0, T * ap * dt),
        "attn_b": (2 * attn, 0, T * qkv * dt), "qkv_dgrad": (g(T, qkv, h), 0, 0),
        "qkv_wgrad": (g(qkv, T, h), 0, Tl * h * dt), "ln_attn_b": (ew(Tl * h) * 2, 0, Tl * h * dt),
    }
    for name in ("ag_attn", "rs_attn", "ag_mlp", "rs_mlp", "ag_mlp_b", "rs_mlp_b",
                 "ag_attn_b", "rs_attn_b", "ag_mlp_w", "ag_attn_w"):
        e[name] = (0, full, 0)        # collective buffer size (NCCL's "size")
    for name in ("ar_attn", "ar_mlp", "ar_mlp_b", "ar_attn_b"):
        e[name] = (0, full, 0)
    return e


def estimate_layer_ops(forward_ops, backward_ops, cfg, tp, sp, s, b) -> LayerOps:
    est = op_estimates(cfg, tp, sp, s, b)
    dt = _sizes(cfg, tp, sp, s, b)["dt"]

    def fill(op):
        fl, cb, sb = est[op.name]
        return replace(op.spec, flops=float(fl), comm_bytes=float(cb), saved_bytes=float(sb),
                       temp_bytes=float(cb) if cb else 0.0)
    lo = LayerOps([fill(o) for o in forward_ops], [fill(o) for o in backward_ops])
    lo.shape = {"hidden": cfg.hidden_size, "ffn": cfg.ffn_hidden_size, "seq": s, "mbs": b,
                "tp": tp, "sp": sp, "dtype_bytes": dt}
    return lo
