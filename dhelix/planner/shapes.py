"""FLOP, byte and memory estimates for a layer's ops from its shape (plain arithmetic).

Used to fill OpSpecs so the cost model can price ops for a cluster you do not have, and
so that a plan or table is tied (by the LayerOps signature) to the shape it was made for.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from dhelix.planner.chains import chunk_of, keep_value, layer_chains
from dhelix.planner.opspec import LayerOps


def _sizes(cfg, tp, sp, s, b, cp=1):
    """Sizes one rank sees. `s` is the global sequence length: with context parallel `cp`
    a rank holds s/cp tokens (`s` in the result), sequence parallel shards those over TP
    (`s_loc`)."""
    h = cfg.hidden_size
    hn = cfg.kv_channels or h // cfg.num_attention_heads
    ng = cfg.num_query_groups or cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * ng) * hn
    f1 = cfg.ffn_hidden_size * (2 if cfg.gated_linear_unit else 1)
    dt = 2 if cfg.bf16 or cfg.fp16 else 4
    s_cp = s // cp
    s_loc = s_cp // tp if sp else s_cp
    return dict(h=h, qkv=qkv, ap=cfg.num_attention_heads * hn, f=cfg.ffn_hidden_size, f1=f1,
                dt=dt, s=s_cp, b=b, tp=tp, s_loc=s_loc, cp=cp, hn=hn,
                heads=cfg.num_attention_heads // tp, kv_heads=max(1, ng // tp))


def op_estimates(cfg, tp, sp, s, b, cp=1):
    """name -> (flops, comm_bytes, saved_bytes) for every op either chain can hold; `s` is
    the global sequence length, each rank works on s/cp of it."""
    z = _sizes(cfg, tp, sp, s, b, cp)
    s = z["s"]
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
    if cp > 1:
        # the attention's inputs are kept by attn_in (q and the own K/V after RoPE), not
        # as the qkv GEMM's output: counting both would save them twice
        e["qkv"] = (e["qkv"][0], 0, 0)
        e.update(_ring_estimates(z, ew))
    return e


def _ring_estimates(z, ew):
    """The ring ops of context parallel `cp` (`chains.ring_chains`), megatron's
    load-balanced layout: the sequence in 2·cp chunks of c tokens, this rank holds two.

    Compute: a c×c block of scores costs 4·b·c²·(heads·hn/tp) (QK^T and PV) and is counted
    whole, also where it is causal (a flash kernel skips the masked half; the CP=1
    estimate counts the full s×s too). Step 0 (own K/V) does 3 blocks (A×A, B×A, B×B),
    every other step 2 (all queries × the block's chunk A, or chunk B × the whole block):
    2·cp+1 blocks, (2·cp+1)/(4·cp) of the CP=1 layer's s×s count divided by cp. Backward
    2× the forward (dQ, dK, dV and the recomputed P), the convention of `attn_b`.
    Messages: one K/V block is K and V of this rank's s/cp tokens; the backward sends the
    own K/V, then K/V with the dK/dV summed so far, then only dK/dV (twice: the last step's
    and the return to the owner), as `models/ring_attention.backward_message` does."""
    C, b, s, dt, hn = z["cp"], z["b"], z["s"], z["dt"], z["hn"]
    T, ap, c = s * b, z["ap"] // z["tp"], s // 2
    block = 4.0 * b * c * c * ap
    kv = 2.0 * T * z["kv_heads"] * hn * dt
    q = T * ap * dt
    lse = T * z["heads"] * 4                  # fp32 log-sum-exp per query row and head
    qkv_elems = T * (ap + 2 * z["kv_heads"] * hn)
    e = {"attn_in": (ew(qkv_elems), 0, q + kv),          # keeps q and the own K/V
         "attn_in_b": (ew(qkv_elems), 0, q + kv),        # frees them
         f"kv_b_{C}": (0, kv, 0)}
    for i in range(C):
        n = 3 if i == 0 else 2
        last = i == C - 1
        # the output (freed by proj_wgrad, as with CP=1) and the log-sum-exp (freed by
        # the last backward step, its last reader)
        e[f"attn_{i}"] = (n * block, 0, q + lse if last else 0)
        e[f"attn_b_{i}"] = (2 * n * block, 0, lse if last else 0)
        if i < C - 1:
            e[f"kv_{i}"] = (0, kv, 0)
        e[f"kv_b_{i}"] = (0, kv if i in (0, C - 1) else 2 * kv, 0)
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


def estimate_layer_ops(forward, backward, cfg, tp, sp, s, b, ep=1, cp=1) -> LayerOps:
    """Fill the chains' OpSpecs with the estimates for this shape (`s`: the global
    sequence length; with context parallel `cp` each rank holds s/cp tokens)."""
    est = op_estimates(cfg, tp, sp, s, b, cp)
    dt = _sizes(cfg, tp, sp, s, b, cp)["dt"]
    # a chunked MLP's op ("fc1.0") does its unchunked op's work over 1/C of the tokens
    chunks = 1 + max([chunk_of(o.name)[1] for o in forward] + [0])

    def fill(spec):
        base, c = chunk_of(spec.name)
        fl, cb, sb = (v / chunks for v in est[base]) if c >= 0 else est[spec.name]
        return replace(spec, flops=float(fl), comm_bytes=float(cb), saved_bytes=float(sb),
                       temp_bytes=float(cb) if cb else 0.0)
    # kept gathers (`chains.kept_gathers`): the gathered input lives from its gather to
    # its wgrad instead of being gathered again; this rank's rows of it are the norm's
    # output, whose own storage is then freed (`LayerProgram._keep_gathered`)
    kept = {"ag_attn": "qkv_wgrad", "ag_mlp": "fc1_wgrad"}
    names = {o.name for o in backward}
    kept = {ag: wg for ag, wg in kept.items()
            if wg in names and f"{ag}_w" not in names and any(o.name == ag for o in forward)}
    full = float(est["ag_attn"][1]) * (1.0 - 1.0 / tp) if kept else 0.0

    def keep(spec):
        if spec.name in kept or spec.name in kept.values():
            return replace(spec, saved_bytes=spec.saved_bytes + full)
        return spec
    lo = LayerOps([keep(fill(o)) for o in forward], [keep(fill(o)) for o in backward])
    lo.shape = {"hidden": cfg.hidden_size, "ffn": cfg.ffn_hidden_size, "seq": s, "mbs": b,
                "tp": tp, "sp": sp, "cp": cp, "dtype_bytes": dt}
    if kept:
        lo.shape["keep_gathered"] = keep_value([ag[len("ag_"):] for ag in kept])
    if getattr(cfg, "num_experts", None):
        lo.shape.update(experts=cfg.num_experts, topk=cfg.moe_router_topk, ep=ep,
                        routing="balanced expectation")
    if chunks > 1:
        lo.shape["mlp_chunks"] = chunks
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
                        ep_lane: str = "intra", cp: int = 1,
                        cp_lane: str = "intra", mlp_chunks: int = 1,
                        keep_gathered=False) -> LayerOps:
    """The same LayerOps a live DHelix layer of this shape reports, without building it
    or any process group: for planning and simulating models and clusters you do not
    have (`dhelix plan --config llama-8b --cluster h100`). `seq_length` is the global
    sequence length; context parallel `cp` > 1 splits it over a ring on `cp_lane`."""
    if tp < 1:
        raise ValueError(f"tensor-model-parallel size must be >= 1, got {tp}")
    check_context_parallel(seq_length, cp)
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
    if cp > 1 and sp and (seq_length // cp) % tp:
        raise ValueError(f"sequence parallel splits each CP rank's {seq_length // cp} tokens "
                         f"(sequence length {seq_length} / CP={cp}) over TP={tp}; choose a "
                         f"sequence length that is a multiple of {2 * cp * tp}, for example")
    check_mlp_chunk_rows(seq_length // cp // tp if sp else seq_length // cp, mlp_chunks)
    fwd, bwd = layer_chains(tp, sp, lane, moe=moe, ep_lane=ep_lane,
                            shared_experts=bool(model_cfg.moe_shared_expert_intermediate_size),
                            cp=cp, cp_lane=cp_lane, mlp_chunks=mlp_chunks,
                            keep_gathered=keep_gathered)
    lo = estimate_layer_ops(fwd, bwd, LayerShape.of_model(model_cfg, bf16), tp, sp,
                            seq_length, micro_batch_size, ep, cp=cp)
    if keep_gathered:
        lo.table_signature = layer_ops_for_shape(
            model_cfg, tp, sequence_parallel, seq_length, micro_batch_size, bf16, lane, ep,
            ep_lane, cp, cp_lane, mlp_chunks).signature()
    return lo


def check_mlp_chunk_rows(rows: int, mlp_chunks: int) -> None:
    """Each chunk of a chunked MLP takes an equal part of a rank's sequence shard."""
    if mlp_chunks > 1 and rows % mlp_chunks:
        raise ValueError(f"MLP chunks ({mlp_chunks}) split each rank's {rows} sequence rows "
                         f"in equal parts: choose a chunk count that divides {rows}, or a "
                         f"sequence length that makes it divide")


def check_context_parallel(seq_length: int, cp: int) -> None:
    """megatron's load-balanced context parallel cuts the sequence into 2·CP equal chunks
    (CP rank r holds chunks r and 2·CP-1-r)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context-parallel size must be an integer >= 1, got {cp!r}")
    if cp > 1 and seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} does not split into 2·CP = {2 * cp} "
                         f"chunks (megatron's load-balanced context parallel); choose a "
                         f"multiple of {2 * cp}")
