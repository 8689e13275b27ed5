"""What a measurement was taken on; compared when a table is used elsewhere."""
from __future__ import annotations

import os
import platform

import torch


def hardware() -> dict:
    if torch.cuda.is_available():
        dev = torch.cuda.get_device_name()
    else:
        dev = f"cpu:{platform.processor() or platform.machine()}x{os.cpu_count()}"
    return {"device": dev, "link": os.environ.get("DHELIX_LINK", "unspecified")}
