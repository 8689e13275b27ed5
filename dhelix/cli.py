"""`dhelix train | demo | make-corpus | ...` — one entry point, one subcommand per job."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


LAUNCH_FLAGS = ("--nproc", "--timeout", "--link")


def _strip_launch(argv: List[str]) -> List[str]:
    """The command line each rank gets: without the flags that start ranks."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in LAUNCH_FLAGS:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in LAUNCH_FLAGS):
            continue
        out.append(a)
    return out


def add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch")
    g.add_argument("--nproc", type=int, default=None,
                   help="start N local ranks (gloo on CPU, NCCL on GPU); omit under "
                        "torchrun or srun")
    g.add_argument("--timeout", type=float, default=None,
                   help="with --nproc: stop all ranks after this many seconds")
    g.add_argument("--link", default="none", metavar="LINK",
                   help="with --nproc, an emulated cluster link: 'paced:RATE[,LATENCY]' "
                        "(e.g. paced:2gbit,20us: collectives complete no earlier than a "
                        "link model says, holding no CPU, like DMA), 'RATE' (e.g. 2gbit: "
                        "a network namespace whose loopback tc-tbf limits; needs root; "
                        "every byte costs CPU) or 'none' (default)")


def spawn(a, argv) -> int:
    """Start `a.nproc` local ranks running this same command (on the --link given)."""
    from dhelix.links import LinkError, launch, parse_link
    from dhelix.links.tbf import NetnsError
    from dhelix.train.dist import spawn_local
    try:
        with launch(parse_link(a.link)) as (prefix, env):
            return spawn_local(a.nproc, _strip_launch(argv), timeout_s=a.timeout,
                               prefix=prefix, extra_env=env, name=f"dhelix {argv[0]}")
    except (NetnsError, LinkError) as e:
        print(f"dhelix: error: --link: {e}", file=sys.stderr)
        return 2


def cmd_train(a, argv) -> int:
    from dhelix.megatron.args import check_dhelix_args
    from dhelix.train.args import train_config_from_args
    from dhelix.train.config import preflight
    from dhelix.train.trainer import train

    cfg = train_config_from_args(a)
    if a.nproc:
        # Everything that can be checked is checked before any rank starts: one message.
        try:
            check_dhelix_args(a)
            for w in preflight(cfg, a.nproc):
                print(f"dhelix train: warning: {w}", file=sys.stderr)
        except ValueError as e:
            print(f"dhelix train: error: {e}", file=sys.stderr)
            return 2
        return spawn(a, argv)

    def body():
        check_dhelix_args(a)
        train(cfg)
    return run_here("train", body)


def run_here(cmd: str, body) -> int:
    """Run `body()` on this rank. Bad input (ConfigError, PlanError, TableError,
    DHelixArgError: all ValueErrors) is a one-line error and exit 2; the process group is
    torn down either way."""
    import torch.distributed as dist
    from dhelix.train.dist import report_error
    try:
        body()
        if dist.is_initialized():
            # every rank done before any tears down: a rank still holding an unfinished
            # send (megatron's last P2P isend) would otherwise abort in gloo at exit
            dist.barrier()
    except ValueError as e:
        msg = f"dhelix {cmd}: error: {e}"
        if not report_error(msg):     # under --nproc the launcher prints it once
            print(msg, file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def cmd_make_corpus(a, argv) -> int:
    from dhelix.train.data import build_corpus_dataset
    build_corpus_dataset(a.output, num_docs=a.num_docs, seed=a.seed)
    print(f"dhelix make-corpus: wrote {a.output}.bin and {a.output}.idx ({a.num_docs} documents)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from dhelix.train.args import add_train_args

    p = argparse.ArgumentParser(prog="dhelix", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train a megatron-core GPT (baseline or --dhelix)")
    add_train_args(t)
    _add_dhelix_args_if_present(t)
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("make-corpus", help="write the generated grammar corpus as a "
                                           "Megatron indexed dataset")
    c.add_argument("--output", required=True, help="path prefix for .bin/.idx")
    c.add_argument("--num-docs", type=int, default=2000,
                   help="documents to generate (default: %(default)s)")
    c.add_argument("--seed", type=int, default=1234, help="random seed (default: %(default)s)")
    c.set_defaults(func=cmd_make_corpus)

    for name, register in _extra_commands():
        register(sub)
    return p


def _add_dhelix_args_if_present(p):
    try:
        from dhelix.megatron.args import add_dhelix_args
    except ImportError:
        return
    add_dhelix_args(p)


def _extra_commands():
    """Subcommands that live with their component (demo, plan, simulate, profile, ...)."""
    import importlib
    out = []
    for mod in ("dhelix.demo", "dhelix.planner.cli", "dhelix.profiler.cli", "dhelix.bench.cli"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):
                continue
            raise
        out.append((mod, m.register))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    from dhelix.base.warnings import quiet_library_warnings
    quiet_library_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    return a.func(a, argv)


if __name__ == "__main__":
    sys.exit(main())
