"""Training data for dhelix: synthetic tokens, a self-generated grammar corpus,
and Megatron indexed (``.bin``/``.idx``) datasets.

Everything the trainer needs goes through :func:`make_batches`, which yields
micro-batches forever as dicts::

    {"tokens":       LongTensor [b, s],
     "labels":       LongTensor [b, s],   # tokens shifted left by one
     "loss_mask":    FloatTensor[b, s],   # 1.0 everywhere (no padding is produced)
     "position_ids": LongTensor [b, s]}   # 0 .. s-1 on every row

Every kind of data is defined as a deterministic function ``sample(g)`` of a
*global sample index* ``g = 0, 1, 2, ...`` (and of the seed).  A sample is
``seq_length + 1`` consecutive tokens ``x``; ``tokens = x[:-1]`` and
``labels = x[1:]``, exactly as Megatron's GPTDataset does with
``add_extra_token_to_sequence``.

Sample -> rank mapping
----------------------
Let ``b = micro_batch_size``, ``d = dp_size``, ``r = dp_rank`` and
``M = num_microbatches``; the global batch of one optimizer step is
``G = b * M * d`` samples.  Micro-batches are numbered per rank
``j = step * M + m`` (``m`` = micro-batch within the step).  Micro-batch ``j``
of rank ``r`` holds, in row order, the global samples::

    g = j * (b * d) + r * b + i        for i = 0 .. b-1

i.e. the samples are consumed in consecutive chunks of ``b * d`` (one chunk
per micro-batch slot, all ranks together) and each rank takes the contiguous
block ``[r*b, (r+1)*b)`` of every chunk.  This is the order of Megatron-LM's
``MegatronPretrainingSampler``.  Consequently step ``s`` covers exactly the
samples ``[s*G, (s+1)*G)``: the *global batch* depends only on ``G`` and not on
how it is split into ``d`` ranks x ``M`` micro-batches x ``b`` rows, so DP=1 with
M=4 and DP=2 with M=2 (same ``b``) train on the same samples per step.
Concatenating the rows of all micro-batches of a step in the order
(micro-batch m, rank r, row i) gives the samples in increasing ``g``.
:func:`global_sample_indices` computes the mapping.

Kinds
-----
``"synthetic"``
    A seeded sparse Markov chain over ``[0, vocab_size)``: each token has
    ``SYNTHETIC_BRANCHING`` (=4) successors chosen once from the seed; sample
    ``g`` starts at a hashed random token and each next token is a hashed
    uniform choice among the successors of the current one.  The process is
    learnable (loss falls from ``ln(vocab_size)`` towards ``ln 4 ~= 1.386``)
    and every sample is a pure function of ``(seed, g)``.
``"corpus"``
    The invented-language PCFG corpus of this module (no third-party text),
    generated in-process from the seed.  Documents are joined into one token
    stream, each followed by ``<eod>``.  The stream is produced in chunks of
    ``K = max(16, ceil(32768 / seq_length))`` samples: chunk ``c = g // K`` is
    generated from ``(seed, c)`` and sample ``g`` is the window
    ``stream_c[w*S : w*S + S + 1]`` with ``w = g % K`` and ``S = seq_length``
    (windows overlap by the one extra token, as in Megatron).  The supply is
    endless and never repeats a chunk.
``"indexed"``
    A Megatron indexed dataset prefix (``PREFIX.bin`` / ``PREFIX.idx`` as written by
    Megatron-LM's ``tools/preprocess_data.py`` or :func:`write_indexed_dataset`),
    read through megatron-core's ``GPTDataset`` built by
    ``BlendedMegatronDatasetBuilder`` (split "100,0,0", no position/attention
    resets, no EOD loss masking).  Sample ``g`` is ``dataset[g % len(dataset)]``
    (the dataset is built for ``num_samples`` samples if given, else for one
    epoch; past its end it wraps around).  When torch.distributed is
    initialized the builder issues collective ``barrier()`` calls, so every
    rank of the default process group must build it (call ``make_batches``)
    at the same point.

Corpus
------
:data:`CORPUS_VOCAB` lists the word-level vocabulary (``<pad>`` = 0,
``<eod>`` = 1, punctuation, then the invented words); :data:`CORPUS_VOCAB_SIZE`
is its size (< 512).  The grammar has agreement between subject and verb and
between determiner/numeral and noun, selectional restrictions (who can eat
what, inanimate subjects only take a few verbs), adjective order, tense
agreement with time adverbs, questions with do-support, coordination,
prepositional phrases, nested relative and complement clauses, and per-document
"protagonists" that recur across sentences.
"""

from __future__ import annotations

from dhelix.train.data.batches import DATA_KINDS, SYNTHETIC_BRANCHING, make_batches
from dhelix.train.data.corpus import (
    CORPUS_VOCAB,
    CORPUS_VOCAB_SIZE,
    EOD_ID,
    PAD_ID,
    CorpusTokenizer,
    generate_corpus,
)
from dhelix.train.data.indexed import (
    build_corpus_dataset,
    indexed_dataset_iterator,
    write_indexed_dataset,
)
from dhelix.train.data.sampling import global_sample_indices

__all__ = [
    "DATA_KINDS",
    "CORPUS_VOCAB",
    "CORPUS_VOCAB_SIZE",
    "PAD_ID",
    "EOD_ID",
    "SYNTHETIC_BRANCHING",
    "CorpusTokenizer",
    "generate_corpus",
    "write_indexed_dataset",
    "build_corpus_dataset",
    "indexed_dataset_iterator",
    "global_sample_indices",
    "make_batches",
]
