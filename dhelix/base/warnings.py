"""megatron and torch warn about missing apex/TE and CUDA-only tuning on every rank."""
from __future__ import annotations

import os
import warnings


def quiet_library_warnings() -> None:
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for cat in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=cat, module=r"(megatron|torch)\.")
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|apex).*")
    warnings.filterwarnings("ignore", message=r".*deprecated.*")
