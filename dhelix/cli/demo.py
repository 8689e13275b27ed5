"""`dhelix demo`: megatron-core then --dhelix on local ranks, alternately (dhelix/demo.py)."""
from __future__ import annotations

from dhelix.cli.common import options
from dhelix.demo import DemoOptions, run_demo

D = DemoOptions          # the defaults


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="train megatron-core then --dhelix on local ranks over an "
                                    "emulated link, alternately, and compare")
    p.add_argument("--config", default=D.config, help="model config (default: %(default)s)")
    p.add_argument("--nproc", type=int, default=D.nproc,
                   help="local ranks (default: %(default)s)")
    p.add_argument("--tensor-model-parallel-size", type=int,
                   default=D.tensor_model_parallel_size,
                   help="TP, with sequence parallel (default: %(default)s)")
    p.add_argument("--train-iters", type=int, default=D.train_iters,
                   help="steps per run; the first is not timed (default: %(default)s)")
    p.add_argument("--seq-length", type=int, default=D.seq_length, help="(default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=D.micro_batch_size,
                   help="(default: %(default)s)")
    p.add_argument("--num-microbatches", type=int, default=D.num_microbatches,
                   help="micro-batches per step (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=D.repeats,
                   help="runs of each schedule, alternating (default: %(default)s)")
    p.add_argument("--link", default=D.link, metavar="LINK",
                   help="emulated link, as --link of `dhelix train` takes it (default: "
                        "%(default)s, a 1 Gbit/s link model that costs no CPU; 'none' for "
                        "the plain loopback; a rate like 2gbit for a tc-tbf namespace, root)")
    p.add_argument("--lr", type=float, default=D.lr, help="(default: %(default)s)")
    p.add_argument("--out", default=None, help="folder for the runs' JSON (default: temp)")
    p.set_defaults(func=run)


def run(a) -> int:
    return run_demo(options(DemoOptions, a))
