"""DHelix's own cost with the machine's drift taken out: megatron's forward-backward and
DHelix's (a plan, default the trivial one: megatron's ops in megatron's order, nothing
paired) on two models with the same weights, in the same rank processes, alternating
every step (which goes first alternates too). Prints each pair and the median of the
per-pair ratios (megatron ms / DHelix ms: above 1 DHelix is faster). Forward-backward
only: the optimizer step is megatron's in both.

With `--table TABLE` DHelix runs the plan made from a profiled table (as the bench's
planned run); `--ab clock` runs each model with the paced link's fine waits and with
plain sleeps (`dhelix/links/clock.py`), `--ab eager` with its shared-memory reads as soon
as a collective is posted and at its wait only. On a paced link each rank also prints, per model,
the seconds a step waited for the modelled end, for a free slot and for a late peer.
`--ab direct` runs each model with DHelix's lanes calling the paced link directly and
through torch.distributed (megatron's collectives always go through torch.distributed).

    torchrun --nproc-per-node 2 scripts/own_cost_inproc.py --link paced:1000gbit --pairs 8
    torchrun --nproc-per-node 1 scripts/own_cost_inproc.py --link none
    torchrun --nproc-per-node 2 scripts/own_cost_inproc.py --link paced:1gbit \
        --table table.json --ab clock --pairs 10
    torchrun --nproc-per-node 2 scripts/own_cost_inproc.py --link paced:1gbit \
        --table table.json --keep-gathered --pairs 8
    torchrun --nproc-per-node 2 scripts/own_cost_inproc.py --link paced:1gbit \
        --table table.json --halves --phases --pairs 6

`--link-calls` prints, per rank and model, the thread time (`time.thread_time`) of each
paced-link call over the counted pairs: the collective as its caller issues it (DHelix's
lanes' direct path, megatron's through torch.distributed), the link model's
`schedule()`, the shared-memory issue (copy in, and the reads of collectives already
posted: `links/shm.py`'s EAGER), each read (copies or sums out) and each wait (its read
and the last ~80 µs spun toward the modelled end, `links/clock.py`).

`--also-plans A.json,B.json` adds a DHelix model per plan file (which of several plans
runs faster, in the same processes). `--halves` adds a model planned the same way with `--dhelix-halves` (B(N)'s micro-batch
as two batch halves round-robin); `--phases` prints, per DHelix model, the median time of
F(1), of one co-step F(k+1) ∥ B(k) (k < N−1), of the last co-step and of B(N) (rank 0's host clock around each
`co_step` of `schedules/dhelix.py`), to say which phase a variant makes faster.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


# --ab: a paced-link setting -> (module, attribute) switched per run
AB = {"clock": ("dhelix.links.clock", "FINE"), "eager": ("dhelix.links.shm", "EAGER"),
      "direct": ("dhelix.links.paced", "DIRECT")}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link", default="none")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--config", default="small16")
    p.add_argument("--plan", default="trivial")
    p.add_argument("--table", default=None,
                   help="plan from this overlap table instead of --plan (as the bench does)")
    p.add_argument("--keep-gathered", nargs="?", const=True, default=False,
                   metavar="PARTS",
                   help="a third model: DHelix planned the same way with "
                        "--dhelix-keep-gathered [PARTS] (no backward re-gathers of those "
                        "parts: attn, mlp or both, the default); several models with "
                        "PARTS a list split by '/', e.g. mlp/attn,mlp")
    p.add_argument("--also-plans", default=None, metavar="A.json,B.json",
                   help="more models: DHelix with each of these plan files (e.g. plans "
                        "made from different profiles of one link, to see which runs "
                        "faster)")
    p.add_argument("--halves", action="store_true",
                   help="a model: DHelix planned the same way with --dhelix-halves")
    p.add_argument("--phases", action="store_true",
                   help="time each DHelix model's F(1), co-steps and B(N)")
    p.add_argument("--ab", choices=AB, default=None,
                   help="run each model also with this paced-link setting off: clock "
                        "(links/clock.py's fine waits; off: plain sleeps), eager "
                        "(links/shm.py reads a collective as soon as it is posted; off: "
                        "at its wait), direct (DHelix's lanes call the paced link "
                        "directly, links/paced.py: direct; off: through torch.distributed)")
    p.add_argument("--link-calls", action="store_true",
                   help="time each paced-link call with the thread clock, per model")
    a = p.parse_args()
    os.environ["DHELIX_LINK"] = a.link          # read when the rank joins the group
    if a.link_calls:
        _time_link_calls()                      # before the link wraps torch.distributed
    import torch
    from dhelix.base.memory import METER
    from dhelix.cli import build_parser
    from dhelix.cli.train import train_config_from_args
    from dhelix.train.build import build
    from dhelix.train.config import check_layout
    from dhelix.train.data import make_batches
    from dhelix.train.dist import init_distributed
    from dhelix.train.schedules import make_schedule
    from dhelix.train.trainer import _to_device, forward_step, model_of, setup_megatron

    world = int(os.environ.get("WORLD_SIZE", "1"))
    argv = ["train", "--config", a.config, "--tensor-model-parallel-size", str(world),
            "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "32",
            "--data", "synthetic", "--link", a.link] + \
        (["--sequence-parallel"] if world > 1 else [])
    parser = build_parser()
    planned = ["--dhelix"] + (["--dhelix-overlap-table", a.table] if a.table
                              else ["--dhelix-plan", a.plan])
    cfgs = {"megatron": train_config_from_args(parser.parse_args(argv)),
            "dhelix": train_config_from_args(parser.parse_args(argv + planned))}
    for parts in ([] if not a.keep_gathered else [None] if a.keep_gathered is True
                  else a.keep_gathered.split("/")):
        name = "dhelix-keep" + (f"-{parts}" if parts else "")
        cfgs[name] = train_config_from_args(parser.parse_args(
            argv + planned + ["--dhelix-keep-gathered"] + ([parts] if parts else [])))
    for path in (a.also_plans.split(",") if a.also_plans else []):
        cfgs[f"dhelix-{os.path.splitext(os.path.basename(path))[0]}"] = \
            train_config_from_args(parser.parse_args(argv + ["--dhelix", "--dhelix-plan", path]))
    if a.halves:
        cfgs["dhelix-halves"] = train_config_from_args(
            parser.parse_args(argv + planned + ["--dhelix-halves"]))
    cfg = cfgs["megatron"]
    m = model_of(cfg)
    info = init_distributed()
    layout = check_layout(cfg, m, info.world_size)
    tconfig = setup_megatron(cfg, m, layout)
    runs = {}
    for name, c in cfgs.items():         # same seed: the same weights
        schedule = make_schedule(c.dhelix)
        chunks = build(c, m, tconfig, layout, info.device, schedule.layer_module,
                       layout.fold).chunks
        schedule.prepare(chunks, tconfig)
        schedule.check(chunks, c.seq_length, c.micro_batch_size)
        runs[name] = (schedule, chunks)
    data = _to_device(make_batches(
        cfg.data, seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size,
        num_microbatches=layout.num_microbatches, vocab_size=m.vocab_size, seed=cfg.seed,
        dp_rank=0, dp_size=1, data_path=None, start_step=0), info.device, 1)
    import importlib
    switch = (importlib.import_module(AB[a.ab][0]), AB[a.ab][1]) if a.ab else None
    settings = [f"{a.ab} on", f"{a.ab} off"] if a.ab else ["as is"]
    variants = [(name, setting) for setting in settings for name in runs]
    times = {v: [] for v in variants}
    # the paced link's waits per variant (seconds over the counted pairs): past the data's
    # arrival for the modelled end, for a free slot, for a peer's late data
    from dhelix.links.paced import active
    from dhelix.links.shm import PEER_WAIT
    link = active()

    def waits():
        return (0.0, 0.0, 0.0) if link is None else \
            (link.waited_s, PEER_WAIT["slot_s"], link.late_s)
    waited = {v: [0.0, 0.0, 0.0] for v in variants}
    phases = {v: [] for v in variants}      # per counted step: [F(1), co-steps..., B(N)]
    if a.phases:
        _time_co_steps()
    for i in range(a.pairs + 1):         # the first pair warms up, not counted
        for v in (variants if i % 2 == 0 else variants[::-1]):
            name, setting = v
            if switch:
                setattr(*switch, setting.endswith(" on"))
            schedule, chunks = runs[name]
            CALLS_OF[0] = f"{name} {setting}" if i else None
            for c in chunks:
                c.zero_grad_buffer()
            torch.distributed.barrier()
            w0 = waits()
            t0 = time.perf_counter()
            with METER.autograd():
                schedule.forward_backward(
                    forward_step_func=forward_step, data_iterator=data, model=chunks[0],
                    num_microbatches=layout.num_microbatches, seq_length=cfg.seq_length,
                    micro_batch_size=cfg.micro_batch_size, forward_only=False)
            times[v].append(time.perf_counter() - t0)
            if a.phases and i and name != "megatron":
                phases[v].append(list(CO_STEP_S))
            CO_STEP_S.clear()
            if i:
                waited[v] = [x + y - z for x, y, z in zip(waited[v], waits(), w0)]
        if info.rank == 0:
            for setting, name in [(s, n) for s in settings for n in runs if n != "megatron"]:
                mg, dh = times[("megatron", setting)][-1], times[(name, setting)][-1]
                print(f"pair {i}{' (warm-up)' if i == 0 else ''} {setting}: megatron "
                      f"{mg * 1e3:7.0f} ms  {name} {dh * 1e3:7.0f} ms  {mg / dh:.3f}x",
                      flush=True)
    if info.rank == 0:
        for setting, name in [(s, n) for s in settings for n in runs if n != "megatron"]:
            mg, dh = times[("megatron", setting)][1:], times[(name, setting)][1:]
            ratios = [x / y for x, y in zip(mg, dh)]
            print(f"{a.link} {setting} {name}: median of {a.pairs} pairs "
                  f"{statistics.median(ratios):.3f}x (range {min(ratios):.3f}-"
                  f"{max(ratios):.3f}); median step megatron "
                  f"{statistics.median(mg) * 1e3:.0f} ms, {name} "
                  f"{statistics.median(dh) * 1e3:.0f} ms", flush=True)
    if a.phases and info.rank == 0:
        for v, steps in phases.items():
            if not steps:
                continue
            med = statistics.median
            f1, bn = med(t[0] for t in steps), med(t[-1] for t in steps)
            co = med(x for t in steps for x in t[1:-2])
            last = med(t[-2] for t in steps)
            print(f"{v[0]} {v[1]} phases (median ms): F(1) {f1 * 1e3:.0f}, co-step "
                  f"{co * 1e3:.0f} (x{len(steps[0]) - 3}), last co-step F(N) ∥ B(N-1) "
                  f"{last * 1e3:.0f}, B(N) {bn * 1e3:.0f}", flush=True)
    if link is not None:
        for v in variants:       # every rank: a late peer shows on the other rank
            print(f"rank {info.rank} {v[0]} {v[1]}: per step, waited for the modelled end "
                  f"{waited[v][0] / a.pairs * 1e3:.0f} ms, for a free slot "
                  f"{waited[v][1] / a.pairs * 1e3:.0f} ms, for a late peer "
                  f"{waited[v][2] / a.pairs * 1e3:.0f} ms", flush=True)
    for (model, call), (n, ns) in sorted(CALLS.items()):
        print(f"rank {info.rank} {model}: {call:36s} {n / a.pairs:7.0f} a step, "
              f"{ns / n / 1e3:6.1f} us of thread time a call", flush=True)


CO_STEP_S: list = []     # seconds of each co_step of the step being timed


def _time_co_steps():
    """Time every `co_step` call of DHelix's schedule (F(1), each co-step, B(N))."""
    from dhelix.schedules import dhelix as sched
    inner = sched.co_step

    def timed(*args, **kw):
        t0 = time.perf_counter()
        out = inner(*args, **kw)
        CO_STEP_S.append(time.perf_counter() - t0)
        return out
    sched.co_step = timed


CALLS: dict = {}          # (model, call) -> [calls, thread ns] over the counted pairs
CALLS_OF = [None]         # the model being timed (None: the warm-up pair)


def _time_link_calls():
    """Count every paced-link call's thread time under the model being timed."""
    from dhelix.links import paced, shm

    def timed(name, fn):
        def call(*args, **kw):
            t0 = time.thread_time_ns()
            out = fn(*args, **kw)
            if CALLS_OF[0] is not None:
                c = CALLS.setdefault((CALLS_OF[0], name), [0, 0])
                c[0] += 1
                c[1] += time.thread_time_ns() - t0
            return out
        return call
    shm.ShmGroup.issue = timed("shm issue (copy in)", shm.ShmGroup.issue)
    shm.ShmWork.read = timed("shm read (copies/sums out)", shm.ShmWork.read)
    paced.PacedLink.schedule = timed("link schedule()", paced.PacedLink.schedule)
    paced.PacedWork.wait = timed("wait (read, spin to the end)", paced.PacedWork.wait)
    direct, wrap = paced.direct, paced._wrap

    def timed_direct(pg, kind):
        fn = direct(pg, kind)
        return None if fn is None else timed(f"lane {kind} (issue)", fn)

    def timed_wrap(orig, link, collective, arg, name):
        return timed(f"torch.distributed {name}", wrap(orig, link, collective, arg, name))
    paced.direct, paced._wrap = timed_direct, timed_wrap


if __name__ == "__main__":
    main()
