"""Per-rank bodies of the strict-lane tests: minimal reproductions of the three bug
classes that CUDA streams and NCCL would show and plain gloo hides."""
import gc

import torch
import torch.distributed as dist


def _lanes(strict=True, keep=True, timeout=20.0):
    from dhelix.strand.lanes import CpuLanes
    from dhelix.strand.strict import StrictLanes
    return StrictLanes(keep_inputs=keep, timeout_s=timeout) if strict else CpuLanes()


def _outcome(fn):
    from dhelix.strand.strict import StrictLaneError
    try:
        return "ok", fn()
    except StrictLaneError as e:
        return "error", str(e)


def lost_input(keep: bool):
    """Class 1: the caller drops a reduce-scatter's input right after launch (as
    `_rscatter` does); only the lane's own reference may keep it alive."""
    lanes, r = _lanes(keep=keep), dist.get_rank()
    group = dist.new_group([0, 1])
    x = torch.arange(8, dtype=torch.float32) + 100 * r
    p = lanes.reduce_scatter("rs_attn", x, group, "intra")
    del x
    gc.collect()
    return _outcome(lambda: lanes.resolve(p).tolist())


def written_input():
    """Class 1: the caller writes an all-gather's input in place before waiting for it."""
    lanes, r = _lanes(), dist.get_rank()
    group = dist.new_group([0, 1])
    x = torch.full((4,), float(r))
    p = lanes.all_gather("ag_mlp", x, group, "intra")
    x.add_(1.0)
    return _outcome(lambda: lanes.resolve(p).tolist())


def old_lane_in_a_layer(plan_seed: int):
    """Class 1 in the real program: a DHelix layer step (TP=2+SP, a random plan) on a
    lane that, like the old CudaLanes, keeps nothing but the output."""
    import random

    import layer_fns
    from dhelix.planner.enumerate import random_legal_plan
    from dhelix.strand import lanes as L
    ref, dh, cfg, rope = layer_fns.setup_layer("tiny", 2, True, 5, 16, 2)
    xs = [layer_fns.inputs(cfg, 16, 2, 6 + i, True) for i in range(3)]
    plan = random_legal_plan(dh.program.layer_ops(16, 2), random.Random(plan_seed))
    orig = L.make_lanes
    L.make_lanes = lambda device=None: _lanes(keep=False)
    try:
        def step():
            layer_fns.dhelix_step(dh, plan, *xs, rope, 16, 2)
        return _outcome(step)
    finally:
        L.make_lanes = orig


def crossed_p2p(strict: bool, batched: bool):
    """Class 3: each rank receives from the other before sending to it (the old fold:
    stage 0 waits for F1(1) before sending B1(0), stage 1 for B1(0) before F1(1))."""
    lanes, r = _lanes(strict=strict, timeout=5.0), dist.get_rank()
    group = dist.new_group([0, 1])
    peer = 1 - r
    a, buf = torch.full((4,), float(r + 1)), torch.zeros(4)
    if batched:
        lanes.resolve(lanes.p2p("p2p", [(a, peer, 7)], [(buf, peer, 7)], group, "intra"))
    else:
        rp = lanes.recv("p2p_recv", buf, peer, group, "intra", tag=7)
        sp = lanes.send("p2p_send", a, peer, group, "intra", tag=7)
        lanes.resolve(rp)
        lanes.resolve(sp)
    return buf.tolist()


def reordered_p2p(strict: bool):
    """NCCL matches by posting order: rank 0 sends tag 1 then tag 2; rank 1 posts its
    receives the other way round (gloo's tags would forgive it)."""
    lanes, r = _lanes(strict=strict, timeout=5.0), dist.get_rank()
    group = dist.new_group([0, 1])
    if r == 0:
        ps = [lanes.send("p2p_send", torch.ones(4), 1, group, "intra", tag=1),
              lanes.send("p2p_send", torch.ones(8), 1, group, "intra", tag=2)]
    else:
        ps = [lanes.recv("p2p_recv", torch.empty(8), 0, group, "intra", tag=2),
              lanes.recv("p2p_recv", torch.empty(4), 0, group, "intra", tag=1)]
    for p in ps:
        lanes.resolve(p)
    return "ok"


def lanes_in_use():
    from dhelix.strand.lanes import make_lanes
    return type(make_lanes()).__name__
