"""The flags `dhelix plan`, `simulate` and `plan-sweep` share: the layer shape (Megatron's
flag names), the cost source, the planner's options. The planner itself
(dhelix/planner/problem.py) takes the plain values.

Every expected problem (missing or foreign table, bad cluster file, unknown model config,
a memory budget no plan meets, an illegal plan) prints one line
``dhelix <cmd>: error: ...`` on stderr and exits with status 2.
"""
from __future__ import annotations

from typing import List

from dhelix.megatron.args import add_keep_gathered_arg
from dhelix.planner.problem import DEFAULT_MBS, DEFAULT_SEQ, make_shape


def add_shape_args(p, required: bool) -> None:
    g = p.add_argument_group("layer shape (Megatron's flag names)")
    g.add_argument("--config", required=required, default=None, metavar="NAME",
                   help="model config: a name under configs/models (tiny, llama-8b, ...) or a "
                        "YAML path")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None, metavar="N",
                   help="TP size (default 1)")
    g.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="Megatron sequence parallelism (needs TP > 1)")
    g.add_argument("--seq-length", type=int, default=None, metavar="S",
                   help=f"default {DEFAULT_SEQ}, as `dhelix train` (published shapes: pass "
                        f"their length, e.g. 4096)")
    g.add_argument("--micro-batch-size", type=int, default=None, metavar="B",
                   help=f"default {DEFAULT_MBS}, as `dhelix train`")
    g.add_argument("--bf16", action="store_true", default=None,
                   help="bf16 activations and peak FLOP/s (default fp32)")
    g.add_argument("--lane", choices=("intra", "inter"), default=None,
                   help="where the TP group lives: inside a node (intra, default) or across "
                        "nodes (inter)")
    g.add_argument("--expert-model-parallel-size", type=int, default=None, metavar="P",
                   help="MoE configs: experts over P ranks, all-to-all between them "
                        "(default 1); the EP group is inside a node while TP×EP ≤ 8")
    add_cp_arg(g, default=None)
    g.add_argument("--dhelix-mlp-chunks", type=int, default=None, metavar="C",
                   help="the MLP forward in C token chunks, as `dhelix train "
                        "--dhelix-mlp-chunks C` runs it (needs TP > 1 with "
                        "--sequence-parallel; default 1)")
    add_keep_gathered_arg(g, default=None,
                          help="the layer that keeps its gathered inputs for the weight "
                               "gradients (no backward re-gathers; PARTS: attn, mlp or "
                               "both, the default), as `dhelix train --dhelix-keep-gathered "
                               "[PARTS]` runs it; the table of the plain layer serves it")


def add_cp_arg(g, default) -> None:
    g.add_argument("--context-parallel-size", type=int, default=default, metavar="C",
                   help="context parallel (ring attention): the sequence over C ranks, K/V "
                        "blocks passed around the ring by P2P (default 1); the CP group is "
                        "inside a node while TP×CP fits in one (the cluster file's "
                        "gpus_per_node, 8)")


SHAPE_DESTS = ("config", "tensor_model_parallel_size", "sequence_parallel", "seq_length",
               "micro_batch_size", "bf16", "lane", "expert_model_parallel_size",
               "context_parallel_size", "dhelix_mlp_chunks", "dhelix_keep_gathered")


def shape_given(a) -> bool:
    return any(getattr(a, k, None) is not None for k in SHAPE_DESTS)


def shape_from_args(a) -> dict:
    return make_shape(a.config, tp=a.tensor_model_parallel_size, sp=a.sequence_parallel,
                      seq=a.seq_length, mbs=a.micro_batch_size, bf16=a.bf16, lane=a.lane,
                      ep=getattr(a, "expert_model_parallel_size", None),
                      cp=getattr(a, "context_parallel_size", None),
                      mlp_chunks=getattr(a, "dhelix_mlp_chunks", None),
                      keep_gathered=getattr(a, "dhelix_keep_gathered", None))


def add_cost_args(p, required: bool) -> None:
    g = p.add_argument_group("cost source (one of)")
    m = g.add_mutually_exclusive_group(required=required)
    m.add_argument("--table", metavar="PATH",
                   help="measured pairwise overlap table from `dhelix profile`; refused if it "
                        "was made for another shape or cluster unless --force")
    m.add_argument("--cluster", metavar="NAME_OR_YAML",
                   help="analytical costs from a cluster file: a name under configs/clusters "
                        "(a40, a800, h100) or a YAML path")
    p.add_argument("--force", action="store_true",
                   help="use a table made for another layer signature (entries must still "
                        "cover this layer's ops)")
    p.add_argument("--host-scale", type=float, default=None, metavar="F",
                   help="price each comm op's host work (the table's host_f/host_b: the "
                        "issuing thread's own seconds per collective) at F times what was "
                        "measured: 0 asks what the plan would do with a GPU's ~10 µs "
                        "launch instead of the CPU link's copies (default 1; a plan made "
                        "with it records F, and `dhelix simulate` replays it)")


def add_planner_args(p) -> None:
    p.add_argument("--memory-budget", metavar="BYTES", default=None,
                   help="highest simulated peak memory of the layer step (β's saved "
                        "activations + α's new ones + transients), e.g. 2GiB, 500MB; plans "
                        "above it are rejected")
    p.add_argument("--backend", choices=("auto", "cpp", "python"), default="auto",
                   help="DP core: C++ (dhelix._planner_core), the Python reference, or auto")


def split_list(values) -> List[str]:
    """['a,b', 'c'] -> ['a', 'b', 'c']: flags that take names space or comma separated."""
    out: List[str] = []
    for v in values or []:
        out += [x.strip() for x in str(v).split(",") if x.strip()]
    return out
