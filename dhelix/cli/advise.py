"""`dhelix advise`: the best layouts of a model on a cluster, megatron's and DHelix's,
predicted (dhelix/advise/)."""
from __future__ import annotations

from dhelix.advise.run import AdviseOptions
from dhelix.cli.common import options

D = AdviseOptions          # the defaults


def add_parser(sub) -> None:
    p = sub.add_parser("advise", help="the best layout, plan and command for a model on a "
                                      "cluster, predicted (TP, CP, PP and schedule, DP, EP, "
                                      "micro-batches, recomputation)")
    p.add_argument("--config", required=True, help="model config: a name under "
                   "configs/models (llama3-70b, llama-39b, ...) or a YAML path")
    p.add_argument("--cluster", default=D.cluster, help="a40, a800, h100 or a cluster YAML "
                   "(default: %(default)s)")
    p.add_argument("--gpus", type=int, default=D.gpus, help="(default: %(default)s)")
    p.add_argument("--seq-length", type=int, default=D.seq_length,
                   help="(default: %(default)s)")
    p.add_argument("--global-batch-size", type=int, default=D.global_batch_size,
                   help="sequences per step (default: %(default)s)")
    p.add_argument("--memory-per-gpu", type=float, default=D.memory_per_gpu, metavar="GiB",
                   help="default: the cluster file's memory_GiB")
    p.add_argument("--top", type=int, default=D.top, help="layouts in the table "
                   "(default: %(default)s; megatron's and DHelix's best are always there)")
    p.add_argument("--recompute", choices=["both", "off", "on"], default=D.recompute,
                   help="full recomputation: try both, never, always (default: %(default)s)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=D.dtype,
                   help="bf16 training (default), or fp32 as `dhelix train` runs on CPU "
                        "(the check against measured runs on this machine)")
    p.add_argument("--overlap-table", action="append", metavar="FILE",
                   help="a table `dhelix profile` measured (repeatable): the layouts whose "
                        "layer shape it was made for are priced from it, their head and "
                        "optimizer from its step_extras; the rest analytically")
    p.add_argument("--out", default=D.out, help="prefix for .md, .json, .png, .plan.json and "
                   ".sbatch (default: %(default)s)")
    p.set_defaults(func=run)


def run(a) -> int:
    from dhelix.advise.run import run_advise
    return run_advise(options(AdviseOptions, a))
