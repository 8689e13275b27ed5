"""What several commands share: starting local ranks (`--nproc`, `--timeout`, `--link`),
running a body on this rank, the model and parallelism flags, one-line errors."""
from __future__ import annotations

import argparse
import sys
from typing import List

LAUNCH_FLAGS = ("--nproc", "--timeout", "--link")


def fail(cmd: str, e: BaseException) -> int:
    """`dhelix <cmd>: error: <message on one line>` on stderr; exit status 2."""
    msg = " ".join(str(e).split())
    print(f"dhelix {cmd}: error: {msg}", file=sys.stderr)
    return 2


def strip_launch(argv: List[str]) -> List[str]:
    """The command line each rank gets: without the flags that start ranks."""
    return strip_flags(argv, LAUNCH_FLAGS)


def strip_flags(argv: List[str], flags) -> List[str]:
    """`argv` without the options `flags` (each with its value, as `--f v` or `--f=v`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
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
                   help="with --nproc, an emulated cluster link: 'paced:RATE[,LATENCY]"
                        "[,slow=X]' (e.g. paced:2gbit,20us: collectives complete no earlier "
                        "than a link model says, holding no CPU, like DMA; slow=0.15 "
                        "stretches the GEMMs that overlap a transfer by 15%%, as a NCCL "
                        "kernel's SMs would), 'RATE' (e.g. 2gbit: "
                        "a network namespace whose loopback tc-tbf limits; needs root; "
                        "every byte costs CPU) or 'none' (default)")


def spawn(a, argv) -> int:
    """Start `a.nproc` local ranks running this same command (on the --link given)."""
    from dhelix.links import LinkError, launch, parse_link
    from dhelix.links.tbf import NetnsError
    from dhelix.train.dist import spawn_local
    try:
        with launch(parse_link(a.link)) as (prefix, env):
            return spawn_local(a.nproc, strip_launch(argv), timeout_s=a.timeout,
                               prefix=prefix, extra_env=env, name=f"dhelix {argv[0]}")
    except LinkError as e:            # its message names the flag already
        print(f"dhelix: error: {e}", file=sys.stderr)
        return 2
    except NetnsError as e:
        print(f"dhelix: error: --link: {e}", file=sys.stderr)
        return 2


def run_here(cmd: str, body) -> int:
    """Run `body()` on this rank. Bad input (ConfigError, PlanError, TableError,
    DHelixArgError: all ValueErrors) is a one-line error and exit 2; the process group is
    torn down either way."""
    import torch.distributed as dist
    from dhelix.train.dist import report_done, report_error
    try:
        body()
        if dist.is_initialized():
            # every rank done before any tears down: a rank still holding an unfinished
            # send (megatron's last P2P isend) would otherwise abort in gloo at exit
            dist.barrier()
        report_done()
    except ValueError as e:
        msg = f"dhelix {cmd}: error: {e}"
        if not report_error(msg):     # under --nproc the launcher prints it once
            print(msg, file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The layer shape and parallel sizes (shared by train, profile, validate-model)."""
    g = p.add_argument_group("model and parallelism")
    g.add_argument("--config", default="tiny",
                   help="model config: a name under configs/models (tiny, small, tiny-llama, "
                        "llama-8b, ...) or a YAML path")
    g.add_argument("--seq-length", type=int, default=64, metavar="S",
                   help="tokens per sequence (default: %(default)s)")
    g.add_argument("--micro-batch-size", type=int, default=2, metavar="B",
                   help="sequences per micro-batch (default: %(default)s)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="N",
                   help="TP size (default: %(default)s)")
    g.add_argument("--context-parallel-size", type=int, default=1, metavar="C",
                   help="context parallel: each sequence split over C ranks in megatron's "
                        "load-balanced way, attention as a ring of K/V exchanges (default: "
                        "%(default)s)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism (needs TP > 1)")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and math (default fp32)")
    g.add_argument("--layer-spec", choices=["dhelix", "megatron-local"], default="dhelix",
                   help="dhelix (default, every run: SDPA core attention, a one-node norm, "
                        "megatron's linears) or megatron-local (megatron's unfused local "
                        "layer, megatron's schedule only: a baseline to time against)")
    g.add_argument("--seed", type=int, default=1234, help="random seed (default: %(default)s)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, metavar="P",
                   help="MoE: experts split over P ranks of the data-parallel group, tokens "
                        "exchanged by all-to-all (default: %(default)s)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, metavar="T",
                   help="MoE: TP inside each expert, 1 or the TP size (default: the TP size, "
                        "as megatron; on CPU with TP > 1 give 1: gloo cannot all-gather the "
                        "uneven token counts)")
    g.add_argument("--num-experts", type=int, default=None, metavar="E",
                   help="MoE: every layer's MLP becomes megatron's MoE block with E experts "
                        "(default: the model config's; tiny-moe has 4)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   metavar="F", help="MoE: add megatron's shared experts, FFN size F "
                                     "(default: the model config's, none)")
    g.add_argument("--moe-router-topk", type=int, default=None, metavar="K",
                   help="MoE: experts per token (default: the model config's, 2)")


def options(cls, a):
    """A dataclass of `cls` from the parsed arguments with the same names."""
    import dataclasses
    return cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls)
                  if hasattr(a, f.name)})
