"""The lane mode switch: `DHELIX_LANES=strict` makes the CPU lanes keep CUDA's and NCCL's
rules (`strand/lanes.py` StrictLanes) and makes the CPU compat layer's device-to-host
copies asynchronous (`compat/cpu.py`), so that bugs only a GPU would show fail on CPU."""
from __future__ import annotations

import os


def lanes_mode() -> str:
    """'strict', 'cpu' or 'auto' (the default: CUDA lanes on CUDA, gloo lanes on CPU)."""
    mode = os.environ.get("DHELIX_LANES", "auto").strip().lower() or "auto"
    if mode not in ("auto", "cpu", "strict"):
        raise ValueError(f"DHELIX_LANES={mode!r}: use strict, cpu or auto")
    return mode


def strict() -> bool:
    return lanes_mode() == "strict"
