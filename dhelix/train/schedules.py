"""The forward-backward schedule of a run, chosen by its `--dhelix*` options. It lives
above the schedules and the fold (dhelix/schedules/, dhelix/folding/) since it knows them
all."""
from __future__ import annotations


def make_schedule(options: dict):
    """The schedule for a run's `--dhelix*` options (plain dict)."""
    if options.get("peer") == "intra-batch":
        from dhelix.schedules.intra_batch import IntraBatchSchedule
        return IntraBatchSchedule(options)
    if options.get("enabled") and options.get("fold"):
        from dhelix.folding.schedule import FoldedSchedule
        return FoldedSchedule(options)
    if options.get("enabled"):
        from dhelix.schedules.dhelix import DHelixSchedule
        return DHelixSchedule(options)
    from dhelix.schedules.megatron import MegatronSchedule
    return MegatronSchedule()
