"""MoE functions the multi-rank tests run on every rank."""
from dhelix.models.config import load_model_config


def unbalanced_moe_layer():
    """megatron's MoE block, EP=2 over gloo, router weights zero: every token ties and
    goes to the same two experts, both on one EP rank; the other rank's get no token."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dhelix.compat import cpu, mcore
    from dhelix.models.config import load_model_config
    from dhelix.models.gpt import transformer_config
    from dhelix.models.spec import moe_spec
    cpu.apply()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    cfg = transformer_config(load_model_config("tiny-moe"), ep=2)
    layer = mcore.build(moe_spec(), config=cfg)
    with torch.no_grad():
        layer.router.weight.zero_()
    x = torch.randn(16, 2, cfg.hidden_size, requires_grad=True)
    out, _ = layer(x)
    out.square().sum().backward()
    grads = {n: float(p.grad.abs().sum()) for n, p in layer.named_parameters()
             if "local_experts" in n}
    return {"finite": bool(torch.isfinite(out).all()), "grads": grads,
            "x_grad": float(x.grad.abs().sum())}


def setup_moe_layer(tp=1, ep=2, seed=11, seq=16, mbs=2, shared=None, load=True,
                    model="tiny-moe"):
    """megatron's MoE TransformerLayer and the DHelix layer (another seed) of model
    config `model`, with megatron's weights loaded into it unless `load` is False."""
    import torch
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
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)
    import dataclasses
    m = dataclasses.replace(load_model_config(model),
                            moe_shared_expert_intermediate_size=shared)
    cfg = transformer_config(m, tp=tp, sequence_parallel=tp > 1, ep=ep, etp=1)
    torch.manual_seed(seed)
    ref = build_module(layer_spec(TransformerLayer, m.num_experts), config=cfg, layer_number=1)
    torch.manual_seed(seed + 1)
    dh = build_module(layer_spec(DHelixLayer, m.num_experts), config=cfg, layer_number=1)
    if load:
        dh.load_state_dict(ref.state_dict(), strict=True)
    rope = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0,
                           use_cpu_initialization=True)(seq)
    return ref, dh, cfg, rope


def moe_layer_matches(tp=1, ep=2, plans=30, seq=16, mbs=2, seed=5, zero_router=False,
                      shared=None, tol=0.0, model="tiny-moe"):
    """The DHelix MoE layer under the trivial, paired and `plans` random legal plans vs
    megatron's MoE layer on this rank (`compare.same_tensors` within `tol`, 0.0 = bit for
    bit): α's output, β's input grad, every parameter grad, none missing or extra. Before
    that: a fresh DHelix MoE layer has megatron's state-dict keys and shapes and sharded
    keys. With `zero_router` every token ties and goes to the same two experts (one EP
    rank). A model with biases (add_bias_linear) gets random ones, as megatron
    initialises them to zero; `bias_grads` counts the experts' bias grads compared.
    Raises `compare.Mismatch` naming the plan."""
    import torch
    from compare import Mismatch, same_tensors
    from layer_fns import dhelix_step, inputs, named_plans, reference, tensors_of

    ref, dh, cfg, rope = setup_moe_layer(tp, ep, seq=seq, mbs=mbs, shared=shared,
                                         load=False, model=model)
    shapes = lambda m: {k: torch.zeros(v.shape) for k, v in  # noqa: E731
                        tensors_of(m.state_dict()).items()}
    same_tensors(shapes(dh), shapes(ref), 0.0, "fresh DHelix vs megatron MoE state dict:")
    if sorted(ref.sharded_state_dict()) != sorted(dh.sharded_state_dict()):
        raise Mismatch("sharded-state-dict keys differ: " + str(sorted(
            set(ref.sharded_state_dict()) ^ set(dh.sharded_state_dict()))))
    if cfg.add_bias_linear:
        # replicated biases (linear_proj's over TP) alike on every rank; each EP rank's
        # experts their own
        same = torch.Generator().manual_seed(seed + 100)
        own = torch.Generator().manual_seed(seed + 200 + torch.distributed.get_rank())
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if n.endswith(".bias"):
                    gen = own if "local_experts" in n else same
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    dh.load_state_dict(ref.state_dict(), strict=True)
    if zero_router:
        with torch.no_grad():
            for layer in (ref, dh):
                layer.mlp.router.weight.zero_()
                if layer.mlp.router.bias is not None:      # add_bias_linear
                    layer.mlp.router.bias.zero_()
    sp = tp > 1
    x_a, x_b = inputs(cfg, seq, mbs, seed, sp), inputs(cfg, seq, mbs, seed + 1, sp)
    g_b = inputs(cfg, seq, mbs, seed + 2, sp)
    out_ref, gx_ref, grads_ref = reference(ref, x_a, x_b, g_b, rope)
    want = {"output": out_ref, "input grad": gx_ref, **grads_ref}
    ops = dh.program.layer_ops(seq, mbs)
    all_plans = named_plans(ops, plans, seed)
    for name, plan in all_plans:
        out, gx, grads = dhelix_step(dh, plan, x_a, x_b, g_b, rope, seq, mbs)
        try:
            same_tensors({"output": out, "input grad": gx, **grads}, want, tol,
                         f"MoE TP={tp} EP={ep}, plan {name}:")
        except Mismatch as e:
            raise Mismatch(f"{e} ({len(plan.steps)} steps)") from None
    return {"plans": len(all_plans), "distinct": len({p.digest() for _, p in all_plans}),
            "n_grads": len(grads_ref),
            "bias_grads": sum(1 for k, v in grads_ref.items() if "local_experts" in k and
                              k.endswith(".bias") and bool(v.abs().sum() > 0)),
            "a2a": [o.name for o in ops.forward + ops.backward if o.collective == "all_to_all"]}


# ---- DHELIX_LANES=strict: the dispatcher's device-to-host copies (tests/test_strict_moe.py)

def without_d2h_sync(variant):
    """The old behaviour back, for a test that the strict check can fail: "none" never
    synchronizes the dispatcher's d2h event (DHelix skipped megatron's token_dispatch
    and its sync point); "dispatcher" synchronizes the dispatcher's current event, not
    the strand's own (the other strand's permute may have recorded it); "unsnapshotted"
    leaves the event out of the strand's snapshot, so megatron's own sync point inside
    dispatch_postprocess (EP=1) waits for whichever event the dispatcher holds."""
    from dhelix.strand import moe
    if variant == "none":
        moe.MoEProgram._d2h_synchronize = lambda self, S, point: None
    elif variant == "dispatcher":
        moe.MoEProgram._d2h_synchronize = \
            lambda self, S, point: self.disp.d2h_event.synchronize()
    elif variant == "unsnapshotted":
        moe._ROUTING = tuple(k for k in moe._ROUTING if k != "d2h_event")
    else:
        raise ValueError(variant)


def strict_moe_layer_matches(broken=None, **kw):
    """`moe_layer_matches` under DHELIX_LANES=strict; with `broken` (a `without_d2h_sync`
    variant) the error it raises, as text."""
    import os
    assert os.environ.get("DHELIX_LANES") == "strict"
    if broken is None:
        return moe_layer_matches(**kw)
    without_d2h_sync(broken)
    try:
        moe_layer_matches(**kw)
    except RuntimeError as e:
        return str(e)
    return None


def interleaved_moe_forwards(broken=None, tp=1, ep=2, seq=16, mbs=2, seed=5):
    """Two strands' forwards of one DHelix MoE layer interleaved at the permute: α up to
    its permute, β up to its permute (the dispatcher's routing and d2h event now β's),
    then the rest of α, then the rest of β. Each output equals megatron's MoE layer's on
    the same input bit for bit (else `compare.Mismatch`; returns 0.0); with `broken` (a
    `without_d2h_sync` variant) the error raised, as text."""
    import torch
    from layer_fns import inputs

    from dhelix.planner.plan import comm_runs
    from dhelix.strand.executor import execute_step
    from dhelix.strand.lanes import make_lanes
    from dhelix.strand.state import StrandState
    if broken is not None:
        without_d2h_sync(broken)
    ref, dh, cfg, rope = setup_moe_layer(tp, ep, seq=seq, mbs=mbs)
    sp = tp > 1
    xs = {"α": inputs(cfg, seq, mbs, seed, sp), "β": inputs(cfg, seq, mbs, seed + 1, sp)}
    with torch.no_grad():
        want = {k: ref(x, attention_mask=None, rotary_pos_emb=rope)[0] for k, x in xs.items()}
    prog = dh.program
    lanes = make_lanes()
    runs = comm_runs([o.spec for o in prog.forward_ops])
    cut = next(i for i, r in enumerate(runs) if "permute" in r) + 1
    states = {}
    for k, x in xs.items():
        S = StrandState(lanes, k)
        S.meta = {"attention_mask": None, "rotary_pos_emb": rope}
        S.put("x", x)
        states[k] = S

    def run(k, part):
        for r in part:
            execute_step((states[k], [prog.fwd[n] for n in r]), None)
    try:
        run("α", runs[:cut])
        run("β", runs[:cut])
        run("α", runs[cut:])
        run("β", runs[cut:])
    except RuntimeError as e:
        if broken is None:
            raise
        return str(e)
    if broken is not None:
        return None
    from compare import same_tensors
    return same_tensors({k: states[k].get("out") for k in xs}, want, 0.0,
                        "interleaved forwards vs megatron:")


def shared_experts_racing_the_lane(**kw):
    """The shared experts' megatron linears issue their own TP collectives; without
    `quiesce` first they race a lane's TP comm (on NCCL: either order, per rank). The
    strict lanes' error, as text."""
    from dhelix.strand import moe
    moe.MoEProgram._quiesce_tp = lambda self, S: None
    try:
        moe_layer_matches(**kw)
    except RuntimeError as e:
        return str(e)
    return None
