"""`dhelix train | demo | make-corpus | ...` — one entry point, one subcommand per job."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def version() -> str:
    """The installed package's version, else the source tree's."""
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version
        return dist_version("dhelix")
    except (ImportError, PackageNotFoundError):
        from dhelix import __version__
        return __version__


def build_parser() -> argparse.ArgumentParser:
    # one module per command, in the order `dhelix --help` lists them; each has
    # add_parser(sub), which sets func=run, and run(args) -> int
    from dhelix.cli import (advise, bench, demo, helix_bench, layouts, make_corpus, plan,
                            plan_sweep, profile, published, simulate, train, validate_model)
    commands = (train, demo, make_corpus, profile, validate_model, plan, simulate, plan_sweep,
                advise, bench, layouts, published, helix_bench)
    p = argparse.ArgumentParser(prog="dhelix", description=__doc__)
    p.add_argument("--version", action="version", version=f"dhelix {version()}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True)
    for command in commands:
        command.add_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    from dhelix.base.warnings import quiet_library_warnings
    quiet_library_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    a.argv = argv                 # the command line, for the ranks --nproc starts
    from dhelix.train.dist import LauncherStopped
    try:
        return a.func(a)
    except LauncherStopped as e:   # its line last, after what the command closed on the way
        print(f"dhelix {a.cmd}: {e.line()}", file=sys.stderr, flush=True)
        return e.code
