"""The invented-language corpus: the word-level vocabulary
(:data:`CORPUS_VOCAB`, ``<pad>`` = 0, ``<eod>`` = 1), the deterministic
:class:`CorpusTokenizer`, the PCFG that emits documents of the language
directly as token ids (agreement, selectional restrictions, clauses and
per-document protagonists), and :func:`generate_corpus`, which produces
seeded documents from it.  No third-party text and no torch are involved."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

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
