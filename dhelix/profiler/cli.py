"""`dhelix profile` and `dhelix validate-model`: run on the real ranks of a job."""
from __future__ import annotations

import os


def _add(sub, name, help_, func):
    from dhelix.cli import add_launch_args
    from dhelix.train.args import add_model_args
    p = sub.add_parser(name, help=help_)
    add_model_args(p)
    add_launch_args(p)
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs before each measurement (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs per measurement; the median is kept (default: "
                        "%(default)s; validate-model on a noisy machine: 20)")
    p.set_defaults(func=func)
    return p


def register(sub):
    p = _add(sub, "profile", "measure the pairwise overlap table of a layer on these ranks",
             cmd_profile)
    p.add_argument("--out", default="table.json", help="table JSON (a .csv view beside it)")
    p.add_argument("--pairs", choices=["concurrent", "all"], default="concurrent",
                   help="measure only pairs on different lanes (what the simulator reads) "
                        "or every forward × backward pair")
    p = _add(sub, "validate-model", "compare simulated and measured layer-step times of "
             "random legal plans", cmd_validate)
    p.add_argument("--table", default=None, help="pairwise table; default: profile now")
    p.add_argument("--plans", type=int, default=30, help="random legal plans (>= 30)")
    p.add_argument("--out", default="validate-model", help="prefix for .json and .png")
    p.add_argument("--force", action="store_true",
                   help="use a --table made for another layer shape or machine anyway")


def _on_ranks(a, argv, body) -> int:
    """Under --nproc start the ranks; on a rank, run body(harness, model, rank0)."""
    if a.nproc:
        from dhelix.cli import spawn
        return spawn(a, argv)
    from dhelix.cli import run_here
    from dhelix.models.config import load_model_config
    from dhelix.profiler.harness import LayerHarness
    from dhelix.train.dist import init_distributed

    def on_rank():
        from dhelix.train.config import TrainConfig, model_of
        m = model_of(TrainConfig(
            config=a.config, num_experts=a.num_experts, moe_router_topk=a.moe_router_topk,
            moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size))
        info = init_distributed()
        tp, ep = a.tensor_model_parallel_size, a.expert_model_parallel_size
        cp = a.context_parallel_size
        if cp < 1 or info.world_size % (tp * cp) or (info.world_size // tp) % ep:
            raise ValueError(f"world size {info.world_size} is not divisible by "
                             f"--tensor-model-parallel-size {tp} × "
                             f"--context-parallel-size {cp} (or by "
                             f"--expert-model-parallel-size {ep})")
        if cp > 1:
            from dhelix.models.ring_attention import check_split
            check_split(a.seq_length, cp)
        if ep > 1 and not m.num_experts:
            raise ValueError(f"--expert-model-parallel-size {ep}: {m.name} has no experts")
        h = LayerHarness(m, tp, a.sequence_parallel, a.seq_length,
                         a.micro_batch_size, a.bf16, a.seed, info.device, ep=ep, cp=cp)
        body(h, m, info.rank == 0)
    return run_here(a.cmd, on_rank)


def cmd_profile(a, argv) -> int:
    from dhelix.profiler.profile import profile_layer

    def body(h, m, rank0):
        table = profile_layer(h, m, a.bf16, a.warmup, a.repeats, show_progress=rank0,
                              pairs=a.pairs)
        if rank0:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            table.save(a.out)
            csv = os.path.splitext(a.out)[0] + ".csv"
            table.write_csv(csv)
            oefs = [table.oef(f, b) for f, b in table.pair] or [0.0]
            print(f"dhelix profile: {len(table.alone_f)} forward × {len(table.alone_b)} "
                  f"backward ops, {len(table.pair)} pairs -> {a.out}, {csv}")
            print(f"  OEF median {sorted(oefs)[len(oefs) // 2]:.2f}, min {min(oefs):.2f}, "
                  f"max {max(oefs):.2f}")
    return _on_ranks(a, argv, body)


def cmd_validate(a, argv) -> int:
    from dhelix.planner.costs import CostTable
    from dhelix.profiler.profile import profile_layer
    from dhelix.profiler.validate import save, scatter, validate_model

    def body(h, m, rank0):
        if a.table:
            table = CostTable.load(a.table, layer=h.ops, force=a.force, pairs="concurrent")
        else:
            table = profile_layer(h, m, a.bf16, a.warmup, a.repeats, show_progress=rank0)
            if rank0:
                os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
                table.save(a.out + ".table.json")
        res = validate_model(h, table, a.plans, a.warmup, a.repeats, seed=a.seed,
                             show_progress=rank0)
        if rank0:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            save(res, a.out + ".json")
            scatter(res, a.out + ".png")
            print(f"dhelix validate-model: {res['n']} plans | Spearman "
                  f"{res['spearman']:.3f} | median |error| {res['median_abs_error'] * 100:.1f}%"
                  f" -> {a.out}.json, {a.out}.png")
            for name in ("trivial", "paired", "dp"):
                k = res["plans"].index(name)
                print(f"  {name:8s} measured {res['measured_s'][k] * 1e3:8.2f} ms | "
                      f"simulated {res['predicted_s'][k] * 1e3:8.2f} ms")
    return _on_ranks(a, argv, body)
