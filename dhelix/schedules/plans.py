"""Which plan each layer runs: the plan book, filled from the `--dhelix*` options."""
from __future__ import annotations

from typing import Callable, Optional

from dhelix.planner.plan import (Plan, PlanError, check_same_plan_across_ranks, paired_plan,
                                 trivial_plan, validate)
from dhelix.strand.program import layers_per_chunk


class PlanBook:
    """The plan of every layer: one plan per layer signature, validated against the
    layer's op chains and checked to be the same on every rank."""

    def __init__(self, seq_length: int, micro_batch_size: int,
                 plan: Optional[Plan] = None,
                 make_plan: Callable = trivial_plan, source: str = "<plan>"):
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.plan, self.make_plan, self.source = plan, make_plan, source
        self._by_sig = {}
        self._by_layer = {}

    def for_layer(self, layer) -> Plan:
        plan = self._by_layer.get(id(layer))
        if plan is not None:
            return plan
        ops = layer.program.layer_ops(self.seq_length, self.micro_batch_size)
        ops.co_step_layers = layers_per_chunk(layer.config)   # the layer pairs of a co-step
        sig = ops.signature()
        if sig not in self._by_sig:
            plan = self.plan if self.plan is not None else self.make_plan(ops)
            validate(plan, ops, self.source)
            check_same_plan_across_ranks(plan, self.source)
            self._by_sig[sig] = plan
        self._by_layer[id(layer)] = self._by_sig[sig]
        return self._by_sig[sig]


def plan_book_from_options(opts: dict, seq_length: int, micro_batch_size: int) -> PlanBook:
    """--dhelix-plan FILE wins; else the planner's plan from --dhelix-overlap-table (a
    measured table) or --dhelix-cluster (analytical); else the built-in paired plan."""
    builtin = {"trivial": trivial_plan, "paired": paired_plan}
    if opts.get("emulated_plan"):       # paced compute: planned for the emulated shape
        return PlanBook(seq_length, micro_batch_size, make_plan=opts["emulated_plan"],
                        source="the planner's plan for the emulated shape (--emulate)")
    if opts.get("plan") in builtin:
        return PlanBook(seq_length, micro_batch_size, make_plan=builtin[opts["plan"]],
                        source=f"built-in {opts['plan']} plan")
    if opts.get("plan"):
        return PlanBook(seq_length, micro_batch_size, plan=Plan.load(opts["plan"]),
                        source=opts["plan"])
    table_path: Optional[str] = opts.get("overlap_table")
    cluster: Optional[str] = opts.get("cluster")
    if table_path or cluster:
        budget = opts.get("memory_budget")
        force = bool(opts.get("force"))

        def make(layer_ops):
            from dhelix.planner import dp
            from dhelix.planner.min_gain import MIN_GAIN
            from dhelix.planner.costs import CostTable
            if table_path:
                table = CostTable.load(table_path, layer=layer_ops, force=force,
                                       pairs="concurrent")
                check_hardware(table, table_path, force)
            else:
                from dhelix.models.config import find_named_yaml
                from dhelix.planner.costmodel import (ClusterError, analytical_table,
                                                      group_sizes_of, load_cluster)
                path = find_named_yaml(cluster, "clusters", "--dhelix-cluster", "cluster",
                                       ClusterError)
                table = analytical_table(layer_ops, load_cluster(path),
                                         group_sizes_of(layer_ops.shape, layer_ops),
                                         dtype="bf16" if layer_ops.shape["dtype_bytes"] == 2
                                         else "fp32")
            plan = dp.plan(layer_ops, table, memory_budget_bytes=budget, force=force,
                           rotate=True, reorder=True,
                           num_layers=getattr(layer_ops, "co_step_layers", None),
                           min_gain=MIN_GAIN)
            say_kept_trivial(plan, table_path or cluster)
            return plan
        return PlanBook(seq_length, micro_batch_size, make_plan=make,
                        source=table_path or cluster)
    return PlanBook(seq_length, micro_batch_size, make_plan=paired_plan, source="built-in")


def say_kept_trivial(plan: Plan, source: str) -> None:
    """One line on rank 0 when the planner gave the trivial plan the layer (`min_gain.keep_trivial`):
    nothing worth pairing was predicted, so the run is not silently unpaired."""
    kept = plan.meta.get("kept_trivial")
    if not kept:
        return
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(f"dhelix: planned from {source}: the best plan gains {kept['gain'] * 100:.1f}% "
          f"over the trivial plan (under {kept['min_gain'] * 100:g}%): running the trivial "
          f"plan (`dhelix plan --min-gain 0` writes the best one for --dhelix-plan)",
          flush=True)


def check_hardware(table, path: str, force: bool) -> None:
    """A table measured on other hardware or another link is refused unless forced."""
    from dhelix.planner.costs import TableError
    from dhelix.base.hardware import hardware
    theirs = table.provenance.get("hardware")
    mine = hardware()
    if theirs and theirs != mine and not force:
        raise TableError(f"{path}: measured on {theirs}, this run is on {mine}; profile "
                         f"this cluster with `dhelix profile` or pass --dhelix-force")


__all__ = ["PlanBook", "plan_book_from_options", "PlanError", "check_hardware"]
