"""`--dhelix*` arguments, as a Megatron-LM `extra_args_provider`.

The one module below dhelix/cli/ that uses argparse: Megatron-LM hands its
`extra_args_provider` an argparse parser, and `dhelix train` adds the same flags to its own
(dhelix/cli/train.py), so both read them alike.
"""
from __future__ import annotations

import argparse
import os

from dhelix.base.units import SizeError, parse_bytes


def _bytes(text: str) -> float:
    """A byte count as `dhelix plan --memory-budget` takes it: 2GiB, 500MB, 1.5G or a plain
    number (a negative one is refused by check_dhelix_args, which names the flag)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return parse_bytes(text)
    except SizeError as e:
        raise argparse.ArgumentTypeError(str(e))


def keep_gathered_arg(text: str) -> str:
    """`--dhelix-keep-gathered PARTS`: attn, mlp or attn,mlp (checked, in that order)."""
    from dhelix.planner.chains import keep_parts
    try:
        return ",".join(keep_parts(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


KEEP_HELP = ("keep each column-parallel linear's gathered input (sequence parallel) from "
             "the forward to its weight gradient instead of gathering it again in the "
             "backward: two of a layer's ten TP collectives fewer, for (TP-1)/TP of s·b·h "
             "more activation memory per linear, layer and micro-batch in flight (needs "
             "TP > 1 with --sequence-parallel); PARTS keeps only those linears' inputs "
             "(attn: QKV's, mlp: fc1's; default both): half the memory, half the comm")


def add_keep_gathered_arg(g, help: str, default=False) -> None:
    """`--dhelix-keep-gathered [PARTS]`: the flag alone keeps both parts (True)."""
    g.add_argument("--dhelix-keep-gathered", nargs="?", const=True, default=default,
                   type=keep_gathered_arg, metavar="PARTS", help=help)


def add_dhelix_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("DHelix", "strand interleaving (dhelix)")
    g.add_argument("--dhelix", action="store_true",
                   help="co-execute two micro-batches (F(k+1) ∥ B(k)) with the DHelix layer")
    g.add_argument("--dhelix-plan", default=None, metavar="PATH",
                   help="layer plan JSON (`dhelix plan` output), or 'trivial' / 'paired' "
                        "for a built-in plan; default: the planner's plan from a "
                        "table/cluster, else the built-in paired plan")
    g.add_argument("--dhelix-overlap-table", default=None, metavar="PATH",
                   help="pairwise overlap table (`dhelix profile` output) to plan from")
    g.add_argument("--dhelix-cluster", default=None, metavar="NAME_OR_YAML",
                   help="cluster file or name (a40, a800, h100: configs/clusters/) for the "
                        "analytical model")
    g.add_argument("--dhelix-memory-budget", type=_bytes, default=None, metavar="BYTES",
                   help="reject plans whose simulated peak memory exceeds this, e.g. 2GiB, "
                        "500MB or a number of bytes")
    g.add_argument("--dhelix-fold", action="store_true",
                   help="the U-folded pipeline with --pipeline-model-parallel-size G > 1: "
                        "stage g holds the g-th layer chunk from the front and from the "
                        "back; forward and backward of different micro-batches co-execute "
                        "on every stage, every parameter stored once")
    g.add_argument("--dhelix-trace", default=None, metavar="PATH",
                   help="write the last iteration's ops on their lanes, one Chrome-trace "
                        "JSON and one PNG timeline per rank: PATH's stem + .rankN "
                        "(trace.json -> trace.rank0.json, trace.rank0.png, ...)")
    g.add_argument("--dhelix-halves", action="store_true",
                   help="split the micro-batch of B(N), the last backward, which has no "
                        "partner, in two batch halves run round-robin, so its comm hides "
                        "behind the other half's compute (needs an even "
                        "--micro-batch-size; not bit-identical to megatron: a weight's "
                        "gradient adds the halves' parts)")
    g.add_argument("--dhelix-pair-last", action="store_true",
                   help="run one micro-batch further ahead so that the last two backwards, "
                        "B(N-1) and B(N), pair with each other round-robin: twice the "
                        "compute behind the DP gradient reduction that the last backward "
                        "starts, for one more micro-batch's activations held and F(2) run "
                        "alone (needs 2 or more micro-batches; bit-identical to megatron)")
    g.add_argument("--dhelix-mlp-chunks", type=int, default=1, metavar="C",
                   help="run each DHelix layer's MLP forward in C token chunks (C > 1 needs "
                        "TP > 1 with --sequence-parallel and a dense MLP): chunk c's "
                        "all-gather runs beside chunk c-1's GEMMs and its reduce-scatter "
                        "beside chunk c+1's, so the link has work while the other strand "
                        "has none; bit-identical to megatron (default 1: unchunked)")
    add_keep_gathered_arg(g, KEEP_HELP + "; bit-identical to megatron")
    g.add_argument("--dhelix-peer", choices=["intra-batch"], default=None,
                   help="instead of DHelix, the intra-batch overlap peer (for comparison): "
                        "each micro-batch split in two halves, interleaved round-robin")
    g.add_argument("--dhelix-force", action="store_true",
                   help="use a table made for another shape or cluster anyway")
    g.add_argument("--dhelix-sdpa-baseline", action="store_true",
                   help="without --dhelix: megatron's own layer and schedule on DHelix's "
                        "layer spec (SDPA core attention, the one-node norm), the baseline "
                        "that compares the schedule alone, with the same kernels")
    return parser


class DHelixArgError(ValueError):
    pass


def check_dhelix_args(args) -> None:
    """Stop before training on bad --dhelix* values (files named, fixes given)."""
    if getattr(args, "dhelix_sdpa_baseline", False) and getattr(args, "dhelix", False):
        raise DHelixArgError("--dhelix-sdpa-baseline is the run to compare --dhelix with: "
                             "give one of them")
    _check_transformer_impl(args)
    if not getattr(args, "dhelix", False):
        for name in ("dhelix_plan", "dhelix_overlap_table", "dhelix_trace", "dhelix_halves",
                     "dhelix_pair_last"):
            if getattr(args, name, None):
                raise DHelixArgError(f"--{name.replace('_', '-')} needs --dhelix")
        if (getattr(args, "dhelix_mlp_chunks", 1) or 1) != 1:
            raise DHelixArgError("--dhelix-mlp-chunks needs --dhelix")
        if getattr(args, "dhelix_keep_gathered", False):
            raise DHelixArgError("--dhelix-keep-gathered needs --dhelix")
        return
    for name, what in (("dhelix_plan", "plan"), ("dhelix_overlap_table", "overlap table"),
                       ("dhelix_cluster", "cluster file")):
        path = getattr(args, name, None)
        if name == "dhelix_plan" and path in ("trivial", "paired"):
            continue
        if name == "dhelix_cluster" and path:
            from dhelix.models.config import find_named_yaml
            find_named_yaml(path, "clusters", "--dhelix-cluster", "cluster", DHelixArgError)
            continue
        if path and not os.path.exists(path):
            raise DHelixArgError(f"--{name.replace('_', '-')} {path}: {what} file not found")
    if getattr(args, "dhelix_plan", None) not in (None, "trivial", "paired"):
        from dhelix.planner.plan import Plan
        Plan.load(args.dhelix_plan)          # raises PlanError naming the field
    budget = getattr(args, "dhelix_memory_budget", None)
    if budget is not None and budget <= 0:
        raise DHelixArgError(f"--dhelix-memory-budget {budget}: must be a positive byte count")
    fold = getattr(args, "dhelix_fold", False)
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if fold and pp == 1:
        raise DHelixArgError("--dhelix-fold folds the layers over pipeline stages: give "
                             "--pipeline-model-parallel-size 2 or more")
    if getattr(args, "dhelix_halves", False):
        mbs = getattr(args, "micro_batch_size", None)
        bad = [flag for flag, yes in (
            ("--dhelix-fold", fold), ("--num-experts", bool(getattr(args, "num_experts", None))),
            ("--context-parallel-size > 1", (getattr(args, "context_parallel_size", 1) or 1) > 1))
            if yes]
        if bad:
            raise DHelixArgError(f"--dhelix-halves splits the dense layers of B(N) "
                                 f"(TP/SP/DP); not built with {', '.join(bad)}")
        if mbs is not None and mbs % 2:
            raise DHelixArgError(f"--dhelix-halves splits the micro-batch of B(N) "
                                 f"in 2: --micro-batch-size must be even (got {mbs})")
    _check_pair_last(args, fold)
    _check_mlp_chunks(args)
    _check_keep_gathered(args)
    if pp > 1 and not fold:
        raise DHelixArgError("--dhelix with --pipeline-model-parallel-size > 1 runs the "
                             "U-folded pipeline: add --dhelix-fold")
    _check_moe(args)
    _check_recompute(args)


def _check_pair_last(args, fold: bool) -> None:
    """--dhelix-pair-last: the dense layers of the schedule without PP (TP/SP/CP/DP, the
    distributed optimizer), where it is checked against megatron."""
    if not getattr(args, "dhelix_pair_last", False):
        return
    bad = [flag for flag, yes in (
        ("--dhelix-fold", fold), ("--num-experts", bool(getattr(args, "num_experts", None))),
        ("--recompute-granularity", bool(getattr(args, "recompute_granularity", None))),
        ("--dhelix-halves", bool(getattr(args, "dhelix_halves", False)))) if yes]
    if bad:
        raise DHelixArgError(f"--dhelix-pair-last pairs the last two backwards of dense "
                             f"layers (TP/SP/CP/DP); not built with {', '.join(bad)} (drop "
                             f"--dhelix-pair-last)")


def _not_dense_tp_sp(args) -> list:
    """The flags that take a run off the dense TP+SP layer a chain variant (MLP chunks,
    kept gathers) is checked against megatron on; empty if none."""
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    cp = getattr(args, "context_parallel_size", 1) or 1
    return [flag for flag, yes in (
        ("--tensor-model-parallel-size 1", tp == 1),
        ("no --sequence-parallel", not getattr(args, "sequence_parallel", False)),
        ("--num-experts", bool(getattr(args, "num_experts", None))),
        # not checked against megatron yet: refused rather than untested
        (f"--context-parallel-size {cp}", cp > 1),
        ("--dhelix-fold", bool(getattr(args, "dhelix_fold", False)))) if yes]


def _check_mlp_chunks(args) -> None:
    """--dhelix-mlp-chunks C: a dense MLP with sequence parallel, whose every rank's
    sequence shard splits into C equal parts."""
    c = getattr(args, "dhelix_mlp_chunks", 1)
    c = 1 if c is None else c
    if c < 1:
        raise DHelixArgError(f"--dhelix-mlp-chunks {c}: give a chunk count >= 1")
    if c == 1:
        return
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    bad = _not_dense_tp_sp(args)
    if bad:
        raise DHelixArgError(f"--dhelix-mlp-chunks {c} pipelines a dense MLP's sequence-"
                             f"parallel all-gather and reduce-scatter; not with "
                             f"{', '.join(bad)} (use --dhelix-mlp-chunks 1)")
    seq = getattr(args, "seq_length", None)
    if seq and (seq // tp) % c:
        raise DHelixArgError(f"--dhelix-mlp-chunks {c} splits each rank's {seq // tp} "
                             f"sequence rows (--seq-length {seq} / TP {tp}) in equal parts: "
                             f"choose a chunk count that divides {seq // tp}")


def _check_keep_gathered(args) -> None:
    """--dhelix-keep-gathered: the gathers of sequence parallel, on the layouts checked
    against megatron (dense TP+SP, with or without MLP chunks and halves)."""
    if not getattr(args, "dhelix_keep_gathered", False):
        return
    bad = _not_dense_tp_sp(args)
    if getattr(args, "recompute_granularity", None):    # it spends what recompute saves
        bad.append("--recompute-granularity")
    if bad:
        raise DHelixArgError(f"--dhelix-keep-gathered keeps the all-gathered inputs of "
                             f"sequence parallel for the weight gradients; not with "
                             f"{', '.join(bad)} (drop --dhelix-keep-gathered)")
    keep = args.dhelix_keep_gathered
    chunks = getattr(args, "dhelix_mlp_chunks", 1) or 1
    if keep is not True and "mlp" in str(keep).split(",") and chunks > 1:
        raise DHelixArgError(f"--dhelix-keep-gathered {keep} with --dhelix-mlp-chunks "
                             f"{chunks}: a chunked MLP gathers its input in chunks, none "
                             f"of them kept; keep attn only (--dhelix-keep-gathered attn)")


def _check_recompute(args) -> None:
    """--dhelix with megatron's --recompute-granularity: the DHelix layer nodes recompute
    dense layers (docs/recompute.md); what they do not, refused here by flag."""
    g = getattr(args, "recompute_granularity", None)
    if not g:
        return
    cp = getattr(args, "context_parallel_size", 1) or 1
    bad = [flag for flag, yes in (
        ("--dhelix-halves", bool(getattr(args, "dhelix_halves", False))),
        ("--num-experts", bool(getattr(args, "num_experts", None))),
        (f"--context-parallel-size {cp}", cp > 1)) if yes]
    if bad:
        raise DHelixArgError(f"--dhelix with --recompute-granularity {g} and "
                             f"{', '.join(bad)}: DHelix recomputes dense layers without "
                             f"context parallel or the halves; drop {' / '.join(bad)} or the "
                             f"recompute flags")
    modules = getattr(args, "recompute_modules", None) or ["core_attn"]
    if g == "selective" and list(modules) != ["core_attn"]:
        raise DHelixArgError(f"--dhelix with --recompute-granularity selective "
                             f"--recompute-modules {' '.join(modules)}: DHelix recomputes the "
                             f"attention core only; use --recompute-modules core_attn (the "
                             f"default)")


def _check_moe(args) -> None:
    """--dhelix with --num-experts: what the DHelix MoE layer (strand/moe.py) refuses when
    it is built, refused here before any rank trains, by flag. `dhelix train` passes its
    own namespace, without megatron's MoE flags: a missing one is taken as what `dhelix
    train` sets (the all-to-all dispatcher, no token dropping, no shared-expert gate)."""
    if not getattr(args, "num_experts", None):
        return
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp > 1:
        raise DHelixArgError(f"--dhelix with --num-experts and --context-parallel-size {cp}: "
                             f"the DHelix MoE layer has no context parallel yet; drop "
                             f"--context-parallel-size (or --dhelix)")
    disp = getattr(args, "moe_token_dispatcher_type", None) or "alltoall"
    if disp != "alltoall":
        raise DHelixArgError(f"--dhelix with --moe-token-dispatcher-type {disp}: the DHelix "
                             f"MoE layer takes megatron's all-to-all dispatcher apart into "
                             f"ops; pass --moe-token-dispatcher-type alltoall (Megatron-LM's "
                             f"default is allgather)")
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    if etp > 1:
        raise DHelixArgError(f"--dhelix with experts split over {etp} tensor-parallel ranks "
                             f"(--expert-tensor-parallel-size, which defaults to "
                             f"--tensor-model-parallel-size): the DHelix MoE layer keeps "
                             f"experts whole; add --expert-tensor-parallel-size 1")
    if getattr(args, "moe_shared_expert_intermediate_size", None):
        bad = [flag for flag, name in (("--moe-shared-expert-overlap",
                                        "moe_shared_expert_overlap"),
                                       ("--moe-shared-expert-gate", "moe_shared_expert_gate"))
               if getattr(args, name, False)]
        if bad:
            raise DHelixArgError(f"--dhelix with shared experts and {', '.join(bad)}: the "
                                 f"DHelix MoE layer runs the shared experts as its own op "
                                 f"(beside the dispatch all-to-all), ungated; drop "
                                 f"{' and '.join(bad)}")
    bad = [flag for flag, yes in (
        (f"--moe-expert-capacity-factor {getattr(args, 'moe_expert_capacity_factor', None)}",
         getattr(args, "moe_expert_capacity_factor", None) is not None),
        ("--moe-pad-expert-input-to-capacity",
         getattr(args, "moe_pad_expert_input_to_capacity", False))) if yes]
    if bad:
        raise DHelixArgError(f"--dhelix with {' and '.join(bad)}: the DHelix MoE layer does "
                             f"not drop tokens (no expert capacity); drop "
                             f"{' and '.join(f.split()[0] for f in bad)}")
    if getattr(args, "moe_apply_probs_on_input", False):
        raise DHelixArgError("--dhelix with --moe-apply-probs-on-input: the DHelix MoE layer "
                             "weighs each expert's activation by the routing weight, as "
                             "megatron does without that flag; drop "
                             "--moe-apply-probs-on-input")


def _check_transformer_impl(args) -> None:
    if not (getattr(args, "dhelix", False) or getattr(args, "dhelix_sdpa_baseline", False)):
        return
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        raise DHelixArgError(
            "--dhelix builds its own layer spec (SDPA core attention — FlashAttention or "
            "cuDNN on CUDA — a one-node norm, megatron's linears); Transformer Engine's "
            "layers are not DHelix ops yet (no fp8, no fused LayerNorm-linear, no "
            "userbuffers TP overlap): pass --transformer-impl local, and compare with "
            "--dhelix-sdpa-baseline for the same kernels")
