"""Peak activation memory, measured the same way for baseline and DHelix.

On GPU: the CUDA allocator's peak. On CPU: saved-tensor accounting — every tensor that
autograd saves for backward, and every tensor a DHelix op keeps for its backward op, is
counted once per storage while it is alive; the peak of that sum is reported.
"""
from __future__ import annotations

import contextlib
import resource
import weakref

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
        token = _Token()
        weakref.finalize(token, self._release, key)
        return token

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
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
    __slots__ = ("__weakref__",)


METER = ActivationMeter()


def peak_memory_bytes(device: torch.device) -> dict:
    """{'activations': peak saved activation bytes, 'process_rss': peak RSS bytes}."""
    if device.type == "cuda":
        return {"activations": int(torch.cuda.max_memory_allocated(device)),
                "process_rss": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
                "method": "cuda max_memory_allocated"}
    return {"activations": int(METER.peak),
            "process_rss": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
            "method": "saved-tensor accounting"}
