"""The trainer's entry point :func:`make_batches` and the in-process sample
sources it dispatches to: the seeded sparse Markov chain of ``"synthetic"``
data, the chunked endless grammar stream of ``"corpus"`` data, and (via
:mod:`dhelix.train.data.indexed`) Megatron indexed datasets; every source
maps global sample indices to ranks with :func:`global_sample_indices`."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from typing import Dict, Iterator, List, Optional, Sequence, Union

import numpy as np
import torch

from dhelix.train.data.corpus import CORPUS_VOCAB_SIZE, EOD_ID, _Grammar
from dhelix.train.data.indexed import indexed_dataset_iterator
from dhelix.train.data.sampling import _as_batch, _check_common, global_sample_indices

DATA_KINDS = ("synthetic", "corpus", "indexed")
SYNTHETIC_BRANCHING = 4


# --------------------------------------------------------------------------
# Synthetic and corpus sample sources
# --------------------------------------------------------------------------
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


class _SyntheticSource:
    def __init__(self, seed: int, seq_length: int, vocab_size: int) -> None:
        self.s, self.v = seq_length, vocab_size
        rng = np.random.default_rng([0x5EED, int(seed) & 0xFFFFFFFF, int(seed) >> 32])
        self.succ = rng.integers(0, vocab_size, size=(vocab_size, SYNTHETIC_BRANCHING))
        self.key = np.uint64(rng.integers(0, 2**63))

    def samples(self, g: np.ndarray) -> np.ndarray:
        b, L = len(g), self.s + 1
        with np.errstate(over="ignore"):
            base = _mix64(g.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + self.key)
            pos = np.arange(L, dtype=np.uint64)
            h = _mix64(base[:, None] + pos[None, :] * np.uint64(0xD1B54A32D192ED2D))
        out = np.empty((b, L), dtype=np.int64)
        out[:, 0] = (h[:, 0] % np.uint64(self.v)).astype(np.int64)
        choice = (h >> np.uint64(32)) % np.uint64(SYNTHETIC_BRANCHING)
        choice = choice.astype(np.int64)
        for i in range(1, L):
            out[:, i] = self.succ[out[:, i - 1], choice[:, i]]
        return out


class _CorpusSource:
    def __init__(self, seed: int, seq_length: int) -> None:
        self.seed, self.s = int(seed), seq_length
        self.k = max(16, math.ceil(32768 / seq_length))
        self.cache: "OrderedDict[int, np.ndarray]" = OrderedDict()

    def chunk(self, c: int) -> np.ndarray:
        if c in self.cache:
            self.cache.move_to_end(c)
            return self.cache[c]
        need = self.k * self.s + 1
        grammar = _Grammar(random.Random(f"dhelix-corpus-chunk:{self.seed}:{c}"))
        stream: List[int] = []
        while len(stream) < need:
            stream.extend(grammar.document())
            stream.append(EOD_ID)
        arr = np.asarray(stream[:need], dtype=np.int64)
        self.cache[c] = arr
        while len(self.cache) > 2:
            self.cache.popitem(last=False)
        return arr

    def samples(self, g: np.ndarray) -> np.ndarray:
        rows = []
        for gi in g.tolist():
            c, w = divmod(gi, self.k)
            rows.append(self.chunk(c)[w * self.s: w * self.s + self.s + 1])
        return np.stack(rows)


def _source_gen(source, what, b, dp_rank, dp_size, vocab_size, j):
    while True:
        x = source.samples(global_sample_indices(j, b, dp_rank, dp_size))
        yield _as_batch(x, vocab_size, what)
        j += 1


def make_batches(
    kind: str,
    *,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: int,
    vocab_size: int,
    seed: int,
    dp_rank: int,
    dp_size: int,
    data_path: Union[str, Sequence[str], None] = None,
    num_samples: Optional[int] = None,
    start_step: int = 0,
) -> Iterator[Dict[str, torch.Tensor]]:
    """The trainer's data: an endless iterator of this rank's micro-batches,
    ``num_microbatches`` per optimizer step, starting at step ``start_step``
    (for resuming).  See the :mod:`dhelix.train.data` package docstring for the kinds and for the
    sample -> (step, micro-batch, rank, row) mapping.  ``num_samples`` only
    applies to ``"indexed"`` (how many samples to build GPTDataset for;
    e.g. train_iters * global_batch).  Validates its arguments eagerly and
    raises ``ValueError`` naming the offending flag."""
    if kind not in DATA_KINDS:
        raise ValueError(f"--data {kind!r}: unknown data kind, expected one of "
                         f"{', '.join(DATA_KINDS)}")
    _check_common(seq_length, micro_batch_size, dp_rank, dp_size, vocab_size,
                  num_microbatches)
    if int(start_step) < 0:
        raise ValueError(f"start_step must be >= 0, got {start_step}")
    j0 = int(start_step) * int(num_microbatches)
    seq_length, b = int(seq_length), int(micro_batch_size)
    dp_rank, dp_size, vocab_size = int(dp_rank), int(dp_size), int(vocab_size)
    if kind == "synthetic":
        src = _SyntheticSource(seed, seq_length, vocab_size)
        return _source_gen(src, "synthetic", b, dp_rank, dp_size, vocab_size, j0)
    if kind == "corpus":
        if vocab_size < CORPUS_VOCAB_SIZE:
            raise ValueError(
                f"--vocab-size {vocab_size} is smaller than the corpus vocabulary "
                f"({CORPUS_VOCAB_SIZE} tokens); use --vocab-size >= {CORPUS_VOCAB_SIZE}")
        src = _CorpusSource(seed, seq_length)
        return _source_gen(src, "corpus", b, dp_rank, dp_size, vocab_size, j0)
    return indexed_dataset_iterator(
        data_path, seq_length, b, seed, dp_rank, dp_size, vocab_size, num_samples,
        start_microbatch=j0)
