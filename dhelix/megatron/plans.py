"""Which plan a run uses, from the `--dhelix*` options (plain dict)."""
from __future__ import annotations

from typing import Optional

from dhelix.planner.plan import Plan, PlanError, paired_plan, trivial_plan
from dhelix.strand.runner import PlanBook


def plan_book_from_options(opts: dict, seq_length: int, micro_batch_size: int) -> PlanBook:
    """--dhelix-plan FILE wins; else the planner's plan from --dhelix-overlap-table (a
    measured table) or --dhelix-cluster (analytical); else the built-in paired plan."""
    builtin = {"trivial": trivial_plan, "paired": paired_plan}
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
            from dhelix.planner.costs import CostTable
            if table_path:
                table = CostTable.load(table_path, layer=layer_ops, force=force,
                                       pairs="concurrent")
                check_hardware(table, table_path, force)
            else:
                from dhelix.models.config import find_named_yaml
                from dhelix.planner.costmodel import ClusterError, analytical_table, load_cluster
                path = find_named_yaml(cluster, "clusters", "--dhelix-cluster", "cluster",
                                       ClusterError)
                table = analytical_table(layer_ops, load_cluster(path),
                                         {"tp": layer_ops.shape["tp"]},
                                         dtype="bf16" if layer_ops.shape["dtype_bytes"] == 2
                                         else "fp32")
            return dp.plan(layer_ops, table, memory_budget_bytes=budget, force=force)
        return PlanBook(seq_length, micro_batch_size, make_plan=make,
                        source=table_path or cluster)
    return PlanBook(seq_length, micro_batch_size, make_plan=paired_plan, source="built-in")


def check_hardware(table, path: str, force: bool) -> None:
    """A table measured on other hardware or another link is refused unless forced."""
    from dhelix.planner.costs import TableError
    from dhelix.profiler.profile import hardware
    theirs = table.provenance.get("hardware")
    mine = hardware()
    if theirs and theirs != mine and not force:
        raise TableError(f"{path}: measured on {theirs}, this run is on {mine}; profile "
                         f"this cluster with `dhelix profile` or pass --dhelix-force")


__all__ = ["plan_book_from_options", "PlanError", "check_hardware"]
