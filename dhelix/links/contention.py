"""Contention on the paced link (`paced:RATE[,LAT],slow=X`): GEMMs that overlap a transfer
are stretched.

On a GPU a NCCL kernel occupies SMs, and the GEMMs it overlaps run roughly 5-20% slower;
the paced link's transfers otherwise overlap for free. With `slow=X`, every GEMM-like op
this rank runs on CPU tensors is timed (host clock, [t0, t1]); if a transfer of this rank
was in flight for b = `PacedLink.busy_seconds(t0, t1)` > 0 of that time (the link model's
in-flight intervals, not the data's real movement), the op is followed by `X * b` seconds
of sleep: the GEMM is "stretched" while the transfer keeps going, and the core is free
meanwhile, as the measured part is real compute and only the charge is slept.

Stretched: `GEMM_OPS` below (mm, addmm, bmm, baddbmm, addbmm and their out= and in-place
forms, addmm with a fused activation, CPU flash attention forward and backward,
convolution forward and backward, grouped mm), in forward and backward alike. Not
stretched: elementwise and reduction ops, copies, norms, optimizers (on a GPU they are
memory-bound and suffer differently), and ops on other devices than the CPU (a GPU has its
own contention, and a host clock would time only a kernel's launch). A nested op inside a
stretched one (a convolution's own GEMMs) is not charged twice.

Sleeps are batched per thread: the charge accrues and is slept once at least MIN_SLEEP_S is
owed (a short time.sleep overshoots by ~50-100 us), and an oversleep is credited against
the next charges, so the seconds slept track the seconds charged (`PacedLink.stretched_s`,
`stretch_slept_s`).

Two hooks, the same stretch:
  kernel   (torch >= 2.9, `torch.library.get_kernel`): the CPU kernels of `GEMM_OPS` are
           replaced by a wrapper calling the original kernel. Process-wide (every thread,
           autograd's included), and no other op pays anything (~2 us more per GEMM).
  mode     (older torch, or DHELIX_STRETCH_HOOK=mode): a TorchDispatchMode entered in the
           installing thread (the rank's training thread: `install` runs in
           `init_distributed`) and never left. Every op of that thread goes through Python
           (~4 us more per op, elementwise ones too), and only that thread is stretched
           (autograd's backward on CPU runs on the calling thread, with its modes).
Megatron's baseline and DHelix run under the same hook, so a bench compares them fairly.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from typing import List, Optional

import torch

# GEMM-like aten ops (packets; every overload with its own CPU kernel is stretched)
GEMM_OPS = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "addbmm", "addbmm_",
            "_addmm_activation", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward", "convolution",
            "convolution_backward", "_grouped_mm")
MIN_SLEEP_S = 5e-4
HOOKS = ("kernel", "mode")

_C = torch._C
_INSTALLED: dict = {}          # "hook" -> the kind; "keep" -> the Library / mode (alive)


def gemm_overloads() -> List["torch._ops.OpOverload"]:
    """The overloads of GEMM_OPS this torch has a CPU kernel for (a direct one or a
    CompositeExplicitAutograd one: never CompositeImplicitAutograd, whose ops decompose
    into these)."""
    out = []
    for name in GEMM_OPS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for ov in packet.overloads():
            full = f"aten::{name}" + ("" if ov == "default" else f".{ov}")
            if _C._dispatch_has_computed_kernel_for_dispatch_key(full, "CPU") and \
                    not _C._dispatch_has_kernel_for_dispatch_key(
                        full, "CompositeImplicitAutograd"):
                out.append(getattr(packet, ov))
    return out


class Stretcher:
    """Times a GEMM and sleeps `slow` x the part of it a transfer was in flight."""

    def __init__(self, link, slow: float):
        self.link, self.slow = link, slow
        self.local = threading.local()       # .inside (nested op), .owed (sleep owed)

    def call(self, fn, *args, **kwargs):
        local = self.local
        if getattr(local, "inside", False):
            return fn(*args, **kwargs)
        local.inside = True
        try:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            t1 = time.perf_counter()
        finally:
            local.inside = False
        busy = self.link.busy_seconds(t0, t1)
        if busy > 0:
            self.stretch(self.slow * busy)
        return out

    def stretch(self, extra_s: float) -> None:
        self.link.charge_stretch(extra_s)
        owed = getattr(self.local, "owed", 0.0) + extra_s
        if owed >= MIN_SLEEP_S:
            t = time.perf_counter()
            time.sleep(owed)                 # releases the GIL, holds no core
            slept = time.perf_counter() - t
            self.link.note_stretch_sleep(slept)
            owed -= slept                    # an oversleep is credited
        self.local.owed = owed


def _install_kernels(st: Stretcher):
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        for op in gemm_overloads():
            kernel = torch.library.get_kernel(op, "CPU")

            def impl(keyset, *args, _kernel=kernel, **kwargs):
                return st.call(_kernel.call_boxed, keyset, *args, **kwargs)
            name = op._schema.name.split("::", 1)[1] + \
                ("" if op._overloadname == "default" else f".{op._overloadname}")
            lib.impl(name, impl, "CPU", with_keyset=True)
    return lib


def _on_cpu(args) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type == "cpu"
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0].device.type == "cpu"
    return False


def _mode(st: Stretcher):
    from torch.utils._python_dispatch import TorchDispatchMode

    class StretchMode(TorchDispatchMode):
        ops = frozenset(gemm_overloads())

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True                      # torch.compile'd code keeps compiling

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in self.ops and _on_cpu(args):
                return st.call(func, *args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))
    mode = StretchMode()
    mode.__enter__()                         # for the life of the process: never left
    return mode


def install_stretch(link, slow: float, hook: Optional[str] = None) -> str:
    """Stretch this process's GEMMs by `slow` x their overlap with `link`'s transfers (once
    per process); returns the hook used ("kernel" | "mode"): `hook`, else
    DHELIX_STRETCH_HOOK, else "kernel" where torch has `torch.library.get_kernel`."""
    if "hook" in _INSTALLED:
        return _INSTALLED["hook"]
    hook = hook or os.environ.get("DHELIX_STRETCH_HOOK") or \
        ("kernel" if hasattr(torch.library, "get_kernel") else "mode")
    if hook not in HOOKS:
        raise ValueError(f"DHELIX_STRETCH_HOOK={hook!r}: use one of {', '.join(HOOKS)}")
    if hook == "kernel" and not hasattr(torch.library, "get_kernel"):
        raise ValueError(f"DHELIX_STRETCH_HOOK=kernel needs torch >= 2.9 "
                         f"(torch.library.get_kernel); this is {torch.__version__}: "
                         f"use DHELIX_STRETCH_HOOK=mode")
    st = Stretcher(link, slow)
    _INSTALLED["keep"] = _install_kernels(st) if hook == "kernel" else _mode(st)
    _INSTALLED["hook"] = hook
    return hook


def installed() -> Optional[str]:
    """The hook installed in this process, if any."""
    return _INSTALLED.get("hook")
