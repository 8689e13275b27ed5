"""`dhelix layouts`: the published layout shapes scaled down, megatron vs DHelix
(dhelix/bench/layouts.py)."""
from __future__ import annotations

from dhelix.bench.layouts import ROWS, LayoutsOptions
from dhelix.cli.common import options

D = LayoutsOptions          # the defaults


def add_parser(sub) -> None:
    p = sub.add_parser("layouts", help="the published layouts scaled down (TP×DP, TP×PP×DP, "
                                       "TP×CP×DP, TP×CP×PP×DP, EP×DP×PP): megatron vs "
                                       "DHelix, losses and tokens/s")
    p.add_argument("--rows", default=D.rows,
                   help=f"comma-separated rows (default: all: {D.rows}); each dimension "
                        f"of a row is 2, so a row needs 4 to 16 ranks: "
                        + ", ".join(f"{r.name} {r.world}" for r in ROWS))
    p.add_argument("--train-iters", type=int, default=D.train_iters,
                   help="steps per run; the first is not timed (default: %(default)s)")
    p.add_argument("--num-microbatches", type=int, default=D.num_microbatches,
                   help="micro-batches per step (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=D.micro_batch_size,
                   help="(default: %(default)s)")
    p.add_argument("--seq-length", type=int, default=D.seq_length, help="(default: %(default)s)")
    p.add_argument("--link", default=D.link, help="as `dhelix train --link` takes it "
                                                  "(default: %(default)s)")
    p.add_argument("--compute", default=D.compute, metavar="paced:CLUSTER[,x=F]",
                   help="paced compute: the ranks keep --emulate's time on CLUSTER (needs a "
                        "paced --link; docs/links.md)")
    p.add_argument("--emulate", default=D.emulate, metavar="MODEL[,seq=S][,mbs=B]",
                   help="with --compute: the emulated model shape")
    p.add_argument("--emulate-moe", default=D.emulate_moe, metavar="MODEL",
                   help="with --compute: the MoE row's emulated model (seq= and mbs= as "
                        "--emulate's; default: %(default)s)")
    p.add_argument("--config", default=D.config,
                   help="the model that runs (default: each row's; with --compute "
                        "tiny-llama-emu, tiny-moe-emu for the MoE row)")
    p.add_argument("--data-parallel-size", type=int, default=D.data_parallel_size,
                   help="DP of every row instead of 2 (e.g. 4: TP×PP×DP on 16 ranks)")
    p.add_argument("--out", default=D.out, help="prefix for .md and .json "
                                                "(default: %(default)s)")
    p.set_defaults(func=run)


def run(a) -> int:
    from dhelix.bench.layouts import run_layouts
    return run_layouts(options(LayoutsOptions, a))
