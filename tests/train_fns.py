"""Functions the multi-rank tests run on every rank (importable by spawned processes)."""
from dhelix.train.trainer import TrainConfig, train


def train_losses(**kw):
    kw.setdefault("quiet", True)
    return train(TrainConfig(**kw))["losses"]


def train_result(**kw):
    kw.setdefault("quiet", True)
    return train(TrainConfig(**kw))


def write_plan_for(path, config):
    """Write the paired plan of `config`'s layer (TP=2, SP, seq 64, mbs 2) to `path`."""
    from dhelix.planner.plan import paired_plan
    import layer_fns
    _, dh, _, _ = layer_fns.setup_layer(config, 2, True, 1, 64, 2)
    import torch.distributed as dist
    if dist.get_rank() == 0:
        paired_plan(dh.program.layer_ops(64, 2)).save(path)
    dist.barrier()
    return path


def write_random_plan(path, config, seed, mbs=2):
    """A random legal plan for `config`'s layer (TP=2, SP, seq 64, micro-batch `mbs`)."""
    import random
    from dhelix.planner.enumerate import random_legal_plan
    import layer_fns
    _, dh, _, _ = layer_fns.setup_layer(config, 2, True, 1, 64, mbs)
    import torch.distributed as dist
    if dist.get_rank() == 0:
        random_legal_plan(dh.program.layer_ops(64, mbs), random.Random(seed)).save(path)
    dist.barrier()
    return path


def invariant_probe():
    """Train with --dhelix while recording every Python thread started and the autograd
    graph task id at each node backward entry (layer nodes and pre-process nodes)."""
    import threading

    import torch

    from dhelix.schedules.microbatch import BackwardWalk
    from dhelix.strand.node import LayerNode

    seen = {"threads_started": 0, "lane_threads": 0, "task_ids": []}
    orig_start, orig_begin, orig_pre = threading.Thread.start, LayerNode.begin_backward, \
        BackwardWalk.pre

    def start(self, *a, **k):
        # strict lanes play each lane's stream on a worker thread that only moves data
        lane = self.name.startswith("dhelix-lane-")
        seen["lane_threads" if lane else "threads_started"] += 1
        return orig_start(self, *a, **k)

    def begin(self, *a, **k):
        seen["task_ids"].append(torch._C._current_graph_task_id())
        return orig_begin(self, *a, **k)

    def pre(self, *a, **k):
        seen["task_ids"].append(torch._C._current_graph_task_id())
        return orig_pre(self, *a, **k)

    threading.Thread.start, LayerNode.begin_backward, BackwardWalk.pre = start, begin, pre
    try:
        train(TrainConfig(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
                          train_iters=3, micro_batch_size=2, global_batch_size=6, quiet=True,
                          dhelix={"enabled": True}))
    finally:
        threading.Thread.start, LayerNode.begin_backward, BackwardWalk.pre = \
            orig_start, orig_begin, orig_pre
    return seen


def node_backward_inside_autograd():
    """Call a layer node's backward from inside an autograd Function's backward."""
    import torch
    import layer_fns
    from dhelix.strand.lanes import make_lanes
    from dhelix.strand.node import LayerNode, NodeOrderError

    _, dh, cfg, rope = layer_fns.setup_layer("tiny", 1, False, 1, 16, 2)
    x = layer_fns.inputs(cfg, 16, 2, 3, False)
    node = LayerNode(dh, x, {"attention_mask": None, "rotary_pos_emb": rope}, make_lanes())
    seen = {}

    class Inside(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            try:
                node.begin_backward(x)
            except NodeOrderError as e:
                seen["msg"] = str(e)
            return g

    t = torch.ones(2, requires_grad=True)
    Inside.apply(t).sum().backward()
    return seen.get("msg", "no error")
