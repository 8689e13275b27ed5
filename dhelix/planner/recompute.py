"""Activation recomputation as plain data: which layers recompute, what a recomputed layer
keeps, and the activation peak of a training step with it (docs/recompute.md).

megatron's settings (`recompute_granularity`, `recompute_method`, `recompute_num_layers`):

* full / uniform N: every layer of a model chunk, in checkpoints of N layers. megatron
  keeps each group's input and recomputes the group's N layers at once; DHelix recomputes
  each of those layers by itself (its node keeps its own input), the same math.
* full / block N: the first N layers of the chunk, each its own checkpoint.
* selective: every layer keeps everything but the attention core's own saved state (the
  SDPA internals: its output and log-sum-exp, the GQA-repeated K/V), recomputed from the
  core's input (the qkv GEMM's output, which the layer keeps anyway) in its backward.

The memory model: a layer's forward ops keep `OpSpec.saved_bytes` for the backward, which
its backward ops free (`planner/simulate.py`). For a recomputed layer
(`recomputed_layer_ops`) the forward keeps less — full: only the layer input; selective:
nothing for `attn` — and the layer's backward first re-creates what the ordinary forward
keeps (`recompute_bytes`), then frees it as usual. `step_activation_peak` plays the
activations of a whole PP = 1 step (megatron's order or DHelix's) layer by layer with it.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

from dhelix.planner.opspec import LayerOps

FULL, SELECTIVE = "full", "selective"


def recomputed_layers(granularity: Optional[str], method: Optional[str],
                      num_layers: Optional[int], layers: int) -> List[Optional[str]]:
    """For each of a model chunk's `layers` layers (in order): "full", "selective" or None
    (not recomputed), by megatron's rules (`TransformerBlock._checkpointed_forward`)."""
    if granularity is None:
        return [None] * layers
    if granularity == SELECTIVE:
        return [SELECTIVE] * layers
    if granularity != FULL:
        raise ValueError(f"recompute granularity {granularity!r}: full or selective")
    if method == "uniform":
        if not num_layers or layers % num_layers:
            raise ValueError(f"uniform recompute in groups of {num_layers} layers: must "
                             f"divide the chunk's {layers} layers")
        return [FULL] * layers
    if method == "block":
        if not num_layers or num_layers < 1:
            raise ValueError(f"block recompute of {num_layers} layers: give at least 1")
        return [FULL if i < num_layers else None for i in range(layers)]
    raise ValueError(f"recompute method {method!r}: uniform or block (with full)")


def input_bytes(layer: LayerOps) -> float:
    """A layer's input, kept by a fully recomputed layer: [s/tp (with SP), b, h]."""
    sh = getattr(layer, "shape", None)
    if not sh:
        raise ValueError("input_bytes: the layer's ops carry no shape (estimate_layer_ops "
                         "sets it); give kept_input")
    tp = sh["tp"] if sh.get("sp") else 1
    return float(sh["seq"] // sh.get("cp", 1) // tp * sh["mbs"] * sh["hidden"] *
                 sh["dtype_bytes"])


def recomputed_layer_ops(layer: LayerOps, kind: Optional[str],
                         kept_input: Optional[float] = None) -> LayerOps:
    """The layer's ops as a recomputed layer's memory sees them: the forward keeps only
    what survives until the backward (full: the layer input, `kept_input` bytes, on the
    first forward op; selective: `attn` keeps nothing); the backward chain is unchanged (it
    frees what the ordinary forward keeps, which its recompute re-created)."""
    if kind is None:
        return layer
    if kind == FULL:
        keep = input_bytes(layer) if kept_input is None else float(kept_input)
        fwd = [dataclasses.replace(o, saved_bytes=keep if i == 0 else 0.0)
               for i, o in enumerate(layer.forward)]
    elif kind == SELECTIVE:
        fwd = [dataclasses.replace(o, saved_bytes=0.0) if o.name == "attn" else o
               for o in layer.forward]
    else:
        raise ValueError(f"recompute kind {kind!r}: full or selective")
    out = LayerOps(fwd, list(layer.backward))
    # what its backward re-creates: what the ordinary forward keeps, less what it kept
    out.recomputed = (kind, max(kept_bytes(layer) - sum(o.saved_bytes for o in fwd), 0.0))
    if hasattr(layer, "shape"):
        out.shape = dict(layer.shape, recompute=kind)
    return out


def kept_bytes(layer: LayerOps) -> float:
    """What the layer's forward keeps for its backward."""
    return float(sum(o.saved_bytes for o in layer.forward))


def recompute_bytes(layer: LayerOps) -> float:
    """What the layer's backward re-creates before its backward ops (0 if not recomputed):
    what the ordinary forward keeps, less what the recomputed one kept."""
    got = getattr(layer, "recomputed", None)
    return float(got[1]) if got else 0.0


def step_activation_peak(layers: Sequence[LayerOps], num_microbatches: int,
                         schedule: str = "dhelix") -> float:
    """Peak activation bytes of a PP = 1 training step, layer by layer: each layer's
    forward adds `kept_bytes`; its backward first adds `recompute_bytes` (the peak is
    taken there), then drops both. `layers` are the chunk's layers in order, each as
    `recomputed_layer_ops` made it. megatron: each micro-batch's forward then its backward.
    DHelix (`schedules/dhelix.py`): F(1); [F(k+1) ∥ B(k)], α's layer i beside β's layer
    L−i+1 (β's recompute runs at the start of its layer's backward, before the pair);
    B(N)."""
    if num_microbatches < 1 or not layers:
        raise ValueError("step_activation_peak: at least one layer and one micro-batch")
    kept = [kept_bytes(o) for o in layers]
    extra = [recompute_bytes(o) for o in layers]
    L = len(layers)
    mem = peak = 0.0

    def fwd(i):
        nonlocal mem, peak
        mem += kept[i]
        peak = max(peak, mem)

    def bwd(j):
        nonlocal mem, peak
        mem += extra[j]
        peak = max(peak, mem)
        mem -= kept[j] + extra[j]

    if schedule == "megatron":
        for _ in range(num_microbatches):
            for i in range(L):
                fwd(i)
            for j in reversed(range(L)):
                bwd(j)
        return peak
    if schedule != "dhelix":
        raise ValueError(f"schedule {schedule!r}: dhelix or megatron")
    for i in range(L):                                  # F(1)
        fwd(i)
    for _ in range(num_microbatches - 1):               # F(k+1) ∥ B(k)
        for i in range(L):
            j = L - 1 - i
            mem += extra[j]                             # β's recompute, then the pair
            mem += kept[i]
            peak = max(peak, mem)
            mem -= kept[j] + extra[j]
    for j in reversed(range(L)):                        # B(N)
        bwd(j)
    return peak


__all__ = ["FULL", "SELECTIVE", "input_bytes", "kept_bytes", "recompute_bytes",
           "recomputed_layer_ops", "recomputed_layers", "step_activation_peak"]
