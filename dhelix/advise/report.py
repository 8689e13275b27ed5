"""What `dhelix advise` writes: the table of the top layouts, the picture (tokens/s and
memory per layout), the chosen layout's plan file, and the commands that run it —
Megatron-LM's `pretrain_gpt.py` flags through `scripts/pretrain_gpt_dhelix.py`, and an
`sbatch` file for the cluster's Slurm settings (`configs/slurm/*.env`)."""
from __future__ import annotations

import os
from typing import List, Optional

from dhelix.advise.price import GiB, Prediction


def table(preds: List[Prediction], memory_GiB: float) -> str:
    """The markdown table; a "cost" column when some rows were priced from a profiled
    table (`--overlap-table`)."""
    profiled = any(p.cost_source != "analytical" for p in preds)
    lines = ["| # | layout | schedule | tokens/s | step s | MFU | memory GiB (of "
             f"{memory_GiB:g}) | layers / head / DP / optimizer s |" +
             (" cost |" if profiled else ""),
             "|---:|---|---|---:|---:|---:|---:|---|" + ("---|" if profiled else "")]
    for i, p in enumerate(preds, 1):
        lo = p.layout
        lines.append(
            f"| {i} | {lo.name().rsplit(' ', 1 + lo.recompute)[0]} | {lo.schedule}"
            f"{' + recompute' if lo.recompute else ''} | {p.tokens_per_s:,.0f} | "
            f"{p.step_s:.3f} | {p.mfu:.1%} | {p.memory_bytes / GiB:.1f} | "
            f"{p.layers_s:.3f} / {p.head_s:.3f} / {p.dp_s:.3f} / {p.optimizer_s:.3f} |" +
            (f" {os.path.basename(p.cost_source)} |" if profiled else ""))
    return "\n".join(lines)


def layout_flags(lo, m) -> list:
    """The layout's parallel sizes, schedule and recomputation, in the flag names Megatron-LM
    and `dhelix train` share."""
    f = ["--tensor-model-parallel-size", lo.tp, "--pipeline-model-parallel-size", lo.pp,
         "--context-parallel-size", lo.cp, "--use-distributed-optimizer"]
    if lo.tp > 1:
        f += ["--sequence-parallel"]
    if m.num_experts:
        f += ["--expert-model-parallel-size", lo.ep, "--expert-tensor-parallel-size", 1]
    if lo.schedule == "interleaved":
        f += ["--num-layers-per-virtual-pipeline-stage", m.num_layers // (2 * lo.pp)]
    if lo.recompute:
        f += ["--recompute-granularity", "full", "--recompute-method", "uniform",
              "--recompute-num-layers", 1]
    return f


def megatron_flags(m_name: str, lo, seq: int, gbs: int, m) -> List[str]:
    """`pretrain_gpt.py` flags of a layout (the model's own shape flags included)."""
    f = ["--num-layers", m.num_layers, "--hidden-size", m.hidden_size,
         "--num-attention-heads", m.num_attention_heads, "--ffn-hidden-size",
         m.ffn_hidden_size, "--seq-length", seq, "--max-position-embeddings",
         max(seq, m.max_position_embeddings), "--micro-batch-size", lo.mbs,
         "--global-batch-size", gbs, "--bf16", "--overlap-grad-reduce",
         "--overlap-param-gather"] + layout_flags(lo, m)
    if m.num_query_groups:
        f += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    if m.normalization == "RMSNorm":
        f += ["--normalization", "RMSNorm"]
    if m.activation == "swiglu":
        f += ["--swiglu"]
    if m.position_embedding_type == "rope":
        f += ["--position-embedding-type", "rope"]
    if not m.add_bias_linear:
        f += ["--disable-bias-linear"]
    if m.untie_embeddings_and_output_weights:
        f += ["--untie-embeddings-and-output-weights"]
    if m.num_experts:
        f += ["--num-experts", m.num_experts, "--moe-router-topk", m.moe_router_topk]
    if lo.who == "dhelix":
        f += ["--dhelix"] + _schedule_flags(lo)
    return [str(x) for x in f]


def _schedule_flags(lo) -> List[str]:
    """DHelix's schedule flags for a layout (besides --dhelix)."""
    return {"fold": ["--dhelix-fold"], "pair-last": ["--dhelix-pair-last"]}.get(
        lo.schedule, [])


def command(m_name, lo, seq, gbs, m, plan_path: Optional[str]) -> str:
    flags = megatron_flags(m_name, lo, seq, gbs, m)
    if plan_path and lo.who == "dhelix":
        flags += ["--dhelix-plan", plan_path]
    return ("python scripts/pretrain_gpt_dhelix.py --megatron-lm $MEGATRON_LM \\\n    " +
            " ".join(flags) + " \\\n    <your data, tokenizer and checkpoint flags>")


def sbatch(path: str, m_name, lo, seq, gbs, m, cluster_name: str,
           plan_path: Optional[str], gpus_per_node: int) -> None:
    """A ready sbatch file: scripts/slurm/pretrain_gpt_dhelix.sbatch with the layout's
    node count and flags, for configs/slurm/CLUSTER.env."""
    gpus = lo.tp * lo.cp * lo.pp * lo.dp
    nodes = max(1, -(-gpus // gpus_per_node))
    flags = megatron_flags(m_name, lo, seq, gbs, m) + ["--exit-signal-handler"]
    if plan_path and lo.who == "dhelix":
        flags += ["--dhelix-plan", plan_path]
    env = f"configs/slurm/{cluster_name}.env"
    with open(path, "w") as f:
        f.write(f"""#!/bin/bash
# dhelix advise: {m_name}, {lo.name()} on {gpus} GPUs of {cluster_name}.
# Set MEGATRON_LM to a Megatron-LM checkout and add your data, tokenizer and checkpoint
# flags to DATA_ARGS (with --save DIR --load DIR: near the time limit the ranks save and
# the job submits itself again to go on, scripts/slurm/time_limit.sh), then:
#   sbatch --time=HH:MM:SS {os.path.basename(path)}
#SBATCH --job-name=dhelix-{m_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={min(gpus, gpus_per_node)}
#SBATCH --gpus-per-node={min(gpus, gpus_per_node)}
#SBATCH --exclusive
#SBATCH --output=dhelix-{m_name}-%j.out
#SBATCH --signal=B:USR1@300
set -euo pipefail
DATA_ARGS=${{DATA_ARGS:-}}
# shellcheck disable=SC2086
exec bash scripts/slurm/pretrain_gpt_dhelix.sbatch {env} \\
    {" ".join(flags)} $DATA_ARGS
""")
    os.chmod(path, 0o755)


def picture(preds: List[Prediction], path: str, title: str, memory_GiB: float) -> None:
    """Predicted tokens/s (bars) and memory per GPU (dots) of the layouts shown."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(preds) + 2), 4.2))
    xs = range(len(preds))
    colors = ["C1" if p.layout.who == "dhelix" else "C0" for p in preds]
    ax.bar(list(xs), [p.tokens_per_s for p in preds], color=colors)
    ax.set_ylabel("predicted tokens/s (blue megatron, orange DHelix)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([p.layout.name().replace(" mbs", "\nmbs") for p in preds],
                       rotation=70, fontsize=6)
    ax2 = ax.twinx()
    ax2.plot(list(xs), [p.memory_bytes / GiB for p in preds], "k.", label="memory per GPU")
    ax2.axhline(memory_GiB, color="gray", linewidth=0.8, linestyle="--")
    ax2.set_ylabel("predicted memory per GPU (GiB)")
    ax2.set_ylim(0, memory_GiB * 1.1)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_flags(lo, m_name: str, m, seq: int, gbs: int, cluster_path: str) -> List[str]:
    """The layout as `dhelix train` flags (DHelix's plan from the same cluster file)."""
    f = ["--config", m_name, "--seq-length", seq, "--micro-batch-size", lo.mbs,
         "--global-batch-size", gbs] + layout_flags(lo, m)
    if lo.who == "dhelix":
        f += ["--dhelix", "--dhelix-cluster", cluster_path] + _schedule_flags(lo)
    return [str(x) for x in f]
