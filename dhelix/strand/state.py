"""Per-strand, per-layer tensor store that the ops of one layer read and write.

A comm op stores a `Pending`; the first op that reads that key waits for it, so data
dependencies between ops need no bookkeeping beyond the keys they use. Tensors kept for
the backward are counted by the activation meter while they live.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List

import torch

from dhelix.strand.lanes import Lanes, Pending
from dhelix.base.memory import METER


class StrandState:
    def __init__(self, lanes: Lanes, strand: str = "α", label: str = ""):
        self.lanes = lanes
        self.strand = strand
        self.label = label            # e.g. the micro-batch, for traces
        self._v: Dict[str, Any] = {}
        self._tokens: Dict[str, list] = {}
        self.pending: List[Pending] = []
        self.grads: Dict[int, torch.Tensor] = {}   # id(param) -> grad
        self.meta: Dict[str, Any] = {}             # attention mask, rotary embeddings
        # Only what the forward keeps for the backward counts as activation memory, as
        # autograd's saved tensors do for megatron's layer; backward temporaries do not.
        self.counting = True
        self.waited = 0.0              # seconds spent waiting for comm results (traces)

    def put(self, key: str, value) -> None:
        self.drop(key)
        self._v[key] = value
        if isinstance(value, Pending):
            self.pending.append(value)
            value = value.out
        self._hold(key, value)

    def get(self, key: str):
        v = self._v[key]
        if isinstance(v, Pending):
            t = time.perf_counter()
            v = self.lanes.resolve(v)
            self.waited += time.perf_counter() - t
            self._v[key] = v
        return v

    def has(self, key: str) -> bool:
        return key in self._v

    def drop(self, *keys: str) -> None:
        for k in keys:
            self._v.pop(k, None)
            self._tokens.pop(k, None)

    def consume(self, key: str, reader: str, readers) -> None:
        """Drop `key` once every op in `readers` has read it (they may run in any order,
        e.g. a dgrad and its deferred wgrad)."""
        done = self._v.setdefault(f"_read:{key}", set())
        done.add(reader)
        if done >= set(readers):
            self.drop(key, f"_read:{key}")

    def clear(self) -> None:
        self._v.clear()
        self._tokens.clear()

    def barrier(self) -> None:
        """Wait for every comm this strand has in flight (end of a step)."""
        for p in self.pending:
            self.lanes.resolve(p)
        self.pending.clear()

    def acc_grad(self, param: torch.nn.Parameter, g: torch.Tensor) -> None:
        k = id(param)
        self.grads[k] = g if k not in self.grads else self.grads[k] + g

    def _hold(self, key, value):
        if not self.counting:
            return
        items = value if isinstance(value, (tuple, list)) else (value,)
        toks = [METER.hold(t) for t in items if isinstance(t, torch.Tensor)]
        self._tokens[key] = [t for t in toks if t is not None]
