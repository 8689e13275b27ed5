"""FLOP, byte and memory estimates for a layer's ops from its shape (plain arithmetic).

Used to fill OpSpecs so the cost model can price ops for a cluster you do not have, and
so that a plan or table is tied (by the LayerOps signature) to the shape it was made for.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

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
    if getattr(cfg, "num_experts", None):
        e.update(_moe_estimates(cfg, z, Tl, g, ew))
    return e


def _moe_estimates(cfg, z, Tl, g, ew):
    """MoE ops at the *balanced expectation*: every rank sends and receives its Tl local
    tokens × top-k, each expert GEMM sees that many rows (a skewed routing moves more to
    some ranks; a measured table holds what the run saw). Experts are not TP-split."""
    h, dt, E, k = z["h"], z["dt"], cfg.num_experts, cfg.moe_router_topk
    f = cfg.ffn_hidden_size
    f1 = f * (2 if cfg.gated_linear_unit else 1)
    R = Tl * k                                    # routed rows on this rank
    routed = R * h * dt
    fs = getattr(cfg, "moe_shared_expert_intermediate_size", None) or 0
    fs1 = fs * (2 if cfg.gated_linear_unit else 1)
    shared = g(Tl, h, fs1) + g(Tl, fs, h)
    return {
        "shared_experts": (shared, 0, Tl * (h + fs1 + fs) * dt),
        "shared_experts_b": (2 * shared, 0, Tl * (h + fs1 + fs) * dt),
        "router": (g(Tl, h, E), 0, Tl * E * 4), "permute": (ew(R * h), 0, 0),
        "experts_fc1": (g(R, h, f1), 0, R * h * dt), "experts_act": (ew(R * f1), 0, R * f1 * dt),
        "experts_fc2": (g(R, f, h), 0, R * f * dt), "unpermute": (ew(R * h), 0, routed),
        "a2a_dispatch": (0, routed, 0), "a2a_combine": (0, routed, 0),
        "a2a_combine_b": (0, routed, 0), "a2a_dispatch_b": (0, routed, 0),
        "unpermute_b": (ew(R * h) * 2, 0, routed), "experts_fc2_dgrad": (g(R, h, f), 0, 0),
        "experts_fc2_wgrad": (g(f, R, h), 0, R * f * dt),
        "experts_act_b": (ew(R * f1) * 2, 0, R * f1 * dt),
        "experts_fc1_dgrad": (g(R, f1, h), 0, 0), "experts_fc1_wgrad": (g(f1, R, h), 0, R * h * dt),
        "permute_b": (ew(R * h), 0, 0), "router_b": (g(Tl, E, h) * 2, 0, Tl * E * 4),
        "sort_chunks": (ew(R * h), 0, 0), "unsort_chunks": (ew(R * h), 0, 0),
        "sort_chunks_b": (ew(R * h), 0, 0), "unsort_chunks_b": (ew(R * h), 0, 0),
    }


def estimate_layer_ops(forward, backward, cfg, tp, sp, s, b, ep=1) -> LayerOps:
    """Fill the chains' OpSpecs with the estimates for this shape."""
    est = op_estimates(cfg, tp, sp, s, b)
    dt = _sizes(cfg, tp, sp, s, b)["dt"]

    def fill(spec):
        fl, cb, sb = est[spec.name]
        return replace(spec, flops=float(fl), comm_bytes=float(cb), saved_bytes=float(sb),
                       temp_bytes=float(cb) if cb else 0.0)
    lo = LayerOps([fill(o) for o in forward], [fill(o) for o in backward])
    lo.shape = {"hidden": cfg.hidden_size, "ffn": cfg.ffn_hidden_size, "seq": s, "mbs": b,
                "tp": tp, "sp": sp, "dtype_bytes": dt}
    if getattr(cfg, "num_experts", None):
        lo.shape.update(experts=cfg.num_experts, topk=cfg.moe_router_topk, ep=ep,
                        routing="balanced expectation")
    return lo


@dataclass(frozen=True)
class LayerShape:
    """The fields of megatron's TransformerConfig that the estimates read."""
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    kv_channels: Optional[int] = None
    num_query_groups: Optional[int] = None
    gated_linear_unit: bool = False
    bf16: bool = False
    fp16: bool = False
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_shared_expert_intermediate_size: Optional[int] = None

    @staticmethod
    def of(cfg) -> "LayerShape":
        """From a TransformerConfig (a live layer)."""
        return LayerShape(cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size,
                          cfg.kv_channels, cfg.num_query_groups, bool(cfg.gated_linear_unit),
                          bool(cfg.bf16), bool(cfg.fp16), cfg.num_moe_experts,
                          cfg.moe_router_topk, cfg.moe_shared_expert_intermediate_size)

    @staticmethod
    def of_model(m, bf16: bool = False) -> "LayerShape":
        """From a ModelConfig, as megatron's TransformerConfig would fill it."""
        return LayerShape(m.hidden_size, m.num_attention_heads, m.ffn_hidden_size,
                          m.hidden_size // m.num_attention_heads, m.kv_groups,
                          m.activation == "swiglu", bool(bf16), False, m.num_experts,
                          m.moe_router_topk, m.moe_shared_expert_intermediate_size)


def layer_ops_for_shape(model_cfg, tp: int, sequence_parallel: bool, seq_length: int,
                        micro_batch_size: int, bf16: bool = False,
                        lane: str = "intra", ep: int = 1,
                        ep_lane: str = "intra") -> LayerOps:
    """The same LayerOps a live DHelix layer of this shape reports, without building it
    or any process group: for planning and simulating models and clusters you do not
    have (`dhelix plan --config llama-8b --cluster h100`)."""
    from dhelix.planner.chains import layer_chains
    if tp < 1:
        raise ValueError(f"tensor-model-parallel size must be >= 1, got {tp}")
    for field, v in (("num_attention_heads", model_cfg.num_attention_heads),
                     ("ffn_hidden_size", model_cfg.ffn_hidden_size)):
        if v % tp:
            raise ValueError(f"{field} ({v}) is not divisible by TP={tp}")
    g = model_cfg.kv_groups
    if g % tp and tp % g:
        raise ValueError(f"num_query_groups ({g}) and TP={tp} must divide one another")
    sp = bool(sequence_parallel) and tp > 1
    moe = bool(model_cfg.num_experts)
    if moe:
        if tp > 1 and not sp:
            raise ValueError("a MoE layer with TP > 1 needs sequence parallelism (megatron's "
                             "rule): add --sequence-parallel")
        if model_cfg.num_experts % ep:
            raise ValueError(f"num_experts ({model_cfg.num_experts}) is not divisible by "
                             f"EP={ep}")
    elif ep > 1:
        raise ValueError(f"EP={ep} for a model without experts")
    fwd, bwd = layer_chains(tp, sp, lane, moe=moe, ep_lane=ep_lane,
                            shared_experts=bool(model_cfg.moe_shared_expert_intermediate_size))
    return estimate_layer_ops(fwd, bwd, LayerShape.of_model(model_cfg, bf16), tp, sp,
                              seq_length, micro_batch_size, ep)
