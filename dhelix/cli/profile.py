"""`dhelix profile`: measure a layer's pairwise overlap table on the ranks of a job."""
from __future__ import annotations

from dhelix.cli.common import (add_launch_args, add_model_args, fail, options, run_here,
                               spawn, strip_flags)


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
    p.add_argument("--runs", type=int, default=1, metavar="N",
                   help="with --nproc: profile N times, each in rank processes of its own, "
                        "and keep every entry's smallest median (a rank process can run "
                        "some ops 2-5x slower for a whole profile on a CPU machine; the "
                        "runs' tables stay beside --out as NAME.runK.json; default: "
                        "%(default)s)")
    p.add_argument("--no-step-extras", dest="step_extras", action="store_false",
                   help="measure the layer only, not the rest of a training step (the "
                        "embedding and loss forward/backward, the optimizer step and the "
                        "grad finalize, on the whole model `dhelix train` builds), which "
                        "`dhelix simulate --num-microbatches` and `dhelix bench` need for "
                        "the whole-step prediction")


def run(a) -> int:
    from dhelix.profiler.run import ProfileOptions, profile_here
    if a.runs < 1:
        return fail("profile", f"--runs {a.runs}: give 1 or more profiling runs")
    if a.runs > 1:
        if not a.nproc:
            return fail("profile", f"--runs {a.runs} starts each run's ranks itself: give "
                                   f"--nproc (under torchrun or srun, launch once per run "
                                   f"and merge the tables)")
        return _runs(a)
    if a.nproc:
        return spawn(a, a.argv)
    o = options(ProfileOptions, a)
    return run_here(a.cmd, lambda: profile_here(o))


def _runs(a) -> int:
    """`--runs N`: N profiles, each on rank processes of its own, merged entry by entry
    to the smallest median (`costs.min_of_runs`)."""
    import os
    from dhelix.planner.costs import TableError, merge_run_files
    base = strip_flags(a.argv, {"--runs", "--out"})
    stem = os.path.splitext(a.out)[0]
    paths = [f"{stem}.run{k + 1}.json" for k in range(a.runs)]
    for k, path in enumerate(paths):
        print(f"dhelix profile: run {k + 1} of {a.runs}, ranks of its own -> {path}",
              flush=True)
        rc = spawn(a, base + ["--out", path])
        if rc != 0:
            return rc
    try:
        merged, tables = merge_run_files(paths, a.out)
    except TableError as e:
        return fail("profile", e)
    # how far apart the runs were: the largest ratio of one entry's medians
    spread = max(((max(getattr(t, f)[k] for t in tables) /
                   max(getattr(merged, f)[k], 1e-12), f"{f} {k}")
                  for f in ("alone_f", "alone_b", "in_step_f", "in_step_b")
                  for k in getattr(merged, f)), default=(1.0, "-"))
    print(f"dhelix profile: {a.runs} runs merged (each entry the smallest median) -> "
          f"{a.out}, {stem}.csv; the runs differed by up to {spread[0]:.2f}x ({spread[1]})")
    return 0
