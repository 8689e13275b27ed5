"""The op chains of a transformer layer (DESIGN §1.1) as plain data.

One source for the runtime (`strand.program` binds a function to every name here) and for
the planner, which plans models it cannot build (`shapes.layer_ops_for_shape`).

The backward runs in megatron's order: a column-parallel linear's input is re-gathered
(sequence parallel) before its dgrad, the input gradient's reduce-scatter (or all-reduce)
starts after the dgrad, and the wgrad runs beside it. Wgrad ops and the re-gathers they
need are `wgrad=True`, free to move within a node's backward: a wgrad op to any point
after its `after` op (its dgrad), a re-gather (`after` None: its input was saved by the
forward) to any point before its `reader`, the wgrad. A plan may run β in such an order
(`Plan.backward`, chosen by the planner: `dp.plan(reorder=True)`), so a re-gather can
fill the link while the strands compute.

With `keep_gathered` the forward's gathered input of each column-parallel linear is kept
for its wgrad and the backward re-gathers it not (no `ag_attn_w`, `ag_mlp_w`): one
collective of five fewer per linear pair, for a gathered tensor (s·b·h) held per layer
and micro-batch from the forward to the wgrad instead of the 1/TP shard — a
memory-for-comm trade megatron does not make. The MLP's input is kept only where its
forward gathers it in one piece (not chunked, not MoE). `keep_gathered` may name the parts
("attn", "mlp", or both: `keep_parts`) for half the memory and half the comm saved.
"""
from __future__ import annotations

from typing import List, Tuple

from dhelix.planner.opspec import COMM, COMPUTE, OpSpec


def layer_chains(tp: int, sp: bool, lane: str = "intra", moe: bool = False,
                 ep_lane: str = "intra",
                 shared_experts: bool = False, cp: int = 1,
                 cp_lane: str = "intra",
                 mlp_chunks: int = 1,
                 keep_gathered=False) -> Tuple[List[OpSpec], List[OpSpec]]:
    """(forward, backward) OpSpecs of a layer with TP `tp` (sequence parallel `sp`); TP
    collectives run on `lane` (intra or inter, by the TP group's node membership). With
    `moe` the MLP is megatron's MoE block with the all-to-all dispatcher (experts not
    TP-split: expert-tensor-parallel 1), its all-to-alls on `ep_lane`. With context
    parallel `cp` > 1 the attention core is a ring (`ring_chains`) on `cp_lane`. With
    `mlp_chunks` > 1 the dense MLP's forward runs in that many token chunks; with
    `keep_gathered` (True, or the parts: `keep_parts`) the backward re-gathers nothing
    the forward gathered for those parts (module doc)."""
    sp = sp and tp > 1
    check_mlp_chunks(mlp_chunks, sp, moe)
    check_keep_gathered(keep_gathered, sp)
    kept = kept_gathers(keep_gathered, sp, moe, mlp_chunks)

    def C(name, **kw):
        return OpSpec(name, COMPUTE, "compute", **kw)

    def M(name, coll, **kw):
        return OpSpec(name, COMM, lane, group="tp", collective=coll, **kw)

    def reduce_out(part, suffix=""):
        """Row-parallel output: reduce-scatter with SP, all-reduce with plain TP."""
        if sp:
            return [M(f"rs_{part}{suffix}", "reduce_scatter")]
        return [M(f"ar_{part}{suffix}", "all_reduce")] if tp > 1 else []

    def gather(name, **kw):
        return [M(name, "all_gather", **kw)] if sp else []

    f_core, b_core = ring_chains(cp, cp_lane) if cp > 1 else ([C("attn")], [C("attn_b")])
    f_attn = [C("ln_attn"), *gather("ag_attn"), C("qkv"), *f_core, C("proj"),
              *reduce_out("attn"), C("bda_attn")]
    if mlp_chunks > 1:
        ch = range(mlp_chunks)
        mlp = [M(f"ag_mlp.{c}", "all_gather", reader=f"fc1.{c}") for c in ch]
        for c in ch:
            mlp += [C(f"fc1.{c}"), C(f"act.{c}"), C(f"fc2.{c}"),
                    M(f"rs_mlp.{c}", "reduce_scatter", reader="bda_mlp")]
    else:
        mlp = [*gather("ag_mlp"), C("fc1"), C("act"), C("fc2"), *reduce_out("mlp")]
    f = f_attn + [C("ln_mlp"), *mlp, C("bda_mlp")]

    def column_backward(part, lin):
        ops = []
        if sp and part not in kept:
            # the re-gather reads the norm's output the forward saved: it may be issued
            # anywhere in the node before its reader, the wgrad (module doc)
            ops.append(M(f"ag_{part}_w", "all_gather", wgrad=True, reader=f"{lin}_wgrad"))
        ops.append(C(f"{lin}_dgrad"))
        ops += reduce_out(part, "_b")
        ops.append(C(f"{lin}_wgrad", wgrad=True, after=f"{lin}_dgrad"))
        return ops

    b_attn = [C("bda_attn_b"), *gather("ag_attn_b"), C("proj_dgrad"),
              C("proj_wgrad", wgrad=True, after="proj_dgrad"), *b_core,
              *column_backward("attn", "qkv"), C("ln_attn_b")]
    b = [C("bda_mlp_b"), *gather("ag_mlp_b"), C("fc2_dgrad"),
         C("fc2_wgrad", wgrad=True, after="fc2_dgrad"), C("act_b"),
         *column_backward("mlp", "fc1"), C("ln_mlp_b")] + b_attn
    if moe:
        f_moe, b_moe = moe_chains(ep_lane, shared_experts)
        return f_attn + f_moe, b_moe + b_attn
    return f, b


def check_mlp_chunks(mlp_chunks, sp: bool, moe: bool) -> None:
    """MLP chunks need the gathers and reduce-scatters of sequence parallel, and a dense
    MLP (a MoE block's tokens are routed, not gathered)."""
    if isinstance(mlp_chunks, bool) or not isinstance(mlp_chunks, int) or mlp_chunks < 1:
        raise ValueError(f"MLP chunks must be an integer >= 1, got {mlp_chunks!r}")
    if mlp_chunks > 1 and (moe or not sp):
        raise ValueError(f"MLP chunks ({mlp_chunks}) pipeline a dense MLP's sequence-parallel "
                         f"all-gather and reduce-scatter: they need TP > 1 with sequence "
                         f"parallel and no MoE (use 1 chunk otherwise)")


KEEP_PARTS = ("attn", "mlp")


def keep_parts(keep_gathered) -> Tuple[str, ...]:
    """`--dhelix-keep-gathered`'s value as the parts whose gathered input is kept: False or
    None -> none; True -> both; a comma list of "attn", "mlp" -> those."""
    if keep_gathered is None or keep_gathered is False or keep_gathered == "":
        return ()
    if keep_gathered is True:
        return KEEP_PARTS
    named = [x.strip() for x in str(keep_gathered).split(",")]
    bad = [x for x in named if x not in KEEP_PARTS]
    if bad or not named:
        raise ValueError(f"--dhelix-keep-gathered {keep_gathered}: {', '.join(map(repr, bad))} "
                         f"is no part of a layer; name attn, mlp or attn,mlp (the linear "
                         f"whose gathered input is kept: QKV's, fc1's or both)")
    return tuple(x for x in KEEP_PARTS if x in named)


def keep_value(parts) -> object:
    """The parts kept as a shape or plan meta says it: True for both, else "attn"/"mlp"."""
    parts = tuple(p for p in KEEP_PARTS if p in parts)
    return True if parts == KEEP_PARTS else ",".join(parts)


def check_keep_gathered(keep_gathered, sp: bool) -> None:
    """Keeping the gathered inputs needs the gathers of sequence parallel."""
    if keep_parts(keep_gathered) and not sp:
        raise ValueError("keeping the gathered inputs (--dhelix-keep-gathered) needs TP > 1 "
                         "with sequence parallel: without it the forward gathers nothing "
                         "(drop the flag, or add --sequence-parallel)")


def kept_gathers(keep_gathered, sp: bool, moe: bool, mlp_chunks: int) -> Tuple[str, ...]:
    """The parts ("attn", "mlp") whose forward-gathered input the backward keeps. Keeping
    all (True) keeps the MLP's only where its forward gathers it in one piece; naming
    "mlp" where it does not is an error."""
    parts = keep_parts(keep_gathered)
    if not sp or not parts:
        return ()
    if "mlp" in parts and (moe or mlp_chunks > 1):
        if keep_gathered is not True:
            why = "a MoE block routes its tokens" if moe else \
                f"--dhelix-mlp-chunks {mlp_chunks} gathers it in chunks"
            raise ValueError(f"--dhelix-keep-gathered {keep_gathered}: the MLP's gathered "
                             f"input cannot be kept ({why}); keep attn only")
        parts = tuple(p for p in parts if p != "mlp")
    return parts


def chunk_of(name: str) -> Tuple[str, int]:
    """An op name's base and chunk: "fc1.1" -> ("fc1", 1); unchunked "fc1" -> ("fc1", -1)."""
    base, dot, c = name.rpartition(".")
    return (base, int(c)) if dot and c.isdigit() else (name, -1)


def moe_chains(ep_lane: str, shared_experts: bool = False
               ) -> Tuple[List[OpSpec], List[OpSpec]]:
    """The MLP part of a MoE layer: router, permute, dispatch all-to-all, sort the
    received tokens by local expert, the experts' GEMMs (dgrad and wgrad apart), unsort,
    combine all-to-all, unpermute. Tokens are the local
    sequence shard (megatron's MoE needs sequence parallel with TP), so no TP collective.
    Shared experts, if any, are one op each way, placed beside the dispatch all-to-all
    (their input is the norm's output, their output is added after unpermute)."""
    def C(name, **kw):
        return OpSpec(name, COMPUTE, "compute", **kw)

    def A(name):
        return OpSpec(name, COMM, ep_lane, group="ep", collective="all_to_all")
    f = [C("ln_mlp"), C("router"), C("permute"), A("a2a_dispatch"), C("sort_chunks"),
         C("experts_fc1"), C("experts_act"), C("experts_fc2"), C("unsort_chunks"),
         A("a2a_combine"), C("unpermute"), C("bda_mlp")]
    if shared_experts:
        f.insert(f.index(f[3]) + 1, C("shared_experts"))
    b = [C("bda_mlp_b"), C("unpermute_b"), A("a2a_combine_b"), C("unsort_chunks_b"),
         C("experts_fc2_dgrad"), C("experts_fc2_wgrad", wgrad=True, after="experts_fc2_dgrad"),
         C("experts_act_b"), C("experts_fc1_dgrad"),
         C("experts_fc1_wgrad", wgrad=True, after="experts_act_b"), C("sort_chunks_b"),
         A("a2a_dispatch_b"), C("permute_b"), C("router_b"), C("ln_mlp_b")]
    if shared_experts:
        b.insert(b.index(b[2]) + 1, C("shared_experts_b"))
    return f, b


def ring_chains(cp: int, cp_lane: str) -> Tuple[List[OpSpec], List[OpSpec]]:
    """The attention core as a ring over the CP group (`models/ring_attention.py`): each
    ring step is a P2P exchange with the ring neighbours (comm, group "cp") and the
    attention of the local queries with one KV block (compute). Each exchange is issued
    one step ahead of the compute that reads it, as Transformer Engine's ring does, so
    even one strand overlaps it; paired with the other strand's GEMMs it hides entirely.

    forward:  attn_in (split QKV, RoPE) · kv_0 · attn_0 · kv_1 · attn_1 … attn_{C-1}
    backward: kv_b_0 · attn_b_0 · kv_b_1 · attn_b_1 … attn_b_{C-1} · kv_b_C · attn_in_b
    where kv_b_i (0 < i < C) carries the next KV block and the dK/dV accumulated so far for
    the block before it, and kv_b_C returns each block's finished dK/dV to its owner."""
    def C(name, **kw):
        return OpSpec(name, COMPUTE, "compute", **kw)

    def P(name):
        return OpSpec(name, COMM, cp_lane, group="cp", collective="send_recv")
    f = [C("attn_in")]
    for i in range(cp):
        if i < cp - 1:
            f.append(P(f"kv_{i}"))
        f.append(C(f"attn_{i}"))
    b = []
    for i in range(cp):
        b += [P(f"kv_b_{i}"), C(f"attn_b_{i}")]
    b += [P(f"kv_b_{cp}"), C("attn_in_b")]
    return f, b
