"""`dhelix validate-model`: simulated vs measured layer-step times of random legal plans."""
from __future__ import annotations

from dhelix.cli.common import options, run_here, spawn
from dhelix.cli.profile import add_measure_args


def add_parser(sub) -> None:
    p = add_measure_args(sub, "validate-model", "compare simulated and measured layer-step "
                                                "times of random legal plans", run)
    p.add_argument("--table", default=None, help="pairwise table; default: profile now")
    p.add_argument("--plans", type=int, default=30, help="random legal plans (>= 30)")
    p.add_argument("--out", default="validate-model", help="prefix for .json and .png")
    p.add_argument("--force", action="store_true",
                   help="use a --table made for another layer shape or machine anyway")


def run(a) -> int:
    from dhelix.profiler.run import ProfileOptions, validate_here
    if a.nproc:
        return spawn(a, a.argv)
    o = options(ProfileOptions, a)
    return run_here(a.cmd, lambda: validate_here(o))
