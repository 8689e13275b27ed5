"""`dhelix profile`: measure a layer's pairwise overlap table on the ranks of a job."""
from __future__ import annotations

from dhelix.cli.common import add_launch_args, add_model_args, options, run_here, spawn


def add_measure_args(sub, name: str, help_: str, run):
    """The parser of profile / validate-model: the layer, the launch, the repeats."""
    p = sub.add_parser(name, help=help_)
    add_model_args(p)
    add_launch_args(p)
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs before each measurement (default: %(default)s)")
    p.add_argument("--dhelix-mlp-chunks", type=int, default=1, metavar="C",
                   help="the layer's MLP forward in C token chunks, as `dhelix train "
                        "--dhelix-mlp-chunks C` runs it (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs per measurement; the median is kept (default: "
                        "%(default)s; validate-model on a noisy machine: 20)")
    p.set_defaults(func=run)
    return p


def add_parser(sub) -> None:
    p = add_measure_args(sub, "profile", "measure the pairwise overlap table of a layer on "
                                         "these ranks", run)
    p.add_argument("--out", default="table.json", help="table JSON (a .csv view beside it)")
    p.add_argument("--pairs", choices=["concurrent", "all"], default="concurrent",
                   help="measure only pairs on different lanes (what the simulator reads) "
                        "or every forward × backward pair")
    p.add_argument("--no-step-extras", dest="step_extras", action="store_false",
                   help="measure the layer only, not the rest of a training step (the "
                        "embedding and loss forward/backward, the optimizer step and the "
                        "grad finalize, on the whole model `dhelix train` builds), which "
                        "`dhelix simulate --num-microbatches` and `dhelix bench` need for "
                        "the whole-step prediction")


def run(a) -> int:
    from dhelix.profiler.run import ProfileOptions, profile_here
    if a.nproc:
        return spawn(a, a.argv)
    o = options(ProfileOptions, a)
    return run_here(a.cmd, lambda: profile_here(o))
