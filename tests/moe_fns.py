"""MoE functions the multi-rank tests run on every rank."""


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
