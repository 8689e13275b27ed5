"""`dhelix profile` and `dhelix validate-model` on this rank (dhelix/cli/ starts the
ranks and parses the flags): the layer harness for the options' shape, then the pairwise
overlap table, or the simulated-vs-measured comparison of random legal plans."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass
class ProfileOptions:
    # the layer shape and parallel sizes, as `dhelix train` takes them
    config: str = "tiny"
    seq_length: int = 64
    micro_batch_size: int = 2
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    bf16: bool = False
    seed: int = 1234
    expert_model_parallel_size: int = 1
    num_experts: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_router_topk: Optional[int] = None
    dhelix_mlp_chunks: int = 1       # the MLP forward in chunks (`planner.chains`)
    # the measurement
    warmup: int = 1                  # untimed runs before each measurement
    repeats: int = 5                 # timed runs per measurement; the median is kept
    out: str = "table.json"          # profile: the table; validate-model: a prefix
    pairs: str = "concurrent"        # profile: "concurrent" or "all"
    step_extras: bool = True         # profile: also embedding, loss, optimizer, finalize
    table: Optional[str] = None      # validate-model: the table (default: profile now)
    plans: int = 30                  # validate-model: random legal plans
    force: bool = False              # validate-model: a table of another shape anyway


def _on_rank(o: ProfileOptions, body) -> None:
    """body(harness, model, rank0) on this rank's harness for the options' layer."""
    from dhelix.profiler.harness import LayerHarness
    from dhelix.train.config import TrainConfig, model_of
    from dhelix.train.dist import init_distributed
    m = model_of(TrainConfig(
        config=o.config, num_experts=o.num_experts, moe_router_topk=o.moe_router_topk,
        moe_shared_expert_intermediate_size=o.moe_shared_expert_intermediate_size))
    info = init_distributed()
    tp, ep = o.tensor_model_parallel_size, o.expert_model_parallel_size
    cp = o.context_parallel_size
    if cp < 1 or info.world_size % (tp * cp) or (info.world_size // tp) % ep:
        raise ValueError(f"world size {info.world_size} is not divisible by "
                         f"--tensor-model-parallel-size {tp} × "
                         f"--context-parallel-size {cp} (or by "
                         f"--expert-model-parallel-size {ep})")
    if cp > 1:
        from dhelix.models.ring_attention import check_split
        check_split(o.seq_length, cp)
    if ep > 1 and not m.num_experts:
        raise ValueError(f"--expert-model-parallel-size {ep}: {m.name} has no experts")
    h = LayerHarness(m, tp, o.sequence_parallel, o.seq_length,
                     o.micro_batch_size, o.bf16, o.seed, info.device, ep=ep, cp=cp,
                     mlp_chunks=o.dhelix_mlp_chunks)
    body(h, m, info.rank == 0)


def profile_here(o: ProfileOptions) -> None:
    """Measure the pairwise overlap table; rank 0 writes it (JSON and a .csv view)."""
    from dhelix.profiler.profile import profile_layer

    def body(h, m, rank0):
        table = profile_layer(h, m, o.bf16, o.warmup, o.repeats, show_progress=rank0,
                              pairs=o.pairs)
        if o.step_extras:
            # the rest of a training step, on the model `dhelix train` builds (last: it
            # sets up megatron's parallel state again, as the trainer does)
            from dhelix.profiler.step_extras import profile_step_extras
            table.step_extras = profile_step_extras(o, m, h.device, o.warmup, o.repeats,
                                                    show_progress=rank0)
        if rank0:
            os.makedirs(os.path.dirname(os.path.abspath(o.out)), exist_ok=True)
            table.save(o.out)
            csv = os.path.splitext(o.out)[0] + ".csv"
            table.write_csv(csv)
            oefs = [table.oef(f, b) for f, b in table.pair] or [0.0]
            print(f"dhelix profile: {len(table.alone_f)} forward × {len(table.alone_b)} "
                  f"backward ops, {len(table.pair)} pairs -> {o.out}, {csv}")
            print(f"  OEF median {sorted(oefs)[len(oefs) // 2]:.2f}, min {min(oefs):.2f}, "
                  f"max {max(oefs):.2f}")
            x = table.step_extras
            if x is not None:
                print(f"  step extras ({x.num_layers} layers, DP {x.data_parallel_size}): "
                      f"embedding fwd {x.pre_fwd_s * 1e3:.2f} / bwd {x.pre_bwd_s * 1e3:.2f} ms, "
                      f"loss fwd {x.post_fwd_s * 1e3:.2f} / bwd {x.post_bwd_s * 1e3:.2f} ms "
                      f"per micro-batch; optimizer {x.optimizer_s * 1e3:.2f} ms, finalize "
                      f"{x.finalize_s * 1e3:.2f} ms, zero grad {x.zero_grad_s * 1e3:.2f} ms "
                      f"per step")
    _on_rank(o, body)


def validate_here(o: ProfileOptions) -> None:
    """Simulated vs measured layer-step times of random legal plans; rank 0 writes
    `out`.json and `out`.png."""
    from dhelix.planner.costs import CostTable
    from dhelix.profiler.profile import profile_layer
    from dhelix.profiler.validate import save, scatter, validate_model

    def body(h, m, rank0):
        if o.table:
            table = CostTable.load(o.table, layer=h.ops, force=o.force, pairs="concurrent")
        else:
            table = profile_layer(h, m, o.bf16, o.warmup, o.repeats, show_progress=rank0)
            if rank0:
                os.makedirs(os.path.dirname(os.path.abspath(o.out)), exist_ok=True)
                table.save(o.out + ".table.json")
        res = validate_model(h, table, o.plans, o.warmup, o.repeats, seed=o.seed,
                             show_progress=rank0)
        if rank0:
            os.makedirs(os.path.dirname(os.path.abspath(o.out)), exist_ok=True)
            save(res, o.out + ".json")
            scatter(res, o.out + ".png")
            print(f"dhelix validate-model: {res['n']} plans | Spearman "
                  f"{res['spearman']:.3f} | median |error| {res['median_abs_error'] * 100:.1f}%"
                  f" -> {o.out}.json, {o.out}.png")
            for name in ("trivial", "paired", "dp"):
                k = res["plans"].index(name)
                print(f"  {name:8s} measured {res['measured_s'][k] * 1e3:8.2f} ms | "
                      f"simulated {res['predicted_s'][k] * 1e3:8.2f} ms")
    _on_rank(o, body)
