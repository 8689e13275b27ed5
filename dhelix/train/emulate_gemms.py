"""Paced compute for megatron's own layers (and the output layer on both paths): their
GEMMs, hooked in the CPU kernels, named by shape as the op they are, wait out that op's
emulated time (`train/emulate.py` paces DHelix's layers op by op).

The output layer ("the head": forward, dgrad, wgrad of the vocabulary-parallel GEMM) is
paced on both paths, outside DHelix's ops: megatron's post-process runs it in both
schedules, so both wait out the emulated vocabulary's GEMMs (`head_seconds`).
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Dict, Optional

import torch

from dhelix.train.emulation_flags import EmulationError

# the active pacer and GEMM pacer: one registry (emulate.py shares it and `_LOCAL`)
_ACTIVE: Dict[str, object] = {}   # "pacer" (emulate.Pacer), "gemm", "gemm_lib"
_LOCAL = threading.local()          # .in_op: a DHelix op is running (paced as a whole)


@contextmanager
def paced_op(name: str):
    """A piece of megatron's layer that DHelix runs as the op `name` — the ring attention's
    steps (`models/ring_attention.py`), whose own kernels are not GEMMs `GemmPacer` can
    name: paced as that op, when megatron's layers are paced (a no-op otherwise, and
    inside a DHelix op, which is paced as a whole). Its kernels are not named meanwhile."""
    g = _ACTIVE.get("gemm")
    if g is None or getattr(_LOCAL, "in_op", False):
        yield
        return
    t0 = time.perf_counter()
    _LOCAL.in_op = True
    try:
        yield
    finally:
        _LOCAL.in_op = False
    g.pacer.after(name, t0)


def head_seconds(big, cluster: dict, tokens: int, tp: int) -> float:
    """One of the output layer's three GEMMs (forward, dgrad, wgrad) of the emulated
    model on `cluster`: 2 · tokens · hidden · vocabulary / TP FLOPs at the bf16 peak
    times the achieved fraction (as `dhelix advise` prices the head)."""
    from dhelix.models.params import head_gemm_flops
    peak = float(cluster["peak_flops"]["bf16"]) * float(cluster.get("achieved_fraction", 1.0))
    return head_gemm_flops(big, tokens, tp) / peak


def output_weight_shape(chunks) -> Optional[tuple]:
    """(hidden, vocabulary shard): the output layer's GEMM as megatron runs it on this
    rank (the shared embedding's where tied), or None on a stage without it."""
    for c in chunks:
        for name, p in c.named_parameters():
            if name.endswith("output_layer.weight"):
                return int(p.shape[1]), int(p.shape[0])
    for c in chunks:          # tied: the output layer multiplies by the word embeddings
        for mod in c.modules():
            if getattr(mod, "post_process", False) and \
                    getattr(mod, "share_embeddings_and_output_weights", False):
                w = mod.shared_embedding_or_output_weight()
                return int(w.shape[1]), int(w.shape[0])
    return None


class GemmPacer:
    """Paced compute for the layers DHelix does not run op by op — megatron's own
    TransformerLayer, the baseline: each of their GEMMs (and attention kernels) is named
    by its weight's shape as the DHelix op it is (qkv, proj, fc1, fc2: forward, dgrad,
    wgrad; attn, attn_b) and waits out that op's emulated time, as `Pacer.after` does.
    An expert's GEMM (megatron's SequentialMLP runs the experts one by one, each on the
    rows routed to it) waits out its rows' share of the expert op: rows / the routed rows
    the op is priced for (the balanced expectation, `planner/shapes.py`). The ring
    attention's steps are paced by `paced_op`. Hooked into the CPU kernels
    (`contention.py`'s mechanism); the output layer's GEMMs as "head", "head_dgrad",
    "head_wgrad" when given (on both paths); other GEMMs (the router's) and elementwise
    ops run at their own speed, as on the DHelix path."""

    def __init__(self, pacer, names: Dict[tuple, str], tokens: set,
                 experts: Optional[Dict[tuple, str]] = None, routed: int = 0):
        self.pacer, self.names, self.tokens = pacer, names, tokens
        self.experts, self.routed = experts or {}, routed

    def name(self, func: str, args) -> Optional[tuple]:
        """(the DHelix op, the share of it) a kernel call is, or None."""
        if func.startswith("_scaled_dot_product_flash_attention_for_cpu"):
            return ("attn_b" if func.endswith("backward") else "attn"), 1.0
        if func in ("mm", "addmm"):
            a, b = (args[0], args[1]) if func == "mm" else (args[1], args[2])
            if a.dim() != 2 or b.dim() != 2:
                return None
            (m, k), n = a.shape, b.shape[1]
            if m in self.tokens and ("x", k, n) in self.names:
                return self.names[("x", k, n)], 1.0          # forward or dgrad
            if k in self.tokens and ("w", m, n) in self.names:
                return self.names[("w", m, n)], 1.0          # wgrad
            if ("x", k, n) in self.experts:                   # an expert's rows
                return self.experts[("x", k, n)], m / self.routed
            if ("w", m, n) in self.experts:
                return self.experts[("w", m, n)], k / self.routed
        return None

    def call(self, func: str, fn, *args, **kwargs):
        if getattr(_LOCAL, "in_op", False) or _ACTIVE.get("gemm") is not self:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        named = self.name(func, args[1:] if args and not isinstance(args[0], torch.Tensor)
                          else args)
        if named is not None and named[0] in self.pacer.seconds:
            self.pacer.after(named[0], t0, named[1])
        return out


def _routed_rows(small, tp: int, sp: bool, seq: int, mbs: int, cp: int) -> int:
    """The rows a rank's experts are priced for: its tokens × top-k (`planner/shapes.py`'s
    balanced expectation); 0 for a dense model."""
    if not small.num_experts:
        return 0
    s = seq // cp
    return (s // tp if sp and tp > 1 else s) * mbs * small.moe_router_topk


def _gemm_names(small, tp: int, sp: bool, seq: int, mbs: int, cp: int,
                seconds: Dict[str, float], head: Optional[tuple] = None,
                layers: bool = True) -> tuple:
    """The running layer's GEMMs by shape: (dense: shape -> the DHelix op it is, the
    tokens its rows hold, experts: shape -> the expert op, the routed rows an expert op is
    priced for). ("x", K, N) is a forward or dgrad (M = the tokens, or an expert's rows),
    ("w", M, N) a wgrad (K = the tokens or rows). Two GEMMs of one shape are one key when
    their emulated times agree (fc1's dgrad and fc2's forward, without a gated MLP);
    EmulationError when they do not, when the token count is also a weight width, or when
    an expert's shape is another GEMM's (the router's, the output layer's). `head`: the
    output layer's weight (hidden, vocabulary shard), named "head" when given; `layers`
    False: the head alone (DHelix runs the layers op by op)."""
    from dhelix.models.gpt import transformer_config
    from dhelix.planner.shapes import _sizes
    sp = sp and tp > 1
    z = _sizes(transformer_config(small, tp=tp, sequence_parallel=sp), tp, sp, seq, mbs, cp)
    T = z["s"] * mbs           # megatron's GEMMs see the gathered sequence under SP
    h = z["h"]
    weights = {"qkv": (h, z["qkv"] // tp), "proj": (z["ap"] // tp, h)}
    experts = {}
    if small.num_experts:      # experts are not TP-split (expert TP 1)
        if small.moe_shared_expert_intermediate_size:
            raise EmulationError("--compute paced:...: megatron's shared experts are not "
                                 "paced; emulate a model without them, or run --dhelix")
        experts = {"experts_fc1": (h, z["f1"]), "experts_fc2": (z["f"], h)}
    else:
        weights.update(fc1=(h, z["f1"] // tp), fc2=(z["f"] // tp, h))
    if not layers:
        weights, experts = {}, {}
    if head is not None:
        weights["head"] = head

    def clash(what):
        return EmulationError(
            f"--compute paced:...: {what}; megatron's GEMMs cannot be told apart: choose "
            f"another --seq-length / --micro-batch-size (or a model whose hidden, QKV and "
            f"FFN widths differ)")

    def keyed(ws):
        names = {}
        for op, (i, o) in ws.items():
            if T in (i, o):
                raise clash(f"the {op} weight ({i} x {o}) is as wide as the {T} tokens")
            for key, name in ((("x", i, o), op), (("x", o, i), f"{op}_dgrad"),
                              (("w", o, i), f"{op}_wgrad")):
                other = names.get(key)
                if other is not None and abs(seconds[other] - seconds[name]) > \
                        1e-9 * max(seconds[name], 1e-30):
                    raise clash(f"{other} and {name} have one shape {key[1:]}")
                names.setdefault(key, name)
        return names
    names, by_expert = keyed(weights), keyed(experts)
    others = {"the router": small.num_experts or 0,
              "the output layer": head[1] if head else small.vocab_size // tp}
    for key, name in by_expert.items():
        if key in names:
            raise clash(f"{names[key]} and {name} have one shape {key[1:]}")
        for what, n in others.items():
            if n and n in key[1:] and h in key[1:]:
                raise clash(f"{name} has the shape of {what}'s GEMM {key[1:]}")
    return names, {T}, by_expert, _routed_rows(small, tp, sp, seq, mbs, cp)


def _install_gemm_hook(gp: GemmPacer) -> None:
    """Wrap the CPU kernels of the GEMM ops once per process (`contention.py`'s hook)."""
    if "gemm_lib" in _ACTIVE:
        _ACTIVE["gemm"] = gp
        return
    import warnings
    from dhelix.links.contention import gemm_overloads, installed
    if installed():
        raise EmulationError("--compute paced:... and the paced link's slow=X both hook the "
                             "GEMMs: drop slow= (the cluster file's comm_compute_slowdown "
                             "stretches paced compute)")
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # "Overriding a previously registered kernel"
        for op in gemm_overloads():
            kernel = torch.library.get_kernel(op, "CPU")
            base = op._schema.name.split("::", 1)[1]

            def impl(keyset, *args, _kernel=kernel, _base=base, **kwargs):
                g = _ACTIVE.get("gemm")
                if g is None:
                    return _kernel.call_boxed(keyset, *args, **kwargs)
                return g.call(_base, _kernel.call_boxed, keyset, *args, **kwargs)
            lib.impl(base + ("" if op._overloadname == "default" else
                             f".{op._overloadname}"), impl, "CPU", with_keyset=True)
    _ACTIVE["gemm_lib"] = lib
    _ACTIVE["gemm"] = gp
    from dhelix.models import ring_attention
    ring_attention.STEP = paced_op          # the ring's steps, paced as DHelix's attn ops
