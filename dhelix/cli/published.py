"""`dhelix published`: the published evaluation's table at emulated time
(dhelix/bench/table.py: the rows of bench/published.py and bench/best.py)."""
from __future__ import annotations

import sys

from dhelix.bench.best import BEST
from dhelix.bench.published import ROWS, TableOptions
from dhelix.cli.common import options

D = TableOptions          # the defaults


def add_parser(sub) -> None:
    p = sub.add_parser("published", help="the published evaluation's rows (arXiv "
                                         "2411.15871) at an emulated cluster's time: "
                                         "megatron at its best vs DHelix")
    p.add_argument("--rows", default=D.rows, metavar="ROW[,ROW...]",
                   help="rows to run (default: every published row): " +
                        ", ".join(r.key for r in ROWS) + "; and megatron's best layout "
                        "against DHelix's, as dhelix advise picks them: " +
                        ", ".join(r.key for r in BEST) + " (best: all three)")
    p.add_argument("--factor", type=float, default=D.factor, metavar="X",
                   help="the ranks run X times slower than the cluster (paced:CLUSTER,x=X; "
                        "default: %(default)s)")
    p.add_argument("--max-ranks", type=int, default=D.max_ranks,
                   help="DP is cut so that a row runs on at most this many ranks, its DP "
                        "reduction still priced at the published DP (default: %(default)s; "
                        "a rank costs about 340 MiB here)")
    p.add_argument("--train-iters", type=int, default=D.train_iters,
                   help="steps per run, the first not timed (default: %(default)s)")
    p.add_argument("--microbatches", type=int, default=D.microbatches,
                   help="micro-batches per DP rank, mbs 1 (default: %(default)s)")
    p.add_argument("--num-layers", type=int, default=D.num_layers,
                   help="> 0: this many layers instead of each model's own (quick checks)")
    p.add_argument("--out", default=D.out, help="output directory: table.md, table.json, "
                                                "table.png, rows/; the rows of an earlier "
                                                "table there that --rows does not redo are "
                                                "kept (default: %(default)s)")
    p.add_argument("--simulate", action="store_true",
                   help="no runs: the simulators' table for the rows as they would run "
                        "(simulated.md, simulated.json in --out), in seconds")
    p.add_argument("--pair-last", action="store_true",
                   help="the rows without PP and EP run DHelix with --dhelix-pair-last "
                        "(B(N-1) ∥ B(N): less DP traffic exposed, one more micro-batch's "
                        "activations); --simulate shows both either way")
    p.set_defaults(func=run)


def run(a) -> int:
    from dhelix.bench.published import TableError
    from dhelix.bench.table import run_table
    try:
        return run_table(options(TableOptions, a))
    except TableError as e:
        print(f"dhelix published: error: {e}", file=sys.stderr)
        return 2
