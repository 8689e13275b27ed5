"""Per-rank bodies of the strand-layer tests: a DHelix layer against megatron's own."""
import torch

from dhelix.models.config import load_model_config


def setup_layer(config="tiny", tp=2, sp=True, seed=11, seq=16, mbs=2, bf16=False,
                mlp_chunks=1, keep_gathered=False):
    """Build megatron's TransformerLayer and the DHelix layer with identical weights (the
    DHelix layer's MLP forward in `mlp_chunks` chunks; with `keep_gathered` its backward
    keeps the forward's gathered inputs)."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from dhelix.compat import cpu as cpu_compat
    from dhelix.models.gpt import transformer_config
    from dhelix.models.spec import layer_spec
    from dhelix.strand.layer import DHelixLayer

    cpu_compat.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)
    m = load_model_config(config)
    cfg = transformer_config(m, tp=tp, sequence_parallel=sp, bf16=bf16)
    torch.manual_seed(seed)
    ref = build_module(layer_spec(TransformerLayer), config=cfg, layer_number=1)
    torch.manual_seed(seed + 1)
    dh = build_module(layer_spec(DHelixLayer), config=cfg, layer_number=1)
    dh.load_state_dict(ref.state_dict())
    dh.dhelix_mlp_chunks = mlp_chunks
    dh.dhelix_keep_gathered = keep_gathered
    rope = None
    if m.position_embedding_type == "rope":
        rope = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0,
                               use_cpu_initialization=True)(seq)
    return ref, dh, cfg, rope


def inputs(cfg, seq, mbs, seed, sp):
    """Same full tensors on every rank; each rank takes its sequence shard under SP."""
    from megatron.core import parallel_state
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(seq, mbs, cfg.hidden_size, generator=g, dtype=torch.float32)
    full = full.to(cfg.params_dtype)
    if sp:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        r = parallel_state.get_tensor_model_parallel_rank()
        full = full.chunk(tp, dim=0)[r].contiguous()
    return full


def reference(ref, x_a, x_b, g_b, rope):
    out_a, _ = ref(x_a, attention_mask=None, rotary_pos_emb=rope)
    xb = x_b.clone().requires_grad_()
    out_b, _ = ref(xb, attention_mask=None, rotary_pos_emb=rope)
    out_b.backward(g_b)
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    return out_a.detach(), xb.grad.clone(), grads


def dhelix_step(dh, plan, x_a, x_b, g_b, rope, seq, mbs):
    """β: forward alone, then α's forward paired with β's backward by `plan`."""
    from dhelix.planner.plan import trivial_plan
    from dhelix.strand.executor import run_layer_step
    from dhelix.strand.lanes import make_lanes
    from dhelix.strand.state import StrandState

    prog = dh.program
    lanes = make_lanes()
    meta = {"attention_mask": None, "rotary_pos_emb": rope}
    Sa, Sb = StrandState(lanes, "α"), StrandState(lanes, "β")
    Sa.meta, Sb.meta = meta, meta
    Sb.put("x", x_b)
    run_layer_step(trivial_plan(prog.layer_ops(seq, mbs)), fwd=(prog, Sb))
    Sb.put("g_out", g_b)
    Sa.put("x", x_a)
    run_layer_step(plan, fwd=(prog, Sa), bwd=(prog, Sb))
    names = {id(p): n for n, p in dh.named_parameters()}
    grads = {names[k]: v for k, v in Sb.grads.items()}
    return Sa.get("out"), Sb.get("g_x"), grads


def timed_layer_step(prog, plan, trivial, lanes, meta, x, g):
    """One layer step as the schedule's steady state runs it: β's forward first (alone,
    the `trivial` plan), then α's forward ∥ β's backward under `plan`, timed between two
    barriers. Returns (seconds, α's state)."""
    import time
    import torch.distributed as dist
    from dhelix.strand.executor import run_layer_step
    from dhelix.strand.state import StrandState
    Sa, Sb = StrandState(lanes, "α"), StrandState(lanes, "β")
    Sa.meta = Sb.meta = meta
    Sb.put("x", x)
    run_layer_step(trivial, fwd=(prog, Sb))
    Sb.put("g_out", g)
    Sa.put("x", x)
    dist.barrier()
    t = time.perf_counter()
    run_layer_step(plan, fwd=(prog, Sa), bwd=(prog, Sb))
    dist.barrier()
    return time.perf_counter() - t, Sa


def earliest_wgrad_plan(ops):
    """Every floating op as early as the validator allows (right after its `after`, a
    re-gather first of all): e.g. fc2_wgrad right after fc2_dgrad, ahead of act_b."""
    from dhelix.planner.plan import Plan, Step, split_segments
    order = [o for o in ops.backward if not o.wgrad]
    for w in [o for o in ops.backward if o.wgrad]:
        order.insert(next((k for k, o in enumerate(order) if o.name == w.after), -1) + 1, w)
    steps = [Step(fwd=s) for s in split_segments(ops.forward)] + \
        [Step(bwd=s) for s in split_segments(order)]
    return Plan(ops.signature(), [o.name for o in ops.forward],
                [o.name for o in ops.backward], steps, {"made_by": "earliest-wgrad"})


def named_plans(ops, nplans, seed, earliest_wgrad=False):
    """[(name, plan)]: the trivial and paired plans (and the earliest-wgrad one), then
    `nplans` random legal plans drawn from `random.Random(seed)`."""
    import random
    from dhelix.planner.enumerate import random_legal_plan
    from dhelix.planner.plan import paired_plan, trivial_plan
    rng = random.Random(seed)
    return [("trivial", trivial_plan(ops)), ("paired", paired_plan(ops))] + \
        ([("earliest-wgrad", earliest_wgrad_plan(ops))] if earliest_wgrad else []) + \
        [(f"random #{i}", random_legal_plan(ops, rng)) for i in range(nplans)]


def check_plans(config="tiny", tp=2, sp=True, nplans=50, seq=16, mbs=2, seed=5, tol=0.0,
                mlp_chunks=1, keep_gathered=False):
    """The trivial, paired and earliest-wgrad plans and `nplans` random legal ones, each
    against megatron's layer on this rank (`compare.same_tensors`: α's output, β's input
    grad, every parameter grad, no name missing or extra, nothing non-finite, within
    `tol`; 0.0 = bit-identical), and against the first plan bit for bit (plans only
    reorder). Raises `compare.Mismatch` naming the plan; returns counts."""
    from compare import Mismatch, same_tensors

    ref, dh, cfg, rope = setup_layer(config, tp, sp, seed, seq, mbs, mlp_chunks=mlp_chunks,
                                     keep_gathered=keep_gathered)
    x_a = inputs(cfg, seq, mbs, seed + 1, sp)
    x_b = inputs(cfg, seq, mbs, seed + 2, sp)
    g_b = inputs(cfg, seq, mbs, seed + 3, sp)
    r_out, r_gx, r_grads = reference(ref, x_a, x_b, g_b, rope)
    want = {"output": r_out, "input grad": r_gx, **r_grads}
    ops = dh.program.layer_ops(seq, mbs)
    plans = named_plans(ops, nplans, seed, earliest_wgrad=True)
    first = None
    for name, plan in plans:
        out, gx, grads = dhelix_step(dh, plan, x_a, x_b, g_b, rope, seq, mbs)
        got = {"output": out, "input grad": gx, **grads}
        try:
            same_tensors(got, want, tol, "vs megatron:")
            same_tensors(got, first or got, 0.0, f"vs the {plans[0][0]} plan:")
        except Mismatch as e:
            raise Mismatch(f"{config} TP={tp} SP={sp}, plan {name} "
                           f"({len(plan.steps)} steps): {e}") from None
        first = first or got
    return {"nplans": len(plans), "distinct": len({p.digest() for _, p in plans}),
            "ngrads": len(r_grads), "num_ops": (len(ops.forward), len(ops.backward)),
            "multi_comm": sum(multi_comm_steps(p, ops) > 0 for _, p in plans),
            # β's node in another order than the chain's (`Plan.backward`)
            "reordered": sum(p.backward != [o.name for o in ops.backward] for _, p in plans)}


def multi_comm_steps(plan, ops) -> int:
    """Steps of `plan` holding two or more comm ops of one process group."""
    from collections import Counter
    spec = {("f", o.name): o for o in ops.forward}
    spec.update({("b", o.name): o for o in ops.backward})
    n = 0
    for s in plan.steps:
        groups = Counter(spec[k].group for k in [("f", x) for x in s.fwd] +
                         [("b", x) for x in s.bwd] if spec[k].kind == "comm")
        n += any(c > 1 for c in groups.values())
    return n


def check_node_path(config="tiny", tp=2, sp=True, seq=16, mbs=2, seed=5, tiles=1, tol=0.0):
    """A layer node (forward on a detached input, explicit backward) vs megatron's layer
    on this rank: output, input grad, and every parameter's .grad that arrived through
    AccumulateGrad (`compare.same_tensors` within `tol`; none missing). With tiles=2: the
    intra-batch peer's two batch halves, round-robin. Returns the worst difference."""
    from compare import same_tensors
    from dhelix.planner.plan import paired_plan
    from dhelix.strand.executor import run_layer_step, run_tiles
    from dhelix.strand.lanes import make_lanes
    from dhelix.strand.node import LayerNode

    ref, dh, cfg, rope = setup_layer(config, tp, sp, seed, seq, mbs)
    x = inputs(cfg, seq, mbs, seed + 1, sp)
    g = inputs(cfg, seq, mbs, seed + 2, sp)
    xr = x.clone().requires_grad_()
    out_r, _ = ref(xr, attention_mask=None, rotary_pos_emb=rope)
    out_r.backward(g)
    xd = x.clone().requires_grad_()
    emb = xd * 1.0                        # a graph below the node, as the embedding's
    node = LayerNode(dh, emb, {"attention_mask": None, "rotary_pos_emb": rope},
                     make_lanes(), tiles=tiles)
    plan = paired_plan(dh.program.layer_ops(seq, mbs // tiles))
    if tiles == 1:
        run_layer_step(plan, fwd=(dh.program, node.states[0]))
    else:
        run_tiles(dh.program, node.states, "fwd")
    out_d = node.finish_forward()
    assert out_d.is_leaf and out_d.requires_grad
    node.begin_backward(g)
    if tiles == 1:
        run_layer_step(plan, bwd=(dh.program, node.states[0]))
    else:
        run_tiles(dh.program, node.states, "bwd")
    gx = node.finish_backward()
    emb.backward(gx)                      # the pre-process node's part
    got = {"output": out_d, "input grad": xd.grad,
           **{n: p.grad for n, p in dh.named_parameters() if p.grad is not None}}
    want = {"output": out_r, "input grad": xr.grad,
            **{n: p.grad for n, p in ref.named_parameters()}}
    return same_tensors(got, want, tol, f"{config} SP={sp} tiles={tiles} node path:")


def tensors_of(sd) -> dict:
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def state_dict_roundtrip(config="tiny", tp=2, sp=True):
    """A freshly built DHelix layer has megatron's state-dict keys and shapes and its
    sharded-state-dict keys; DHelix -> megatron -> DHelix through strict loads gives back
    every tensor bit for bit, into layers initialised otherwise (so a key a load skipped
    would show). Raises `compare.Mismatch`; returns the number of keys."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from compare import Mismatch, same_tensors
    from dhelix.models.spec import layer_spec
    from dhelix.strand.layer import DHelixLayer

    ref, dh, cfg, _ = setup_layer(config, tp, sp)
    torch.manual_seed(99)
    dh2 = build_module(layer_spec(DHelixLayer), config=cfg, layer_number=1)
    ref2 = build_module(layer_spec(TransformerLayer), config=cfg, layer_number=1)
    shapes = lambda sd: {k: torch.zeros(v.shape) for k, v in tensors_of(sd).items()}  # noqa
    same_tensors(shapes(dh2.state_dict()), shapes(ref2.state_dict()), 0.0,
                 "fresh DHelix vs megatron state-dict keys/shapes:")
    if sorted(dh2.state_dict()) != sorted(ref2.state_dict()):
        raise Mismatch("non-tensor state-dict entries differ: "
                       f"{sorted(set(dh2.state_dict()) ^ set(ref2.state_dict()))}")
    sd = tensors_of(dh.state_dict())
    if all(torch.equal(sd[k], v) for k, v in tensors_of(ref2.state_dict()).items()):
        raise Mismatch("megatron's fresh layer already equals the DHelix one: "
                       "the round trip would prove nothing")
    ref2.load_state_dict(dh.state_dict(), strict=True)
    dh2.load_state_dict(ref2.state_dict(), strict=True)
    same_tensors(tensors_of(ref2.state_dict()), sd, 0.0, "DHelix -> megatron:")
    same_tensors(tensors_of(dh2.state_dict()), sd, 0.0, "DHelix -> megatron -> DHelix:")
    sh_d, sh_r = sorted(dh.sharded_state_dict()), sorted(ref.sharded_state_dict())
    if sh_d != sh_r:
        raise Mismatch(f"sharded-state-dict keys differ: {sorted(set(sh_d) ^ set(sh_r))}")
    return len(sd)


def different_plans_on_ranks():
    import torch.distributed as dist
    from dhelix.planner.plan import check_same_plan_across_ranks, paired_plan, trivial_plan
    _, dh, _, _ = setup_layer("tiny", 2, True)
    ops = dh.program.layer_ops(16, 2)
    plan = trivial_plan(ops) if dist.get_rank() == 0 else paired_plan(ops)
    check_same_plan_across_ranks(plan, f"plan-rank{dist.get_rank()}.json")
    return "no error"


def comm_lanes():
    """Lanes of the layer's comm ops under the node layout in DHELIX_NODE_IDS."""
    _, dh, _, _ = setup_layer("tiny", 2, True)
    return sorted({o.spec.lane for o in dh.program.forward_ops + dh.program.backward_ops
                   if o.spec.kind == "comm"})


def kept_after_forward(config="tiny", keep_gathered=False, seq=16, mbs=2, seed=5):
    """What a layer's forward leaves for its backward (saved-tensor accounting, bytes),
    with or without `keep_gathered`, and the planner's estimate of the same (the sum of
    the forward ops' `saved_bytes`)."""
    from dhelix.base.memory import METER
    from dhelix.planner.plan import trivial_plan
    from dhelix.strand.executor import run_layer_step
    from dhelix.strand.lanes import make_lanes
    from dhelix.strand.state import StrandState

    _, dh, cfg, rope = setup_layer(config, 2, True, seed, seq, mbs, keep_gathered=keep_gathered)
    prog = dh.program
    ops = prog.layer_ops(seq, mbs)
    S = StrandState(make_lanes(), "β")
    S.meta = {"attention_mask": None, "rotary_pos_emb": rope}
    x = inputs(cfg, seq, mbs, seed + 1, True)
    start = METER.current
    S.put("x", x)
    run_layer_step(trivial_plan(ops), fwd=(prog, S))
    return {"measured": METER.current - start,
            "estimated": sum(o.saved_bytes for o in ops.forward),
            "full": seq * mbs * cfg.hidden_size * x.element_size()}


def engine_calls(config="tiny", dropout=0.0, seq=16, mbs=2, seed=5):
    """How many times one layer's backward (β's, paired with α's forward) calls autograd's
    engine, with the layers' hidden dropout set to `dropout`; the grads are checked against
    megatron's where nothing is dropped (with dropout the two orders draw other masks)."""
    from compare import same_tensors
    from dhelix.planner.plan import paired_plan
    import dhelix.strand.backward_ops as bops

    ref, dh, cfg, rope = setup_layer(config, 2, True, seed, seq, mbs)
    for layer in (ref, dh):
        layer.hidden_dropout = dropout
    x_a, x_b, g_b = (inputs(cfg, seq, mbs, seed + i, True) for i in (1, 2, 3))
    calls = []
    real = bops.local_grad
    bops.local_grad = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        out, gx, grads = dhelix_step(dh, paired_plan(dh.program.layer_ops(seq, mbs)),
                                     x_a, x_b, g_b, rope, seq, mbs)
    finally:
        bops.local_grad = real
    if dropout == 0:
        r_out, r_gx, r_grads = reference(ref, x_a, x_b, g_b, rope)
        same_tensors({"output": out, "input grad": gx, **grads},
                     {"output": r_out, "input grad": r_gx, **r_grads}, 0.0, "vs megatron:")
    return len(calls)
