"""Megatron-LM's exit options for `dhelix train`: a run that ends before --train-iters on
purpose, saved, so a later `--load` continues it bit for bit.

  --exit-signal-handler       on SIGTERM (what Slurm sends before a time limit, with
                              `--signal=B:TERM@S`), finish the step, save, exit 0
  --exit-duration-in-mins M   stop after the step that passes M minutes of training
  --exit-interval N           stop after every step whose iteration is a multiple of N

The ranks agree after every step (one all-reduce of three flags, only when an option is
set), so all of them stop at the same iteration whichever got the signal.
"""
from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist


class ExitCheck:
    def __init__(self, cfg, device: torch.device):
        self.handler = cfg.exit_signal_handler
        self.minutes = cfg.exit_duration_in_mins
        self.interval = cfg.exit_interval
        self.device = device
        self.t0 = time.monotonic()
        self.received: Optional[int] = None
        self._old = None
        if self.handler:
            self._old = signal.signal(signal.SIGTERM, self._on_signal)

    @property
    def enabled(self) -> bool:
        return bool(self.handler or self.minutes or self.interval)

    def _on_signal(self, signum, frame) -> None:
        self.received = signum          # acted on after this step, on every rank

    def close(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None

    def __call__(self, iteration: int) -> Optional[str]:
        """Why every rank stops after `iteration` (None: go on)."""
        if not self.enabled:
            return None
        elapsed = (time.monotonic() - self.t0) / 60
        flags = torch.tensor([self.received is not None,
                              bool(self.minutes) and elapsed >= self.minutes,
                              bool(self.interval) and iteration % self.interval == 0],
                             dtype=torch.int32, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0]:
            return "SIGTERM received (--exit-signal-handler)"
        if flags[1]:
            return f"--exit-duration-in-mins {self.minutes:g} reached"
        if flags[2]:
            return f"--exit-interval {self.interval}"
        return None
