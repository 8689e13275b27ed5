"""What a measurement was taken on; compared when a table is used elsewhere."""
from __future__ import annotations

import os
import platform

import torch


def uses_cuda() -> bool:
    """Whether this process computes on CUDA: a device is visible and not refused.
    DHELIX_FORCE_CPU=1 refuses it (the test ranks, a CPU run on a GPU machine): every
    device decision (the process group's backend, the CPU compat patches, the RNG state a
    checkpoint records) asks here, never torch.cuda.is_available() alone."""
    return os.environ.get("DHELIX_FORCE_CPU") != "1" and torch.cuda.is_available()


def hardware() -> dict:
    if uses_cuda():
        dev = torch.cuda.get_device_name()
    else:
        dev = f"cpu:{platform.processor() or platform.machine()}x{os.cpu_count()}"
    return {"device": dev, "link": os.environ.get("DHELIX_LINK", "unspecified")}
