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

import math
import os
import random
from collections import OrderedDict
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

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

DATA_KINDS = ("synthetic", "corpus", "indexed")
SYNTHETIC_BRANCHING = 4

# --------------------------------------------------------------------------
# The invented language
# --------------------------------------------------------------------------
# Nouns by semantic class (stems).  Plural forms are derived below.
_ANIMATE = ["blick", "dax", "wug", "fep", "toma", "zib", "kiki", "moro",
            "pell", "rask", "sully", "vorn", "yint", "gorp"]
_FOOD = ["nuba", "kresh", "tavo", "lumi", "pilk", "sorb", "quen", "melo"]
_OBJECT = ["stav", "drin", "kolt", "bram", "fisk", "hupa", "jent", "ombo",
           "trel", "vask"]
_PLACE = ["gura", "mesk", "pondo", "rilva", "shet", "tarn"]

# Verbs by frame (stems).  Forms: base (plural present / after do-support),
# 3rd person singular present, past.
_V_INTR_ANIM = ["skor", "lemp", "vish", "dand", "grub", "weft"]
_V_INTR_INAN = ["plon", "glim", "krak", "rull"]
_V_EAT = ["nom", "chov", "sipp"]             # animate -> food
_V_SOCIAL = ["jilt", "mird"]                 # animate -> animate
_V_ANY = ["zeel", "fend", "lov"]             # animate -> anything concrete
_V_HANDLE = ["brak", "tesk", "hald"]         # animate -> object / food
_V_THINK = ["moz", "sav", "kenn"]            # animate -> "sa" + clause

_ADJ_SIZE = ["grob", "mik", "talo", "fusk", "wibo"]
_ADJ_MOOD = ["plish", "drem", "sorl", "tuv"]           # animate only
_ADJ_COLOR = ["reva", "blen", "karo", "sime", "yora", "zint"]

_DET_SG = ["ka", "lo", "sil", "mon"]          # a, the, this, one
_DET_PL_PLAIN = ["lo", "sili", "mavi"]        # the, these, many
_NUMERALS = ["dua", "tri", "kwa", "pen"]      # 2..5, plural only
_PREP_PLACE = ["en"]                          # in + place
_PREP_ANY = ["kon", "dep"]                    # with, near + any NP
_PREP_SURF = ["sur"]                          # on + object/place
_REL = "ke"                                   # relative "that"
_COMP = "sa"                                  # complement "that"
_CONJ = ["e", "po"]                           # and, but
_DO = {"sg": "duz", "pl": "du", "past": "dud"}
_ADV_END = ["fasi", "lenti", "nuvo", "solo"]
_ADV_PAST = ["zuvo", "prima"]
_ADV_PRES = ["nema", "hodi"]

_SPECIALS = ["<pad>", "<eod>"]
_PUNCT = [".", ",", "?"]


def _plural(stem: str) -> str:
    return stem + ("i" if stem[-1] not in "aeiou" else "ni")


def _verb_forms(stem: str) -> Tuple[str, str, str]:
    return stem, stem + "et", stem + "ov"


def _build_vocab() -> List[str]:
    words: List[str] = list(_SPECIALS) + list(_PUNCT)
    for cls in (_ANIMATE, _FOOD, _OBJECT, _PLACE):
        for stem in cls:
            words += [stem, _plural(stem)]
    for frame in (_V_INTR_ANIM, _V_INTR_INAN, _V_EAT, _V_SOCIAL, _V_ANY,
                  _V_HANDLE, _V_THINK):
        for stem in frame:
            words += list(_verb_forms(stem))
    words += _ADJ_SIZE + _ADJ_MOOD + _ADJ_COLOR
    words += _DET_SG + _DET_PL_PLAIN + _NUMERALS
    words += _PREP_PLACE + _PREP_ANY + _PREP_SURF
    words += [_REL, _COMP] + _CONJ + list(_DO.values())
    words += _ADV_END + _ADV_PAST + _ADV_PRES
    vocab: List[str] = []
    seen = set()
    for w in words:          # "lo" is both a singular and plural determiner
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    return vocab


CORPUS_VOCAB: Tuple[str, ...] = tuple(_build_vocab())
CORPUS_VOCAB_SIZE: int = len(CORPUS_VOCAB)
_WORD_ID: Dict[str, int] = {w: i for i, w in enumerate(CORPUS_VOCAB)}
PAD_ID: int = _WORD_ID["<pad>"]
EOD_ID: int = _WORD_ID["<eod>"]
assert CORPUS_VOCAB_SIZE < 512


class CorpusTokenizer:
    """Deterministic word-level tokenizer for the invented corpus.

    Text is whitespace-separated words and punctuation; ``<eod>`` decodes to a
    newline.  Also usable as the (minimal) tokenizer megatron-core's
    ``GPTDataset`` needs: it has ``vocab_size``, ``eod``, ``pad`` and
    ``unique_identifiers``.
    """

    def __init__(self) -> None:
        self.vocab = CORPUS_VOCAB
        self.vocab_size = CORPUS_VOCAB_SIZE
        self.eod = EOD_ID
        self.pad = PAD_ID
        self.unique_identifiers = OrderedDict(
            [("class", "dhelix.CorpusTokenizer"), ("vocab_size", CORPUS_VOCAB_SIZE)]
        )

    def encode(self, text: str) -> List[int]:
        ids = []
        for word in text.split():
            if word not in _WORD_ID:
                raise ValueError(f"word {word!r} is not in the corpus vocabulary")
            ids.append(_WORD_ID[word])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == EOD_ID:
                out.append("\n")
            elif 0 <= i < CORPUS_VOCAB_SIZE:
                out.append(CORPUS_VOCAB[i])
            else:
                out.append(f"<unk:{i}>")
        return " ".join(out).replace(" \n ", "\n").replace(" \n", "\n")

    tokenize = encode
    detokenize = decode


class _Grammar:
    """The PCFG.  All choices come from one ``random.Random``; words are
    emitted directly as token ids."""

    MAX_DEPTH = 2

    def __init__(self, rng: random.Random) -> None:
        self.r = rng
        self.topic: List[str] = []
        self.out: List[int] = []

    # -- helpers ------------------------------------------------------------
    def w(self, word: str) -> None:
        self.out.append(_WORD_ID[word])

    def pick(self, seq):
        return seq[int(self.r.random() * len(seq))]

    def p(self, prob: float) -> bool:
        return self.r.random() < prob

    # -- phrases ------------------------------------------------------------
    def noun_stem(self, cls: str) -> str:
        if cls == "animate":
            if self.topic and self.p(0.55):
                return self.pick(self.topic)
            return self.pick(_ANIMATE)
        return self.pick({"food": _FOOD, "object": _OBJECT, "place": _PLACE}[cls])

    def np(self, number: str, cls: str, depth: int, allow_post: bool = True) -> None:
        stem = self.noun_stem(cls)
        if number == "sg":
            u = self.r.random()
            det = "lo" if (cls == "animate" and stem in self.topic and u < 0.7) else (
                "ka" if u < 0.4 else "lo" if u < 0.75 else "sil" if u < 0.9 else "mon")
        else:
            u = self.r.random()
            det = ("lo" if u < 0.4 else "sili" if u < 0.55 else "mavi" if u < 0.7
                   else self.pick(_NUMERALS))
        self.w(det)
        if self.p(0.22):
            self.w(self.pick(_ADJ_SIZE))
        if cls == "animate" and self.p(0.18):
            self.w(self.pick(_ADJ_MOOD))
        if cls != "place" and self.p(0.22):
            self.w(self.pick(_ADJ_COLOR))
        self.w(stem if number == "sg" else _plural(stem))
        if allow_post and depth < self.MAX_DEPTH:
            u = self.r.random()
            if u < 0.12:
                self.pp(depth + 1)
            elif u < 0.22 and cls != "place":
                # subject relative clause agreeing with the head noun
                self.w(_REL)
                self.vp(number, self.tense(), cls, depth + 1)

    def pp(self, depth: int) -> None:
        u = self.r.random()
        if u < 0.35:
            self.w(_PREP_PLACE[0])
            self.np(self.number(), "place", depth)
        elif u < 0.55:
            self.w(_PREP_SURF[0])
            self.np(self.number(), self.pick(["object", "place"]), depth)
        else:
            self.w(self.pick(_PREP_ANY))
            self.np(self.number(), self.pick(["animate", "animate", "object", "food"]), depth)

    def number(self) -> str:
        return "sg" if self.p(0.6) else "pl"

    def tense(self) -> str:
        return "past" if self.p(0.5) else "pres"

    def verb(self, stem: str, number: str, tense: str) -> None:
        base, sg3, past = _verb_forms(stem)
        if tense == "base":
            self.w(base)
        elif tense == "past":
            self.w(past)
        else:
            self.w(sg3 if number == "sg" else base)

    def vp(self, number: str, tense: str, subj_cls: str, depth: int) -> None:
        if subj_cls != "animate":
            self.verb(self.pick(_V_INTR_INAN), number, tense)
            if self.p(0.25):
                self.w(self.pick(_ADV_END))
            return
        u = self.r.random()
        if u < 0.22:
            self.verb(self.pick(_V_INTR_ANIM), number, tense)
            if depth < self.MAX_DEPTH and self.p(0.3):
                self.pp(depth + 1)
        elif u < 0.40:
            self.verb(self.pick(_V_EAT), number, tense)
            self.np(self.number(), "food", depth)
        elif u < 0.54:
            self.verb(self.pick(_V_SOCIAL), number, tense)
            self.np(self.number(), "animate", depth)
        elif u < 0.72:
            self.verb(self.pick(_V_ANY), number, tense)
            self.np(self.number(), self.pick(["animate", "food", "object", "object"]), depth)
        elif u < 0.88 or depth >= self.MAX_DEPTH:
            self.verb(self.pick(_V_HANDLE), number, tense)
            self.np(self.number(), self.pick(["object", "object", "food"]), depth)
        else:
            self.verb(self.pick(_V_THINK), number, tense)
            self.w(_COMP)
            self.clause(depth + 1)
            return
        if self.p(0.15):
            self.w(self.pick(_ADV_END))

    def subject_class(self) -> str:
        u = self.r.random()
        return "animate" if u < 0.75 else "food" if u < 0.85 else "object"

    def clause(self, depth: int, tense: Optional[str] = None) -> None:
        number, cls = self.number(), self.subject_class()
        self.np(number, cls, depth)
        self.vp(number, tense or self.tense(), cls, depth)

    def sentence(self) -> None:
        tense = self.tense()
        u = self.r.random()
        if u < 0.12:
            # question with do-support: duz/du/dud NP VP(base) ?
            number, cls = self.number(), "animate"
            self.w(_DO["past"] if tense == "past" else _DO[number])
            self.np(number, cls, 1, allow_post=False)
            self.vp(number, "base", cls, 1)
            self.w("?")
            return
        if self.p(0.2):
            self.w(self.pick(_ADV_PAST if tense == "past" else _ADV_PRES))
            self.w(",")
        self.clause(0, tense)
        if u > 0.82:
            self.w(",")
            self.w(self.pick(_CONJ))
            self.clause(1, tense)
        self.w(".")

    def document(self) -> List[int]:
        self.out = []
        self.topic = self.r.sample(_ANIMATE, 2)
        for _ in range(self.r.randint(3, 10)):
            self.sentence()
        return self.out


def _generate_docs(rng: random.Random, num_docs: int) -> List[List[int]]:
    g = _Grammar(rng)
    return [g.document() for _ in range(num_docs)]


def generate_corpus(num_docs: int, seed: int) -> List[List[int]]:
    """``num_docs`` documents of the invented language, as token-id lists
    (without a trailing ``<eod>``).  Deterministic in ``seed``."""
    if num_docs < 0:
        raise ValueError(f"num_docs must be >= 0, got {num_docs}")
    return _generate_docs(random.Random(f"dhelix-corpus:{int(seed)}"), num_docs)


# --------------------------------------------------------------------------
# Megatron indexed datasets
# --------------------------------------------------------------------------
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
    (for resuming).  See the module docstring for the kinds and for the
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
