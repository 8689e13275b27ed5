"""How many parameters a GPU holds, by kind, for a model config at a TP/EP size (plain
arithmetic, no torch): what paced compute scales gradients by (`train/emulate.py`:
`grad_scales`), what the bench's prediction moves (`stage_grad_bytes`), and what `dhelix
advise` counts memory and MFU with."""
from __future__ import annotations

from typing import Dict


def param_classes(m, tp: int, ep: int = 1) -> Dict[str, float]:
    """Parameters one rank holds, per kind of megatron parameter: "layer" (one layer's
    dense weights, TP-split, norms and router included), "experts" (one layer's local
    experts), "embedding", "output" (vocab-parallel), "norm" (the final norm)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    hn = getattr(m, "kv_channels", None) or h // m.num_attention_heads
    qkv = (m.num_attention_heads + 2 * (m.num_query_groups or m.num_attention_heads)) * hn
    ap = m.num_attention_heads * hn
    f1 = f * (2 if m.activation == "swiglu" else 1)
    norm = h * (2 if m.normalization == "LayerNorm" else 1)
    bias = m.add_bias_linear
    attn = (h * qkv + ap * h + (qkv if bias else 0)) / tp + (h if bias else 0)
    mlp = (h * f1 + f * h + (f1 if bias else 0)) / tp + (h if bias else 0)
    out = {"embedding": m.vocab_size * h / tp, "output": m.vocab_size * h / tp, "norm": norm}
    if m.num_experts:
        out["layer"] = attn + 2 * norm + m.num_experts * h
        out["experts"] = m.num_experts / ep * (h * f1 + f * h)
    else:
        out["layer"], out["experts"] = attn + mlp + 2 * norm, 0.0
    return out


def param_class(name: str) -> str:
    """The kind (`param_classes`) of a parameter of megatron's GPT by its name."""
    if ".experts." in name:
        return "experts"
    if ".layers." in name:
        return "layer"
    if "word_embeddings" in name or "position_embeddings" in name:
        return "embedding"
    if "output_layer" in name:
        return "output"
    return "norm"


def head_gemm_flops(m, tokens: int, tp: int) -> float:
    """FLOPs of one of the output layer's three GEMMs (forward, dgrad, wgrad) on one rank:
    `tokens` rows (the gathered sequence × micro-batch) by the hidden size by the
    vocabulary's TP shard."""
    return 2.0 * tokens * m.hidden_size * m.vocab_size / tp


# ---- gradients: what the DP (and expert-DP) reduction moves -------------------------------
def grad_scales(small, big, chunks, tp: int, ep: int) -> Dict[str, float]:
    """{"dp": ..., "edp": ...}: the emulated model's gradient bytes over the small one's,
    for the DP group (dense parameters) and the expert-DP group (the experts') of the
    stage on this rank: each parameter counts as the emulated model's parameter of its
    kind (the embedding as the emulated vocabulary's, a layer as its layer's). Gradients
    stay in the small model's dtype (fp32 here: megatron's default main grads)."""
    cs, cb = param_classes(small, tp, ep), param_classes(big, tp, ep)
    num, den = {"dp": 0.0, "edp": 0.0}, {"dp": 0.0, "edp": 0.0}
    for c in chunks:
        for name, p in c.named_parameters():
            k = param_class(name)
            g = "edp" if k == "experts" else "dp"
            num[g] += p.numel() * cb[k] / cs[k]
            den[g] += p.numel()
    return {g: num[g] / den[g] if den[g] else 1.0 for g in num}


def stage_grad_bytes(m, tp: int, ep: int, layers: int, first: bool, last: bool,
                     dtype_bytes: int = 4) -> Dict[str, float]:
    """{"dp", "edp"}: bytes of gradients a pipeline stage of `layers` layers reduces over
    DP and expert-DP (the embedding on the first stage, final norm and output layer on the
    last), as `grad_scales` makes the emulation move them."""
    c = param_classes(m, tp, ep)
    dense = layers * c["layer"] + (c["embedding"] if first else 0) + \
        ((c["output"] + c["norm"]) if last else 0)
    return {"dp": dense * dtype_bytes, "edp": layers * c["experts"] * dtype_bytes}
