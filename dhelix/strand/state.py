"""Per-strand, per-layer tensor store that the ops of one layer read and write.

A comm op stores a `Pending`; the first op that reads that key waits for it, so data
dependencies between ops need no bookkeeping beyond the keys they use. Tensors kept for
the backward are counted by the activation meter while they live.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from dhelix.strand.lanes import Lanes, Pending
from dhelix.base.memory import METER


class GradHandoffError(RuntimeError):
    """A parameter's gradient contribution arrived after its gradient had been handed to
    autograd (or it was handed twice): the sum would no longer be megatron's."""


class RngStates:
    """The generator states megatron's activation checkpoint saves (the CPU generator's,
    the CUDA generator's, the model-parallel tracker's), taken now; `restored()` runs a
    block from them and puts the states of the moment back afterwards, as megatron's
    `CheckpointFunction.backward` does, so a recomputed dropout draws the same mask and
    nothing else's stream moves. Held as one object, it is not counted as activations."""

    def __init__(self):
        from megatron.core.tensor_parallel import random as mrandom
        self.states = mrandom._get_all_rng_states()

    @contextlib.contextmanager
    def restored(self):
        from megatron.core.tensor_parallel import random as mrandom
        with mrandom._fork_rng():
            mrandom._set_all_rng_states(*self.states)
            yield


class StrandState:
    def __init__(self, lanes: Lanes, strand: str = "α", label: str = ""):
        self.lanes = lanes
        self.strand = strand
        self.label = label            # e.g. the micro-batch, for traces
        self._v: Dict[str, Any] = {}
        self._tokens: Dict[str, list] = {}
        self.pending: List[Pending] = []
        self.grads: Dict[int, torch.Tensor] = {}   # id(param) -> sum of contributions
        self.grad_seen: Dict[int, int] = {}        # id(param) -> contributions so far
        # Set by a layer node's backward (`hand_grads_to`): how many contributions each
        # parameter gets in this state, and where its sum goes once the last one is in.
        self.grad_counts: Optional[Dict[int, int]] = None
        self.grad_sink: Optional[Callable[["StrandState", torch.nn.Parameter,
                                           torch.Tensor], None]] = None
        self.meta: Dict[str, Any] = {}             # attention mask, rotary embeddings
        # Only what the forward keeps for the backward counts as activation memory, as
        # autograd's saved tensors do for megatron's layer; backward temporaries do not.
        self.counting = True
        # False while a fully recomputed layer runs its first forward: its ops build no
        # local autograd graph (megatron's checkpoint runs that forward without grad); the
        # forward run again in its backward builds them
        self.graphs = True
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

    def retain(self, *keys: str) -> None:
        """Drop every key but `keys` (a recomputed layer after its forward keeps its
        input only)."""
        for k in [k for k in self._v if k not in keys]:
            self.drop(k)

    def clear(self) -> None:
        self._v.clear()
        self._tokens.clear()

    def barrier(self) -> None:
        """Wait for every comm this strand has in flight (end of a step)."""
        for p in self.pending:
            self.lanes.resolve(p)
        self.pending.clear()

    def hand_grads_to(self, sink, counts: Dict[int, int]) -> None:
        """From now on a parameter's sum leaves `grads` for `sink(state, param, sum)` as
        soon as its `counts[id(param)]`-th contribution has arrived."""
        self.grad_sink, self.grad_counts = sink, counts

    def acc_grad(self, param: torch.nn.Parameter, g: torch.Tensor) -> None:
        """One contribution to `param`'s gradient, added in arrival order (the order of
        the op chain: megatron's sum). A parameter with an expected count is handed to
        the sink at its last contribution; one past it is an error, since the gradient
        has already left (a parameter the counts do not know stays in `grads`)."""
        k = id(param)
        n = self.grad_seen.get(k, 0) + 1
        self.grad_seen[k] = n
        want = None if self.grad_counts is None else self.grad_counts.get(k)
        if want is not None and n > want:
            raise GradHandoffError(
                f"{self.label or self.strand}: gradient contribution {n} of a parameter "
                f"{tuple(param.shape)} counted for {want} per backward; its gradient was "
                f"already handed to autograd, so this one would be added out of "
                f"megatron's order")
        total = g if k not in self.grads else self.grads.pop(k) + g
        if n == want and self.grad_sink is not None:
            self.grad_sink(self, param, total)
        else:
            self.grads[k] = total

    def held_grad_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads.values())

    def _hold(self, key, value):
        if not self.counting:
            return
        items = value if isinstance(value, (tuple, list)) else (value,)
        toks = [METER.hold(t) for t in items if isinstance(t, torch.Tensor)]
        self._tokens[key] = [t for t in toks if t is not None]
