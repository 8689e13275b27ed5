"""Issue 21 item 7: a layer node hands each weight gradient to autograd as soon as its
last contribution is in, and drops its input when its backward ends.

The rank bodies run one TP=1 dense layer (`layer_fns.setup_layer`) as a layer node, its
backward op by op (tiles=1) or step by step as `run_tiles` runs the intra-batch peer's
two halves (tiles=2), and look at what the node holds between steps.
"""
import pytest

from dhelix.testing import run_ranks

SEQ, MBS = 16, 2


# ---- rank bodies -------------------------------------------------------------------------
def _layer(seed=5, tp=1):
    import layer_fns
    sp = tp > 1
    _, dh, cfg, rope = layer_fns.setup_layer("tiny", tp=tp, sp=sp, seed=seed, seq=SEQ,
                                             mbs=MBS)
    x = layer_fns.inputs(cfg, SEQ, MBS, seed + 1, sp)
    g = layer_fns.inputs(cfg, SEQ, MBS, seed + 2, sp)
    return dh, rope, x, g


def _segments(program):
    from dhelix.planner.plan import comm_runs
    ops = program.backward_ops
    return [[program.bwd[n] for n in seg] for seg in comm_runs([o.spec for o in ops])]


def _steps(program, states):
    """The backward as the schedules run it, one observable step at a time: tiles=1 op
    by op; tiles=2 as `run_tiles` (half a's segment k beside half b's k-1)."""
    if len(states) == 1:
        return [((states[0], [o]), None) for o in program.backward_ops]
    segs = _segments(program)
    a, b = states
    return [((a, segs[k]) if k < len(segs) else None, (b, segs[k - 1]) if k else None)
            for k in range(len(segs) + 1)]


def _node_backward(dh, rope, x, g, tiles, observe=None):
    """Forward and backward of one node; `observe(node, step)` after each backward step.
    Returns each parameter's gradient (.grad, set to None before) and the input grad."""
    from dhelix.strand.executor import execute_step, run_tiles
    from dhelix.strand.lanes import make_lanes
    from dhelix.strand.node import LayerNode
    for p in dh.parameters():
        p.grad = None
    node = LayerNode(dh, x, {"attention_mask": None, "rotary_pos_emb": rope}, make_lanes(),
                     tiles=tiles)
    run_tiles(dh.program, node.states, "fwd")
    node.finish_forward()
    node.begin_backward(g)
    for k, (a, b) in enumerate(_steps(dh.program, node.states)):
        execute_step(a, b)
        if observe is not None:
            observe(node, k)
    gx = node.finish_backward()
    return {n: p.grad for n, p in dh.named_parameters()}, gx, node


def _nbytes(t):
    return t.numel() * t.element_size()


def held_gradients(tiles, tp=1):
    """First node backward of the program (learns the counts: holds every gradient to
    the end, as before), then two more: after every backward step, the bytes the node
    holds and the parameters whose .grad has arrived."""
    import torch
    from dhelix.strand.node import _GRAD_COUNTS
    dh, rope, x, g = _layer(tp=tp)
    params = dict(dh.named_parameters())
    size = {n: _nbytes(p) for n, p in params.items()}
    log = []

    def observe(node, k):
        log.append((node.held_grad_bytes(), sorted(n for n, p in params.items()
                                                   if p.grad is not None)))
    hold, gx_hold, _ = _node_backward(dh, rope, x, g, tiles, observe)
    first, log = log, []
    learnt = dict(_GRAD_COUNTS[dh.program])
    hand, gx_hand, node = _node_backward(dh, rope, x, g, tiles, observe)
    # the op → parameters map, seen from outside: what arrived after each op at tiles=1
    names = [o.name for o in dh.program.backward_ops]
    res = {"first": first, "then": log, "size": size, "names": names,
           "counts": sorted(learnt.values()), "nparams": len(params),
           "same": all(torch.equal(hold[n], hand[n]) for n in hold)
           and torch.equal(gx_hold, gx_hand),
           "x_in": node.x_in, "states": len(node.states)}
    res["segs"] = [[o.name for o in seg] for seg in _segments(dh.program)]
    return res


def split_contribution():
    """A parameter with two contributions per state, in two different ops (fc2_wgrad
    gives half of w_fc2's gradient, act_b the rest): learnt as 2; held as a partial sum
    between the two ops; handed over at the second; bit-identical to holding it all.
    Then a contribution past the count, and a second hand-over, raise."""
    import torch
    from dhelix.strand.node import _GRAD_COUNTS
    from dhelix.strand.state import GradHandoffError
    dh, rope, x, g = _layer()
    prog = dh.program
    w = prog.w_fc2
    wname = next(n for n, p in dh.named_parameters() if p is w)
    ops = {o.name: o for o in prog.backward_ops}
    orig = {n: ops[n].run for n in ("fc2_wgrad", "act_b")}
    rest = {}

    def fc2_wgrad(S):
        acc = S.acc_grad

        def split(p, gp):
            if p is w:
                half = gp * 0.5
                rest[id(S)] = gp - half
                gp = half
            acc(p, gp)
        S.acc_grad = split
        try:
            orig["fc2_wgrad"](S)
        finally:
            del S.acc_grad

    def act_b(S):
        orig["act_b"](S)
        S.acc_grad(w, rest.pop(id(S)))

    res = {}
    ops["fc2_wgrad"].run, ops["act_b"].run = fc2_wgrad, act_b
    try:
        held = []

        def observe(node, k):
            held.append((prog.backward_ops[k].name, node.held_grad_bytes(),
                         w.grad is not None))
        hold, _, _ = _node_backward(dh, rope, x, g, 1)
        res["count"] = _GRAD_COUNTS[prog][id(w)]
        hand, _, _ = _node_backward(dh, rope, x, g, 1, observe)
        res["same"] = all(torch.equal(hold[n], hand[n]) for n in hold)
        res["held"] = held
        res["w_bytes"] = _nbytes(w)
    finally:
        ops["fc2_wgrad"].run, ops["act_b"].run = orig["fc2_wgrad"], orig["act_b"]

    # the counts say 2: a third contribution after the hand-over raises
    def extra(node, k):
        if prog.backward_ops[k].name == "act_b":
            node.states[0].acc_grad(w, torch.zeros_like(w))
    ops["fc2_wgrad"].run, ops["act_b"].run = fc2_wgrad, act_b
    try:
        _node_backward(dh, rope, x, g, 1, extra)
        res["extra"] = "no error"
    except GradHandoffError as e:
        res["extra"] = str(e)
    finally:
        ops["fc2_wgrad"].run, ops["act_b"].run = orig["fc2_wgrad"], orig["act_b"]

    # the chain back to one contribution, the counts still 2 (a wrong count): the
    # gradient is never handed early; it goes over at the end of the node, same values
    _GRAD_COUNTS[prog][id(w)] = 2
    got, _, _ = _node_backward(dh, rope, x, g, 1)
    res["relearnt"] = _GRAD_COUNTS[prog][id(w)]
    _GRAD_COUNTS.pop(prog)
    plain_hold, _, _ = _node_backward(dh, rope, x, g, 1)
    res["late_same"] = all(torch.equal(got[n], plain_hold[n]) for n in got)

    # the counts learnt: a contribution after the hand-over raises, and so does
    # handing the same parameter twice
    def again(node, k):
        if prog.backward_ops[k].name == "fc2_wgrad":
            S = node.states[0]
            for fn in (lambda: S.acc_grad(w, torch.zeros_like(w)),
                       lambda: node.handoff.take(S, w, torch.zeros_like(w))):
                try:
                    fn()
                    res.setdefault("after", []).append("no error")
                except GradHandoffError as e:
                    res.setdefault("after", []).append(str(e))
    _node_backward(dh, rope, x, g, 1, again)
    res["wname"] = wname
    return res


def input_freed(tiles):
    """A micro-batch of two layer nodes walked by `BackwardWalk`. Watches the tensors
    and storages of h0 (the embedding's output: the bottom node's input, the walk's
    first_input) and h1 (the bottom node's output: the top node's input)."""
    import gc
    import weakref
    from types import SimpleNamespace

    import torch
    from dhelix.planner.plan import paired_plan
    from dhelix.schedules.microbatch import BackwardWalk, ForwardRunner, Microbatch
    from dhelix.strand.executor import run_layer_step, run_tiles
    from dhelix.strand.lanes import make_lanes

    dh, rope, x, _ = _layer()
    plan = paired_plan(dh.program.layer_ops(SEQ, MBS))
    meta = {"attention_mask": None, "rotary_pos_emb": rope}
    emb_w = torch.nn.Parameter(torch.ones(x.shape[-1]))
    head_w = torch.nn.Parameter(torch.full((x.shape[-1],), 0.5))

    def run(node, kind):
        if tiles == 1:
            run_layer_step(plan, **{kind: (node.program, node.states[0])})
        else:
            run_tiles(node.program, node.states, kind)

    def forward():
        runner = ForwardRunner(make_lanes(), "F1", lambda node: run(node, "fwd"), tiles)
        h0 = x * emb_w                      # the "embedding": a graph below the nodes
        h1 = runner.layer_forward(dh, h0, meta)
        h2 = runner.layer_forward(dh, h1, meta)
        loss = (h2 * head_w).sum()
        refs = [(weakref.ref(t), t.untyped_storage()._weak_ref()) for t in (h0, h1)]
        return Microbatch(0, loss, runner.nodes), refs

    def alive():
        gc.collect()
        return {"tensor": [r() is not None for r, _ in refs],
                "storage": [not torch.UntypedStorage._expired(h) for _, h in refs]}

    mb, refs = forward()
    steps = SimpleNamespace(body_params=[emb_w, head_w],
                            config=SimpleNamespace(grad_scale_func=None), model_type=None,
                            tracer=None)
    walk = BackwardWalk(mb, steps, "B1")
    out = {"mb_nodes": len(mb.nodes), "nodes": []}
    walk.post()
    while walk.remaining():
        node = walk.next()
        run(node, "bwd")
        walk.done(node)
        out["nodes"].append(dict(alive(), x_in=node.x_in is None,
                                 states=len(node.states), handoff=node.handoff is None))
        del node
    walk.pre()
    out["after_pre"] = alive()
    out["walk"] = [walk.g is None, walk.first_input is None, walk.pending == []]
    out["emb_grad"] = emb_w.grad is not None
    for _, h in refs:
        torch.UntypedStorage._free_weak_ref(h)
    return out


def trained(**kw):
    """A training run's numbers, and how many gradients went over mid-node."""
    from dhelix.strand.node import GradHandoff
    from train_fns import train_result
    take, n = GradHandoff.take, [0]

    def counted(self, *a):
        n[0] += 1
        return take(self, *a)
    GradHandoff.take = counted
    try:
        r = train_result(**kw)
    finally:
        GradHandoff.take = take
    return {"losses": r["losses"], "grads": r["grad_checksums"],
            "weights": r["weight_checksums"], "taken": n[0]}


def trained_counting_engine_handoffs(**kw):
    """A training run's numbers, and how many times parameter gradients were handed to
    the autograd engine (`torch.autograd.backward` on leaf parameters)."""
    import torch
    from train_fns import train_result
    backward, n = torch.autograd.backward, [0]

    def counted(tensors, *a, **k):
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if ts and all(isinstance(t, torch.nn.Parameter) for t in ts):
            n[0] += 1
        return backward(tensors, *a, **k)
    torch.autograd.backward = counted
    try:
        r = train_result(**kw)
    finally:
        torch.autograd.backward = backward
    return {"losses": r["losses"], "grads": r["grad_checksums"],
            "weights": r["weight_checksums"], "engine": n[0]}


# ---- tests -------------------------------------------------------------------------------
def test_tiles1_holds_no_finished_gradient():
    r = run_ranks(held_gradients, 1, 1, timeout=300)[0]
    total = sum(r["size"].values())
    # the first backward of the program learns the counts and holds everything to the end
    assert [b for b, _ in r["first"]][-1] == total
    assert all(arrived == [] for _, arrived in r["first"])
    # every parameter of the dense layer gets one contribution per backward
    assert r["counts"] == [1] * r["nparams"]
    # then: after every op nothing is held, each gradient is in .grad right after its op
    assert [b for b, _ in r["then"]] == [0] * len(r["names"])
    assert r["then"][-1][1] == sorted(r["size"])
    arrived = [set(a) for _, a in r["then"]]
    news = {n: sorted(a - b) for n, a, b in zip(r["names"], arrived, [set()] + arrived)}
    assert news["fc2_wgrad"] == ["mlp.linear_fc2.weight"]
    assert news["fc1_wgrad"] == ["mlp.linear_fc1.weight"]
    assert news["proj_wgrad"] == ["self_attention.linear_proj.weight"]
    assert news["qkv_wgrad"] == ["self_attention.linear_qkv.bias",
                                 "self_attention.linear_qkv.weight"]
    assert r["same"]                         # bit for bit the whole-node path's gradients
    assert r["x_in"] is None and r["states"] == 0


def test_tiles2_holds_only_the_first_tiles_last_segment():
    """The intra-batch peer: a parameter's two tile sums are added (tile 0 + tile 1) when
    the second arrives. After step k (tile 0 ran segment k, tile 1 segment k−1) the node
    holds exactly tile 0's gradients of segment k: the parameters segment k finishes."""
    # TP=2 with SP: the backward chain has comms, so several segments
    one = run_ranks(held_gradients, 2, 1, 2, timeout=300)[0]
    r = run_ranks(held_gradients, 2, 2, 2, timeout=300)[0]
    arrived = [set(a) for _, a in one["then"]]
    of_op = {n: a - b for n, a, b in zip(one["names"], arrived, [set()] + arrived)}
    tile_bytes = r["size"]                  # a tile's sum has the parameter's shape
    segs = r["segs"]
    want = [sum(tile_bytes[p] for o in seg for p in of_op[o]) for seg in segs] + [0]
    assert [b for b, _ in r["then"]] == want
    assert len(segs) > 2 and max(want) < sum(r["size"].values()) / 2
    # and what has arrived after step k: every parameter of segments 0..k-1
    done = set()
    for k, (_, got) in enumerate(r["then"]):
        if k:
            done |= {p for o in segs[k - 1] for p in of_op[o]}
        assert set(got) == done
    assert [b for b, _ in r["first"]][-1] == 2 * sum(r["size"].values())
    assert r["same"]


def test_counted_contributions_and_refusals():
    r = run_ranks(split_contribution, 1, timeout=300)[0]
    assert r["count"] == 2
    held = {name: (b, arrived) for name, b, arrived in r["held"]}
    # between its two contributions w_fc2's partial sum is all the node holds
    order = [name for name, _, _ in r["held"]]
    between = order[order.index("fc2_wgrad"):order.index("act_b")]
    assert all(held[n] == (r["w_bytes"], False) for n in between)
    assert held["act_b"] == (0, True)
    assert all(b == 0 for name, b, _ in r["held"] if name not in between)
    assert r["same"]
    assert "contribution 3" in r["extra"] and "counted for 2" in r["extra"]
    # a count too high never hands early: the rest goes over at the end, same values,
    # and the program learns the right count again
    assert r["late_same"] and r["relearnt"] == 1
    assert len(r["after"]) == 2
    assert "contribution 2" in r["after"][0] and "already handed" in r["after"][0]
    assert "handed to autograd already" in r["after"][1]


@pytest.mark.parametrize("tiles", [1, 2])
def test_finished_node_input_is_freed(tiles):
    r = run_ranks(input_freed, 1, tiles, timeout=300)[0]
    assert r["mb_nodes"] == 0                # the walk owns the nodes now
    top, bottom = r["nodes"]
    for n in (top, bottom):
        assert n["x_in"] and n["states"] == 0 and n["handoff"]
    # the top node done: its input h1 (the bottom node's output, whose `out` the walk
    # dropped) is gone. With tiles=1 h1 is the bottom node's own bias-dropout-add output
    # (no copy), whose local graph keeps that storage until its backward drops the graph;
    # with tiles=2 h1 is the join of the tiles, a storage of its own, freed at once.
    assert top["tensor"] == [True, False]
    assert top["storage"] == [True, tiles == 1]
    # the bottom node done: only the first layer's input, kept for the pre-process node
    assert bottom["tensor"] == [True, False] and bottom["storage"] == [True, False]
    assert r["after_pre"] == {"tensor": [False, False], "storage": [False, False]}
    assert r["walk"] == [True, True, True] and r["emb_grad"]


@pytest.mark.parametrize("peer", ["dhelix", "intra-batch"])
def test_training_same_with_and_without_handoff(peer):
    """Whole runs with the hand-over and with DHELIX_GRAD_HANDOFF=0 (every gradient held
    to the end of its node): losses, per-step gradient checksums and final weights equal
    bit for bit (the peer is compared with megatron only within 1e-5 elsewhere)."""
    opts = {"enabled": True} if peer == "dhelix" else {"peer": "intra-batch"}
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=4, micro_batch_size=2, global_batch_size=6, checksums=True,
              dhelix=opts)
    on = run_ranks(trained, 2, timeout=600, **kw)
    off = run_ranks(trained, 2, timeout=600, env={"DHELIX_GRAD_HANDOFF": "0"}, **kw)
    # 2 layers × 12 parameters × tiles per micro-batch, but for each layer's first one
    tiles = 1 if peer == "dhelix" else 2
    assert [r.pop("taken") for r in on] == [2 * 12 * tiles * (4 * 3 - 1)] * 2
    assert [r.pop("taken") for r in off] == [0, 0]
    assert on == off


def tiled_forward_memory():
    """One layer's forward as one node and as two batch halves, its output then kept as
    the next layer keeps it: the saved-tensor bytes held, and the input gradient of the
    halved node's backward against the whole node's."""
    import torch
    from dhelix.base.memory import METER
    from dhelix.strand.executor import execute_step, run_tiles
    from dhelix.strand.lanes import make_lanes
    from dhelix.strand.node import LayerNode
    dh, rope, x, g = _layer()
    held, gx = {}, {}
    for tiles in (1, 2):
        base = METER.current
        node = LayerNode(dh, x, {"attention_mask": None, "rotary_pos_emb": rope},
                         make_lanes(), tiles=tiles)
        run_tiles(dh.program, node.states, "fwd")
        out = node.finish_forward()
        keep = METER.hold(out)              # the next layer's input
        held[tiles] = METER.current - base
        node.begin_backward(g)
        for a, b in _steps(dh.program, node.states):
            execute_step(a, b)
        gx[tiles] = node.finish_backward()
        del keep, node
    return {"held": held, "out_bytes": _nbytes(out),
            "gx_diff": float((gx[1] - gx[2]).abs().max() / gx[1].abs().max()),
            "gx_finite": bool(torch.isfinite(gx[2]).all())}


def test_a_halved_node_holds_its_output_once():
    """A node of two batch halves joins their outputs into one tensor (the next layer's
    input); the halves' own outputs, which their last op's graph keeps only as its
    autograd root, are freed then — the halved forward holds what the whole one holds
    (it held one more output, 1.06x activations in the bench, before). Its backward still
    gives the whole node's input gradient, within the halves' rounding."""
    res = run_ranks(tiled_forward_memory, 1, timeout=200)[0]
    held = res["held"]
    assert held[1] > res["out_bytes"] > 0, res
    assert held[2] == held[1], res
    assert res["gx_finite"] and res["gx_diff"] <= 1e-5, res


def test_gradients_straight_to_megatron_ddp_hook():
    """Weight gradients handed to megatron DDP's own hook (main_grad += grad, the bucket
    told: --overlap-grad-reduce) without an autograd engine call, against
    DHELIX_GRAD_DIRECT=0 (every hand-over through torch.autograd.backward): losses,
    per-step gradient checksums and final weights equal bit for bit; the direct run
    handed no parameter gradient to the engine, the other did."""
    kw = dict(config="tiny", tensor_model_parallel_size=1, data_parallel_size=2,
              train_iters=3, micro_batch_size=2, global_batch_size=12, checksums=True,
              overlap_grad_reduce=True, dhelix={"enabled": True})
    direct = run_ranks(trained_counting_engine_handoffs, 2, timeout=600, **kw)
    engine = run_ranks(trained_counting_engine_handoffs, 2, timeout=600,
                       env={"DHELIX_GRAD_DIRECT": "0"}, **kw)
    assert [r.pop("engine") for r in direct] == [0, 0]
    assert all(r.pop("engine") > 0 for r in engine)
    assert direct == engine


def test_no_direct_hook_outside_megatron_ddp():
    """A module not wrapped in megatron's DDP (the standalone layer, another wrapper)
    gets no direct hook: its gradients go through autograd."""
    import torch
    from dhelix.schedules.grad_hooks import ddp_grad_hooks
    class LooksLikeDDP(torch.nn.Module):      # DDP's attributes, not megatron's class
        ddp_config = object()

        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

        def _make_backward_post_hook(self, p):
            return lambda *a: None
    assert ddp_grad_hooks([torch.nn.Linear(2, 2), LooksLikeDDP()]) == {}
