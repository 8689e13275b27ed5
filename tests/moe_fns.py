"""MoE functions the multi-rank tests run on every rank."""
from dhelix.models.config import load_model_config


def unbalanced_moe_layer():
    """megatron's MoE block, EP=2 over gloo, router weights zero: every token ties and
    goes to the same two experts, both on one EP rank; the other rank's get no token."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from dhelix.compat import cpu
    from dhelix.models.config import load_model_config
    from dhelix.models.gpt import transformer_config
    from dhelix.models.spec import moe_spec
    cpu.apply()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    cfg = transformer_config(load_model_config("tiny-moe"), ep=2)
    layer = build_module(moe_spec(), config=cfg)
    with torch.no_grad():
        layer.router.weight.zero_()
    x = torch.randn(16, 2, cfg.hidden_size, requires_grad=True)
    out, _ = layer(x)
    out.square().sum().backward()
    grads = {n: float(p.grad.abs().sum()) for n, p in layer.named_parameters()
             if "local_experts" in n}
    return {"finite": bool(torch.isfinite(out).all()), "grads": grads,
            "x_grad": float(x.grad.abs().sum())}


def setup_moe_layer(tp=1, ep=2, seed=11, seq=16, mbs=2, shared=None):
    """megatron's MoE TransformerLayer and the DHelix layer with identical weights."""
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
    m = dataclasses.replace(load_model_config("tiny-moe"),
                            moe_shared_expert_intermediate_size=shared)
    cfg = transformer_config(m, tp=tp, sequence_parallel=tp > 1, ep=ep, etp=1)
    torch.manual_seed(seed)
    ref = build_module(layer_spec(TransformerLayer, m.num_experts), config=cfg, layer_number=1)
    torch.manual_seed(seed + 1)
    dh = build_module(layer_spec(DHelixLayer, m.num_experts), config=cfg, layer_number=1)
    dh.load_state_dict(ref.state_dict())
    rope = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0,
                           use_cpu_initialization=True)(seq)
    return ref, dh, cfg, rope


def moe_layer_matches(tp=1, ep=2, plans=30, seq=16, mbs=2, seed=5, zero_router=False,
                      shared=None):
    """The DHelix MoE layer under the trivial, paired and `plans` random legal plans vs
    megatron's MoE layer: α's output, β's input grad, every parameter grad. With
    `zero_router` every token ties and goes to the same two experts (one EP rank)."""
    import random

    import torch
    from layer_fns import dhelix_step, inputs, reference

    from dhelix.planner.enumerate import random_legal_plan
    from dhelix.planner.plan import paired_plan, trivial_plan
    ref, dh, cfg, rope = setup_moe_layer(tp, ep, seq=seq, mbs=mbs, shared=shared)
    if zero_router:
        with torch.no_grad():
            for layer in (ref, dh):
                layer.mlp.router.weight.zero_()
    sd_ref, sd_dh = ref.state_dict(), dh.state_dict()
    state_dict_same = list(sd_ref) == list(sd_dh) and all(
        torch.equal(sd_ref[k], sd_dh[k]) for k in sd_ref if torch.is_tensor(sd_ref[k]))
    sharded_same = sorted(ref.sharded_state_dict().keys()) == \
        sorted(dh.sharded_state_dict().keys())
    sp = tp > 1
    x_a, x_b = inputs(cfg, seq, mbs, seed, sp), inputs(cfg, seq, mbs, seed + 1, sp)
    g_b = inputs(cfg, seq, mbs, seed + 2, sp)
    out_ref, gx_ref, grads_ref = reference(ref, x_a, x_b, g_b, rope)
    ops = dh.program.layer_ops(seq, mbs)
    rng = random.Random(seed)
    all_plans = [trivial_plan(ops), paired_plan(ops)] + \
        [random_legal_plan(ops, rng) for _ in range(plans)]
    worst = 0.0
    for plan in all_plans:
        out, gx, grads = dhelix_step(dh, plan, x_a, x_b, g_b, rope, seq, mbs)
        pairs = [(out, out_ref), (gx, gx_ref)] + [(grads[n], grads_ref[n]) for n in grads_ref]
        assert set(grads) == set(grads_ref), sorted(set(grads_ref) ^ set(grads))
        for a, b in pairs:
            worst = max(worst, float((a - b).abs().max() / (b.abs().max() + 1e-30)))
    return {"worst": worst, "plans": len(all_plans), "state_dict_same": state_dict_same,
            "sharded_same": sharded_same, "n_grads": len(grads_ref),
            "a2a": [o.name for o in ops.forward + ops.backward if o.collective == "all_to_all"]}
