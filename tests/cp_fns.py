"""Context-parallel checks run on every rank (importable by spawned processes)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def full_attention(q, k, v, scale):
    """Causal GQA attention of whole sequences: [s, b, heads, hn] -> [s, b, heads·hn]."""
    heads, groups = q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // groups, 2)
    v = v.repeat_interleave(heads // groups, 2)
    o = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                       is_causal=True, scale=scale)
    return o.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def ring_core_errors(seq=48, b=2, heads=4, groups=2, hn=8):
    """The ring (CP = world size) against full attention on one rank, this rank's rows:
    output, dQ, dK, dV within 1e-5 relative (`compare.same_tensors`; raises)."""
    from dhelix.models.ring_attention import Ring, _RingFunction
    from dhelix.train.trainer import cp_chunks
    torch.manual_seed(0)
    q = torch.randn(seq, b, heads, hn)
    k, v = torch.randn(seq, b, groups, hn), torch.randn(seq, b, groups, hn)
    g = torch.randn(seq, b, heads * hn)
    scale = hn ** -0.5
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = full_attention(*ref, scale)
    out.backward(g)
    ring = Ring.of(dist.group.WORLD)
    rows = lambda t: cp_chunks(t, ring.rank, ring.size, dim=0)  # noqa: E731
    loc = [rows(t).clone().requires_grad_() for t in (q, k, v)]
    o = _RingFunction.apply(*loc, ring, scale)
    o.backward(rows(g))
    from compare import same_tensors
    names = ("output", "dQ", "dK", "dV")
    same_tensors(dict(zip(names, [o] + [a.grad for a in loc])),
                 dict(zip(names, [rows(out)] + [rows(r.grad) for r in ref])), 1e-5,
                 f"CP rank {ring.rank}: ring vs full attention:")


def layer_check(config, tp, sp, cp, seq, mbs, nplans, seed=1, tol=1e-5):
    """Megatron's layer and the DHelix layer at TP×CP (ring attention) against megatron's
    layer at CP = 1 on the whole sequence, same weights, on this rank (`compare`): the
    output, the input gradient and every parameter gradient (summed over the CP group),
    none missing, within `tol` (the ring adds the chunks' softmax-weighted parts in
    another order than one attention over the whole sequence does). The DHelix layer runs
    α forward ∥ β backward under the trivial, the paired and `nplans` random legal plans,
    each equal bit for bit to megatron's layer with the same ring (before the CP sum).
    Raises `compare.Mismatch` naming the plan; returns the ring ops and the plan count."""
    import dataclasses
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    import layer_fns
    from compare import Mismatch, same_tensors
    from dhelix.compat import cpu as cpu_compat
    from dhelix.models.config import load_model_config
    from dhelix.models.gpt import transformer_config
    from dhelix.models.spec import layer_spec
    from dhelix.strand.layer import DHelixLayer
    from dhelix.train.trainer import cp_chunks

    cpu_compat.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             context_parallel_size=cp)
    model_parallel_cuda_manual_seed(5)
    m = load_model_config(config)
    cfg = transformer_config(m, tp=tp, sequence_parallel=sp, cp=cp)
    cfg1 = dataclasses.replace(cfg, context_parallel_size=1)
    torch.manual_seed(5)
    ref = build_module(layer_spec(TransformerLayer), config=cfg1, layer_number=1)
    base = build_module(layer_spec(TransformerLayer, context_parallel_size=cp), config=cfg,
                        layer_number=1)
    dh = build_module(layer_spec(DHelixLayer, context_parallel_size=cp), config=cfg,
                      layer_number=1)
    base.load_state_dict(ref.state_dict(), strict=True)
    dh.load_state_dict(ref.state_dict(), strict=True)
    rope_full = rope = None
    if m.position_embedding_type == "rope":
        emb = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0,
                              use_cpu_initialization=True)
        rope_full = emb.get_emb(seq)      # every position
        rope = emb(seq)                   # megatron's slice for this CP rank
    r = parallel_state.get_context_parallel_rank()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cp_group = parallel_state.get_context_parallel_group()

    def shard(t):     # this rank's rows under sequence parallel
        return t.chunk(tp, dim=0)[tp_rank].contiguous() if sp else t

    def whole(t):     # the TP group's rows back together
        if not sp:
            return t
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.contiguous(), group=tp_group)
        return torch.cat(parts)

    gen = torch.Generator().manual_seed(9)
    x_a, x_b, g_b = [torch.randn(seq, mbs, cfg.hidden_size, generator=gen) for _ in range(3)]
    local = lambda t: shard(cp_chunks(t, r, cp, dim=0))  # noqa: E731

    out_ref, gx_ref, grads_ref = layer_fns.reference(ref, shard(x_a), shard(x_b), shard(g_b),
                                                     rope_full)
    full = {"output": cp_chunks(whole(out_ref), r, cp, dim=0),
            "input grad": cp_chunks(whole(gx_ref), r, cp, dim=0), **grads_ref}

    def vs_full(out, gx, grads, what):
        summed = {}
        for name, g in grads.items():
            summed[name] = g.clone()
            dist.all_reduce(summed[name], group=cp_group)
        same_tensors({"output": whole(out), "input grad": whole(gx), **summed}, full, tol,
                     f"{what} at CP={cp} vs CP=1:")

    out_b, gx_b, grads_b = layer_fns.reference(base, local(x_a), local(x_b), local(g_b), rope)
    vs_full(out_b, gx_b, grads_b, "megatron's layer")
    ring = {"output": out_b, "input grad": gx_b, **grads_b}
    ops = dh.program.layer_ops(seq, mbs)
    plans = layer_fns.named_plans(ops, nplans, seed)
    for name, plan in plans:
        out, gx, grads = layer_fns.dhelix_step(dh, plan, local(x_a), local(x_b), local(g_b),
                                               rope, seq, mbs)
        try:
            same_tensors({"output": out, "input grad": gx, **grads}, ring, 0.0,
                         "DHelix vs megatron's layer with the ring:")
            vs_full(out, gx, grads, "DHelix")
        except Mismatch as e:
            raise Mismatch(f"{config} TP={tp} CP={cp}, plan {name}: {e}") from None
    return {"ring_ops": [o.name for o in ops.forward + ops.backward if o.group == "cp"],
            "plans": len(plans), "distinct": len({p.digest() for _, p in plans}),
            "ngrads": len(grads_ref)}
