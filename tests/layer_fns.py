"""Per-rank bodies of the strand-layer tests: a DHelix layer against megatron's own."""
import torch

from dhelix.models.config import load_model_config


def setup_layer(config="tiny", tp=2, sp=True, seed=11, seq=16, mbs=2, bf16=False):
    """Build megatron's TransformerLayer and the DHelix layer with identical weights."""
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


def earliest_wgrad_plan(ops):
    """Every floating op as early as the validator allows (right after its `after`):
    e.g. fc1_wgrad before fc1_dgrad, which random plans (they only defer) never do."""
    from dhelix.planner.plan import Plan, Step, split_segments
    order = [o for o in ops.backward if not o.wgrad]
    for w in [o for o in ops.backward if o.wgrad]:
        order.insert(next(k for k, o in enumerate(order) if o.name == w.after) + 1, w)
    steps = [Step(fwd=s) for s in split_segments(ops.forward)] + \
        [Step(bwd=s) for s in split_segments(order)]
    return Plan(ops.signature(), [o.name for o in ops.forward],
                [o.name for o in ops.backward], steps, {"made_by": "earliest-wgrad"})


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_plans(config="tiny", tp=2, sp=True, nplans=50, seq=16, mbs=2, seed=5):
    """Returns worst relative error vs megatron and whether all plans are bit-identical
    to the trivial plan."""
    from dhelix.planner.enumerate import random_legal_plan
    from dhelix.planner.plan import paired_plan, trivial_plan
    import random

    ref, dh, cfg, rope = setup_layer(config, tp, sp, seed, seq, mbs)
    x_a = inputs(cfg, seq, mbs, seed + 1, sp)
    x_b = inputs(cfg, seq, mbs, seed + 2, sp)
    g_b = inputs(cfg, seq, mbs, seed + 3, sp)
    r_out, r_gx, r_grads = reference(ref, x_a, x_b, g_b, rope)
    ops = dh.program.layer_ops(seq, mbs)
    rng = random.Random(seed)
    plans = [trivial_plan(ops), paired_plan(ops), earliest_wgrad_plan(ops)] + \
        [random_legal_plan(ops, rng) for _ in range(nplans)]
    worst = 0.0
    base = None
    identical = True
    for plan in plans:
        out, gx, grads = dhelix_step(dh, plan, x_a, x_b, g_b, rope, seq, mbs)
        errs = [rel(out, r_out), rel(gx, r_gx)] + [rel(grads[n], r_grads[n]) for n in r_grads]
        worst = max(worst, max(errs))
        flat = [out, gx] + [grads[n] for n in sorted(grads)]
        if base is None:
            base = flat
        else:
            identical &= all(torch.equal(a, b) for a, b in zip(flat, base))
    missing = sorted(set(r_grads) - set(grads))
    return {"worst_rel": worst, "identical": identical, "nplans": len(plans),
            "missing_grads": missing, "num_ops": (len(ops.forward), len(ops.backward))}


def check_node_path(config="tiny", tp=2, sp=True, seq=16, mbs=2, seed=5, tiles=1):
    """A layer node (forward on a detached input, explicit backward) vs megatron's layer:
    output, input grad, and parameter .grad that arrived through AccumulateGrad. With
    tiles=2: the intra-batch peer's two batch halves, round-robin."""
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
    errs = {"out": rel(out_d, out_r), "gx": rel(xd.grad, xr.grad)}
    refp = dict(ref.named_parameters())
    for n, p in dh.named_parameters():
        errs[n] = rel(p.grad, refp[n].grad)
    return errs


def state_dict_roundtrip(config="tiny", tp=2, sp=True):
    """DHelix layer -> megatron layer -> DHelix layer, unchanged; same sharded keys."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from dhelix.models.spec import layer_spec
    from dhelix.strand.layer import DHelixLayer

    ref, dh, cfg, _ = setup_layer(config, tp, sp)
    torch.manual_seed(99)
    dh2 = build_module(layer_spec(DHelixLayer), config=cfg, layer_number=1)
    sd = dh.state_dict()
    ref2 = build_module(layer_spec(TransformerLayer), config=cfg, layer_number=1)
    ref2.load_state_dict(sd, strict=True)
    dh2.load_state_dict(ref2.state_dict(), strict=True)
    def eq(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and torch.equal(a, b)
        return a == b
    same = all(eq(sd[k], v) for k, v in dh2.state_dict().items())
    keys_equal = sorted(sd) == sorted(ref2.state_dict())
    sh_d = sorted(dh.sharded_state_dict().keys())
    sh_r = sorted(ref.sharded_state_dict().keys())
    return {"same": same, "keys_equal": keys_equal, "sharded_keys_equal": sh_d == sh_r,
            "nkeys": len(sd)}


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
