"""Peak activation memory, measured the same way for baseline and DHelix, on both devices.

A step's activation peak is (peak allocated − allocated at the step's start), the peak
reset when the step starts, so weights, gradient buffers and optimizer states that live
across steps do not count. On GPU "allocated" is the CUDA allocator's (activations and
the step's temporaries: the allocator cannot tell them apart). On CPU it is
saved-tensor accounting — every tensor that autograd saves for backward, and every
tensor a DHelix op keeps for its backward op, is counted once per storage while it is
alive — which counts activations only to begin with.
"""
from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass

import torch


class ActivationMeter:
    def __init__(self):
        self.live = {}          # storage key -> [bytes, refcount]
        self.current = 0
        self.peak = 0

    # --- bookkeeping ---------------------------------------------------------------------
    def _key(self, t: torch.Tensor):
        st = t.untyped_storage()
        return (st.data_ptr(), st.nbytes())

    def hold(self, t: torch.Tensor):
        """Count `t`'s storage until the returned token is garbage-collected."""
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or isinstance(
                t, torch.nn.Parameter):
            return None
        key = self._key(t)
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = entry = [key[1], 0]
            self.current += key[1]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Token(self, key, entry)

    def forget(self, t: torch.Tensor) -> None:
        """`t`'s storage is freed now (its holders keep only its metadata): stop counting
        it, whatever tokens still name it."""
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            entry = self.live.pop(self._key(t), None)
            if entry is not None:
                self.current -= entry[0]

    def _release(self, key, entry):
        if self.live.get(key) is not entry:     # forgotten (freed), maybe its key reused
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.current -= entry[0]

    # --- autograd saved tensors ------------------------------------------------------------
    @contextlib.contextmanager
    def autograd(self):
        def pack(t):
            return (t, self.hold(t))

        def unpack(packed):
            return packed[0]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def reset_peak(self):
        self.peak = self.current


class _Token:
    """Releases its storage's count when collected. A `__del__`, not `weakref.finalize`:
    a finalizer costs a registry entry and a weak reference per token, and a step makes
    thousands of tokens (every saved tensor of both models on the bench)."""
    __slots__ = ("meter", "key", "entry")

    def __init__(self, meter, key, entry):
        self.meter, self.key, self.entry = meter, key, entry

    def __del__(self):
        self.meter._release(self.key, self.entry)


METER = ActivationMeter()


@dataclass
class StepMemory:
    """The memory of one training step on `device`: `begin()` when it starts, then
    `activation_peak()` after its forward-backward and `total_peak()` at its end."""
    device: torch.device
    start_bytes: int = 0

    @property
    def method(self) -> str:
        return ("cuda allocator: max_memory_allocated − memory_allocated at the step's start"
                if self.device.type == "cuda" else "saved-tensor accounting")

    def begin(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = int(torch.cuda.memory_allocated(self.device))
        else:
            METER.reset_peak()
            self.start_bytes = int(METER.current)

    def activation_peak(self) -> int:
        """Bytes the step added at its peak so far, over what it started with."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device)) - self.start_bytes
        return int(METER.peak) - self.start_bytes

    def total_peak(self) -> int:
        """Everything: on CUDA the allocator's peak since `begin` (weights, grads, optimizer
        states, activations); on CPU the process's peak RSS (it cannot be reset)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def model_bytes(chunks) -> dict:
    """{"weights", "grads"}: bytes of this rank's parameters and of megatron's gradient
    buffers (DDP's contiguous main-grad buffers, padding included; else each parameter's
    main_grad)."""
    params = {id(p): p for c in chunks for p in c.parameters()}
    weights = sum(p.numel() * p.element_size() for p in params.values())
    bufs = [b for c in chunks for b in (getattr(c, "buffers", None) or []) +
            (getattr(c, "expert_parallel_buffers", None) or [])
            if getattr(b, "grad_data", None) is not None]
    if bufs:
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in bufs)
    else:
        grads = sum(p.main_grad.numel() * p.main_grad.element_size()
                    for p in params.values() if getattr(p, "main_grad", None) is not None)
    return {"weights": weights, "grads": grads}

