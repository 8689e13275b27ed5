"""Megatron indexed datasets: writing ``PREFIX.bin`` / ``PREFIX.idx`` with
megatron-core's ``IndexedDatasetBuilder`` (:func:`write_indexed_dataset`,
:func:`build_corpus_dataset` for ``dhelix make-corpus``) and reading them as
endless micro-batches through megatron-core's ``GPTDataset`` built by
``BlendedMegatronDatasetBuilder`` (:func:`indexed_dataset_iterator`), with the
Megatron-style ``--data-path`` prefix/blend resolution.  megatron-core is
imported lazily, only when these functions are called."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Dict, Iterator, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from dhelix.train.data.corpus import CORPUS_VOCAB_SIZE, EOD_ID, generate_corpus
from dhelix.train.data.sampling import _as_batch, _check_common, global_sample_indices


def write_indexed_dataset(
    docs: Sequence[Sequence[int]],
    prefix: str,
    *,
    append_eod: bool = True,
    eod_id: int = EOD_ID,
    vocab_size: Optional[int] = CORPUS_VOCAB_SIZE,
) -> Tuple[str, str]:
    """Write ``docs`` as ``prefix.bin`` / ``prefix.idx`` with megatron-core's
    ``IndexedDatasetBuilder``, the way Megatron-LM's ``tools/preprocess_data.py``
    does without ``--split-sentences``: one sequence per document, ``<eod>``
    appended when ``append_eod`` (``--append-eod``), token dtype
    ``DType.optimal_dtype(vocab_size)`` (uint16 for small vocabularies).
    Returns the two paths."""
    from megatron.core.datasets.indexed_dataset import (
        DType, IndexedDatasetBuilder, get_bin_path, get_idx_path)

    prefix = os.fspath(prefix)
    parent = os.path.dirname(os.path.abspath(prefix))
    os.makedirs(parent, exist_ok=True)
    dtype = DType.optimal_dtype(vocab_size)
    bin_path, idx_path = get_bin_path(prefix), get_idx_path(prefix)
    builder = IndexedDatasetBuilder(bin_path, dtype=dtype)
    limit = np.iinfo(dtype).max
    for n, doc in enumerate(docs):
        arr = np.asarray(list(doc) + ([eod_id] if append_eod else []), dtype=np.int64)
        if arr.size == 0:
            continue  # Megatron's preprocessing skips empty documents too
        if arr.min() < 0 or arr.max() > limit:
            builder.data_file.close()
            raise ValueError(f"document {n} has token ids outside [0, {limit}]")
        builder.add_document(arr, [int(arr.size)])
    builder.finalize(idx_path)
    return bin_path, idx_path


def build_corpus_dataset(prefix: str, num_docs: int, seed: int) -> Dict[str, object]:
    """Generate ``num_docs`` corpus documents from ``seed`` and write them as
    the indexed dataset ``prefix.bin/.idx`` (``dhelix make-corpus``).
    Returns ``{"prefix", "bin", "idx", "num_docs", "num_tokens", "vocab_size"}``."""
    if num_docs <= 0:
        raise ValueError(f"--num-docs must be positive, got {num_docs}")
    docs = generate_corpus(num_docs, seed)
    bin_path, idx_path = write_indexed_dataset(docs, prefix)
    return {
        "prefix": os.fspath(prefix),
        "bin": bin_path,
        "idx": idx_path,
        "num_docs": len(docs),
        "num_tokens": sum(len(d) + 1 for d in docs),
        "vocab_size": CORPUS_VOCAB_SIZE,
    }


class _GPTDatasetTokenizer:
    """The minimal tokenizer object GPTDataset uses: ``vocab_size`` (token dtype
    code), ``eod`` (only for EOD resets/masking, all disabled here), ``pad``
    (labels equal to it get loss 0) and ``unique_identifiers`` (cache hash).
    ``pad`` is -1 so that no real token of user data is ever masked."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size = int(vocab_size)
        self.eod = int(eod)
        self.pad = -1
        self.unique_identifiers = OrderedDict(
            [("class", "dhelix.GPTDatasetTokenizer"), ("vocab_size", self.vocab_size),
             ("eod", self.eod)]
        )


def _resolve_prefixes(data_path: Union[str, Sequence[str], None]):
    """Megatron-style ``--data-path``: a prefix, or a list of prefixes, or
    ``[w1, p1, w2, p2, ...]``.  Returns ``(prefixes, weights or None)``."""
    if data_path is None or (not isinstance(data_path, (str, os.PathLike)) and len(data_path) == 0):
        raise ValueError("--data-path PREFIX is required for --data indexed "
                         "(a Megatron .bin/.idx prefix, e.g. from `dhelix make-corpus`)")
    if isinstance(data_path, (str, os.PathLike)):
        items = os.fspath(data_path).split()
    else:
        items = [os.fspath(x) for x in data_path]
    from megatron.core.datasets.utils import get_blend_from_list

    prefixes, weights = get_blend_from_list(items)
    fixed = []
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if prefix.endswith(ext) and os.path.isfile(prefix[: -len(ext)] + ".bin"):
                prefix = prefix[: -len(ext)]
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise ValueError(f"--data-path {prefix}: {prefix}{ext} not found")
        fixed.append(prefix)
    return fixed, weights


def indexed_dataset_iterator(
    data_path: Union[str, Sequence[str]],
    seq_length: int,
    micro_batch_size: int,
    seed: int,
    dp_rank: int,
    dp_size: int,
    vocab_size: int,
    num_samples: Optional[int] = None,
    *,
    start_microbatch: int = 0,
    cache_dir: Optional[str] = None,
    eod_id: int = EOD_ID,
) -> Iterator[Dict[str, torch.Tensor]]:
    """Micro-batches (forever) of a Megatron indexed dataset through
    megatron-core's ``GPTDataset``, built eagerly here (collectively when
    torch.distributed is initialized).  Rank ``dp_rank`` gets samples
    :func:`global_sample_indices` of micro-batch ``start_microbatch``,
    ``start_microbatch + 1``, ...; sample ``g`` is ``dataset[g % len(dataset)]``.

    ``num_samples``: the number of samples to build the dataset for (more than
    one epoch re-shuffles per epoch, as Megatron does); None builds one epoch.
    ``cache_dir``: megatron's index cache; None keeps the indices in memory
    (every rank builds the same seeded indices itself, nothing is written).
    ``eod_id`` only matters for EOD resets, which are disabled.
    """
    _check_common(seq_length, micro_batch_size, dp_rank, dp_size, vocab_size)
    prefixes, weights = _resolve_prefixes(data_path)
    if weights is not None and num_samples is None:
        raise ValueError("a weighted --data-path blend needs a number of training samples "
                         "(num_samples)")

    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=int(seed),
        sequence_length=int(seq_length),
        blend=(prefixes, weights),
        split="100,0,0",
        # "" (not None): megatron would otherwise default to writing a cache
        # next to the data; "" builds the seeded indices in memory on each rank.
        path_to_cache=cache_dir if cache_dir is not None else "",
        tokenizer=_GPTDatasetTokenizer(vocab_size, eod_id),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=True,
    )
    sizes = [None if num_samples is None else int(num_samples), None, None]
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)
    train_ds = builder.build()[0]
    if train_ds is None or len(train_ds) == 0:
        raise ValueError(
            f"--data-path {' '.join(prefixes)}: too few tokens for a single sample of "
            f"--seq-length {seq_length} (needs seq_length + 1 tokens)")
    return _indexed_gen(train_ds, seq_length, micro_batch_size, dp_rank, dp_size,
                        vocab_size, start_microbatch)


def _indexed_gen(ds, seq_length, b, dp_rank, dp_size, vocab_size, j):
    n = len(ds)
    while True:
        rows = []
        for g in global_sample_indices(j, b, dp_rank, dp_size):
            item = ds[int(g % n)]
            # GPTDataset split text into tokens/labels; undo to one array [s+1].
            rows.append(torch.cat([item["tokens"], item["labels"][-1:]]).numpy())
        yield _as_batch(np.stack(rows), vocab_size, "--data-path")
        j += 1
