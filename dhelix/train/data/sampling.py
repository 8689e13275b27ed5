"""The sample -> rank mapping and the helpers every data source shares:
:func:`global_sample_indices` (which global samples rank ``r``'s micro-batch
``j`` holds; see the :mod:`dhelix.train.data` package docstring),
argument validation, and turning an int array of ``seq_length + 1``-token
samples into the trainer's micro-batch dict."""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch

def global_sample_indices(microbatch: int, micro_batch_size: int, dp_rank: int,
                          dp_size: int) -> np.ndarray:
    """Global sample indices of rank ``dp_rank``'s micro-batch number
    ``microbatch`` (counted from 0 across steps: ``step * num_microbatches + m``):
    ``microbatch * b * dp_size + dp_rank * b + arange(b)``."""
    b = micro_batch_size
    start = microbatch * b * dp_size + dp_rank * b
    return np.arange(start, start + b, dtype=np.int64)


def _check_common(seq_length, micro_batch_size, dp_rank, dp_size, vocab_size,
                  num_microbatches=1):
    if int(seq_length) < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
    if int(micro_batch_size) < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    if int(num_microbatches) < 1:
        raise ValueError(f"number of micro-batches must be >= 1, got {num_microbatches}")
    if int(dp_size) < 1 or not 0 <= int(dp_rank) < int(dp_size):
        raise ValueError(f"invalid data-parallel rank {dp_rank} for dp_size {dp_size}")
    if int(vocab_size) < 2:
        raise ValueError(f"--vocab-size must be >= 2, got {vocab_size}")


def _as_batch(x: np.ndarray, vocab_size: int, what: str) -> Dict[str, torch.Tensor]:
    """``x``: int array [b, s+1] of samples -> the micro-batch dict."""
    hi = int(x.max())
    if hi >= vocab_size or int(x.min()) < 0:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small for the {what} data: it contains "
            f"token id {hi}; use --vocab-size >= {hi + 1}")
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))
    tokens = t[:, :-1].contiguous()
    labels = t[:, 1:].contiguous()
    b, s = tokens.shape
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.ones(b, s, dtype=torch.float32),
        "position_ids": torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous(),
    }
