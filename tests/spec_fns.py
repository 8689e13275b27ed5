"""Per-rank bodies of the one-spec tests: DHelix's SDPA core attention and layer against
megatron's local DotProductAttention and layer, on the same inputs and weights."""
import torch


def _setup(tp=1):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from dhelix.compat import cpu as cpu_compat
    cpu_compat.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(3)


def _cfg(config="tiny-llama"):
    from dhelix.models.config import load_model_config
    from dhelix.models.gpt import transformer_config
    return transformer_config(load_model_config(config), tp=1, sequence_parallel=False)


def sdpa_vs_dot_product_attention(seq=32, mbs=2):
    """Causal, GQA (tiny-llama: 4 heads, 2 KV groups), fp32: output and input grads."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from dhelix.models.spec import SDPAttention
    _setup()
    cfg = _cfg()
    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
              attention_type="self")
    ours, ref = SDPAttention(**kw), DotProductAttention(**kw)
    g = torch.Generator().manual_seed(5)
    hn, nq, nk = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    q = torch.randn(seq, mbs, nq, hn, generator=g)
    k, v = (torch.randn(seq, mbs, nk, hn, generator=g) for _ in range(2))
    grad = torch.randn(seq, mbs, nq * hn, generator=g)
    outs = []
    for mod in (ours, ref):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        y = mod(*xs, attention_mask=None)
        y.backward(grad)
        outs.append({"output": y, "dQ": xs[0].grad, "dK": xs[1].grad, "dV": xs[2].grad})
    from compare import same_tensors      # ≤1e-6: SDPA's kernel sums in its own order
    return same_tensors(outs[0], outs[1], 1e-6, "SDPA vs DotProductAttention:")


def layer_vs_megatron_local(seq=32, mbs=2, config="tiny-llama"):
    """megatron's TransformerLayer on its local spec (DotProductAttention, its torch norm)
    and on DHelix's spec (SDPA, the one-node norm), same weights: output, input grad,
    every parameter grad."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from dhelix.megatron.spec import get_local_sdpa_spec
    _setup()
    cfg = _cfg(config)
    torch.manual_seed(1)
    ref = build_module(get_gpt_layer_local_spec(normalization=cfg.normalization), config=cfg,
                       layer_number=1)
    ours = build_module(get_local_sdpa_spec(), config=cfg, layer_number=1)
    missing = ours.load_state_dict(ref.state_dict(), strict=True)
    rope = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0,
                           use_cpu_initialization=True)(seq)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(seq, mbs, cfg.hidden_size, generator=g)
    gy = torch.randn(seq, mbs, cfg.hidden_size, generator=g)
    res = []
    for layer in (ours, ref):
        xi = x.clone().requires_grad_()
        y, _ = layer(xi, attention_mask=None, rotary_pos_emb=rope)
        y.backward(gy)
        res.append({"output": y, "input grad": xi.grad,
                    **{n: p.grad for n, p in layer.named_parameters()}})
    from compare import same_tensors
    return {"worst": same_tensors(res[0], res[1], 1e-6, "DHelix spec vs megatron local:"),
            "params": len(res[0]) - 2,
            "core": [type(l.self_attention.core_attention).__name__ for l in (ours, ref)],
            "keys_ok": not missing.missing_keys and not missing.unexpected_keys}


def count_params(config):
    """Parameters of megatron's GPT of `config` on one rank (TP=1), as dhelix builds it."""
    from dhelix.models.config import load_model_config
    from dhelix.models.gpt import build_gpt, transformer_config
    _setup(1)
    m = load_model_config(config)
    model = build_gpt(m, transformer_config(m, tp=1, sequence_parallel=False))
    return sum(p.numel() for p in model.parameters())
