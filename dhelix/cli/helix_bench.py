"""`dhelix helix-bench`: Helix's passes (tile streams, segmented round-robin, bucketing)
timed on the paced link and on one 1000x faster, on local gloo ranks
(dhelix/helix/bench.py)."""
from __future__ import annotations

import argparse

from dhelix.cli.common import options


def _tiles(text: str):
    try:
        tiles = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        tiles = []
    if not tiles or min(tiles) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive K values, e.g. 2,4")
    return tiles


def add_parser(sub) -> None:
    p = sub.add_parser("helix-bench", help="Helix's compiler passes on local ranks over a "
                                           "paced link: step time, exposed communication, "
                                           "timeline",
                       description="Time a TP+SP program compiled without Helix's passes and "
                                   "with K tile streams, on a paced link and on one 1000x "
                                   "faster (the compute alone); the difference is the exposed "
                                   "communication. Writes a markdown table, JSON, a bar chart "
                                   "and a before/after timeline (PNG + Chrome trace).")
    p.add_argument("--nproc", type=int, default=2,
                   help="local gloo ranks: the TP group (default: %(default)s)")
    p.add_argument("--link", default="paced:1gbit", metavar="LINK",
                   help="the paced link, paced:RATE[,LATENCY] (default: %(default)s)")
    p.add_argument("--model", choices=["block", "gpt"], default="block",
                   help="the program: one TP+SP transformer block, or a small GPT "
                        "(default: %(default)s)")
    p.add_argument("--hidden", type=int, default=256,
                   help="hidden size (default: %(default)s)")
    p.add_argument("--heads", type=int, default=8,
                   help="attention heads (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2,
                   help="gpt only: layers (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=512,
                   help="gpt only: vocabulary size (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8,
                   help="sequences per step (default: %(default)s)")
    p.add_argument("--seq", type=int, default=256,
                   help="tokens per sequence (default: %(default)s)")
    p.add_argument("--tiles", type=_tiles, default=[2, 4], metavar="K[,K...]",
                   help="tile-stream counts K to compare, comma separated (default: 2,4)")
    p.add_argument("--bucketing", action="store_true",
                   help="add rows where Helix merges the streams' collectives where its "
                        "simulation of --link says it pays (beside the rows without)")
    p.add_argument("--inductor", action="store_true",
                   help="add the program compiled by Inductor, without and with PyTorch's "
                        "reorder_for_compute_comm_overlap (needs a C++ compiler; compiles "
                        "take a minute each here)")
    p.add_argument("--iters", type=int, default=10,
                   help="timed steps per configuration and link; the median is kept "
                        "(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps before them (default: %(default)s)")
    p.add_argument("--out", default="helix-bench",
                   help="prefix for .md, .json, .png, .timeline.png and .trace.json "
                        "(default: %(default)s)")
    p.set_defaults(func=run)


def run(a) -> int:
    from dhelix.helix.bench import HelixBenchOptions, run_bench
    return run_bench(options(HelixBenchOptions, a))
