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


def write_random_plan(path, config, seed, mbs=2, rotation=0, mlp_chunks=1,
                      keep_gathered=False):
    """A random legal plan for `config`'s layer (TP=2, SP, seq 64, micro-batch `mbs`, the
    MLP's forward in `mlp_chunks`, the gathered inputs kept with `keep_gathered`), β's
    chain rotated by `rotation`."""
    import random
    from dhelix.planner.enumerate import random_legal_plan
    import layer_fns
    _, dh, _, _ = layer_fns.setup_layer(config, 2, True, 1, 64, mbs, mlp_chunks=mlp_chunks,
                                        keep_gathered=keep_gathered)
    import torch.distributed as dist
    if dist.get_rank() == 0:
        random_legal_plan(dh.program.layer_ops(64, mbs), random.Random(seed),
                          rotation=rotation).save(path)
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


def train_random_plans(plan_dir, seeds, **kw):
    """Many random legal plans in ONE process group (one spawn): `train()` is run
    repeatedly in this process — megatron's schedule first, then `--dhelix` with one
    random legal plan per seed, then megatron's schedule once more — each a whole run from
    the same seed and data (`train` re-initialises megatron's parallel state and seeds).

    Each plan is `random_legal_plan(ops, random.Random(seed))` (odd seeds: rotated by a
    random r; about half of them with β's node in a random legal order) on the ops of the layer
    these runs train (`kw`'s config, TP, SP, seq length and micro-batch size), written by
    rank 0 to `plan_dir/seed{seed}.json` and passed as `--dhelix-plan`. The digest of the
    plan each run's layers were actually given (`PlanBook.for_layer`) is recorded.

    Returns {"baseline": result, "baseline_again": result, "plans": [{"seed", "digest",
    "paired", "steps", "used", "result"}, ...]} (results as `train_result`'s)."""
    import os
    import random

    import torch.distributed as dist

    from dhelix.planner.enumerate import random_legal_plan
    from dhelix.schedules.plans import PlanBook
    import layer_fns

    kw.setdefault("quiet", True)
    kw.setdefault("checksums", True)
    cfg = TrainConfig(**kw)
    _, dh, _, _ = layer_fns.setup_layer(cfg.config, cfg.tensor_model_parallel_size,
                                        cfg.sequence_parallel, 1, cfg.seq_length,
                                        cfg.micro_batch_size)
    ops = dh.program.layer_ops(cfg.seq_length, cfg.micro_batch_size)
    del dh

    import dhelix.strand.executor as ex
    used, rotated = [], []
    orig_for_layer, orig_rotated = PlanBook.for_layer, ex._run_rotated

    def for_layer(self, layer):
        plan = orig_for_layer(self, layer)
        used.append(plan.digest())
        return plan

    def run_rotated(*a, **k):           # a layer step across two β nodes
        rotated.append(1)
        return orig_rotated(*a, **k)

    out = {"baseline": train(TrainConfig(**kw)), "plans": []}
    PlanBook.for_layer, ex._run_rotated = for_layer, run_rotated
    try:
        for seed in seeds:
            rng = random.Random(seed)
            # odd seeds: β's chain rotated (`Plan.rotation`), by a random r
            rot = rng.randrange(1, len(ops.backward)) if seed % 2 else 0
            plan = random_legal_plan(ops, rng, rotation=rot)
            path = os.path.join(plan_dir, f"seed{seed}.json")
            if dist.get_rank() == 0:
                plan.save(path)
            dist.barrier()
            used.clear()
            rotated.clear()
            res = train(TrainConfig(**kw, dhelix={"enabled": True, "plan": path}))
            out["plans"].append({"seed": seed, "digest": plan.digest(),
                                 "rotation": plan.rotation, "rotated_steps": len(rotated),
                                 "reordered": plan.backward != [o.name for o in ops.backward],
                                 "paired": plan.num_paired(), "steps": len(plan.steps),
                                 "used": sorted(set(used)), "result": res})
    finally:
        PlanBook.for_layer, ex._run_rotated = orig_for_layer, orig_rotated
    out["baseline_again"] = train(TrainConfig(**kw))
    return out


def eval_from_checkpoint(scratch, ckpt_iters, **kw):
    """Evaluation of both schedules from the SAME weights: megatron's schedule trains
    `ckpt_iters` steps and saves a checkpoint (`scratch/ckpt`); megatron's schedule and
    `--dhelix` each load it and evaluate (`train_iters=0`, `eval_iters` steps of
    forward_only) from the start of the same data. Records, per
    run, each eval micro-batch's loss on this rank (the `lm loss` the schedule returned,
    not the trainer's average) and the route eval took: the forward_backward calls with
    forward_only=True, megatron's `forward_backward_no_pipelining` calls, DHelix layer
    forwards, and layer nodes made (a node is DHelix's paired path); with
    `checksums=True`, the checksums of the weights each run evaluated ("weights") and of
    the weights saved ("saved")."""
    import megatron.core.pipeline_parallel.schedules as ms

    import dhelix.train.trainer as trainer
    from dhelix.strand.layer import DHelixLayer
    from dhelix.strand.node import LayerNode

    kw.setdefault("quiet", True)
    ckpt = f"{scratch}/ckpt"
    saved = train(TrainConfig(**{**kw, "eval_iters": 0, "checksums": True},
                              train_iters=ckpt_iters, save=ckpt))
    out = {"saved": saved["weight_checksums"]}
    for name, opts in (("megatron", {}), ("dhelix", {"enabled": True})):
        rec = {"losses": [], "forward_only_calls": 0, "no_pipelining_calls": 0,
               "dhelix_layer_forwards": 0, "nodes": 0}
        patched = []

        def patch(owner, attr, wrap):
            orig = getattr(owner, attr)
            patched.append((owner, attr, orig))
            setattr(owner, attr, wrap(orig))

        def wrap_make(orig):
            def make(options):
                s = orig(options)
                fb = s.forward_backward

                def forward_backward(**a):
                    res = fb(**a)
                    if a.get("forward_only"):
                        rec["forward_only_calls"] += 1
                        rec["losses"] += [o["lm loss"].item() for o in res]
                    return res
                s.forward_backward = forward_backward
                return s
            return make

        def count(key):
            def wrap(orig):
                def f(*a, **k):
                    rec[key] += 1
                    return orig(*a, **k)
                return f
            return wrap

        patch(trainer, "make_schedule", wrap_make)
        patch(ms, "forward_backward_no_pipelining", count("no_pipelining_calls"))
        patch(DHelixLayer, "forward", count("dhelix_layer_forwards"))
        patch(LayerNode, "__init__", count("nodes"))
        try:
            res = train(TrainConfig(**kw, train_iters=0, load=ckpt, finetune=True, save=f"{scratch}/{name}",
                                    dhelix=opts))
        finally:
            for owner, attr, orig in reversed(patched):
                setattr(owner, attr, orig)
        rec["schedule"] = res["config"]["schedule"]
        rec["eval_loss"] = res["eval_loss"]
        rec["weights"] = res.get("weight_checksums")
        out[name] = rec
    return out
