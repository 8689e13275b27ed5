"""Tests for dhelix.train.data (CPU only, no GPU, < 30 s)."""

import collections
import multiprocessing as mp
import os
import socket
import warnings

import numpy as np
import pytest
import torch

from dhelix.train import data as D

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


def take(it, n):
    return [next(it) for _ in range(n)]


def same_batches(a, b):
    return all(
        set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def global_batches(kind, *, dp_size, mbs, num_mb, steps, **kw):
    """Reassemble the global batch of each step from all ranks' micro-batches, rows in
    (micro-batch, rank, row) order, which is increasing global sample index."""
    its = [
        D.make_batches(kind, micro_batch_size=mbs, num_microbatches=num_mb, dp_rank=r,
                       dp_size=dp_size, **kw)
        for r in range(dp_size)
    ]
    out = []
    for _ in range(steps):
        per_rank = [take(it, num_mb) for it in its]
        rows = [per_rank[r][m]["tokens"] for m in range(num_mb) for r in range(dp_size)]
        labels = [per_rank[r][m]["labels"] for m in range(num_mb) for r in range(dp_size)]
        out.append((torch.cat(rows), torch.cat(labels)))
    return out


# ---------------------------------------------------------------------- corpus
def test_corpus_vocab_and_tokenizer():
    assert D.CORPUS_VOCAB_SIZE == len(D.CORPUS_VOCAB) < 512
    assert len(set(D.CORPUS_VOCAB)) == D.CORPUS_VOCAB_SIZE
    assert D.CORPUS_VOCAB[D.PAD_ID] == "<pad>" and D.CORPUS_VOCAB[D.EOD_ID] == "<eod>"
    tok = D.CorpusTokenizer()
    assert tok.vocab_size == D.CORPUS_VOCAB_SIZE and tok.eod == D.EOD_ID and tok.pad == D.PAD_ID
    docs = D.generate_corpus(50, seed=0)
    assert len(docs) == 50
    used = set()
    for doc in docs:
        assert len(doc) > 5
        assert all(0 <= t < D.CORPUS_VOCAB_SIZE for t in doc)
        assert D.PAD_ID not in doc and D.EOD_ID not in doc
        assert tok.encode(tok.decode(doc)) == doc
        used.update(doc)
    assert len(used) > D.CORPUS_VOCAB_SIZE // 2  # the grammar exercises most words
    with pytest.raises(ValueError):
        tok.encode("the cat")


def test_corpus_deterministic():
    assert D.generate_corpus(20, seed=5) == D.generate_corpus(20, seed=5)
    assert D.generate_corpus(20, seed=5) != D.generate_corpus(20, seed=6)


def test_corpus_is_structured():
    """Agreement: a singular-only numeral is never followed by a plural noun etc. Check a
    simple invariant: every sentence ends with '.' or '?' and questions start with do."""
    tok = D.CorpusTokenizer()
    for doc in D.generate_corpus(30, seed=1):
        words = tok.decode(doc).split()
        assert words[-1] in (".", "?")
        start = 0
        for i, w in enumerate(words):
            if w == "?":
                assert words[start] in ("du", "duz", "dud")
            if w in (".", "?"):
                start = i + 1


# ---------------------------------------------------------------------- make_batches
KW = dict(seq_length=32, vocab_size=256, seed=1234)


@pytest.mark.parametrize("kind", ["synthetic", "corpus"])
def test_batches_shapes_and_label_shift(kind):
    it = D.make_batches(kind, micro_batch_size=3, num_microbatches=2, dp_rank=0, dp_size=1, **KW)
    for b in take(it, 4):
        assert set(b) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert b["tokens"].shape == (3, 32) and b["tokens"].dtype == torch.long
        assert b["labels"].dtype == torch.long and b["position_ids"].dtype == torch.long
        assert b["loss_mask"].dtype == torch.float32 and torch.all(b["loss_mask"] == 1)
        assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
        assert torch.equal(b["position_ids"], torch.arange(32).expand(3, 32))
        assert 0 <= int(b["tokens"].min()) and int(b["labels"].max()) < KW["vocab_size"]


@pytest.mark.parametrize("kind", ["synthetic", "corpus"])
def test_batches_deterministic(kind):
    mk = lambda seed: D.make_batches(kind, micro_batch_size=2, num_microbatches=2, dp_rank=1,
                                     dp_size=2, seq_length=32, vocab_size=256, seed=seed)
    a, b, c = take(mk(7), 5), take(mk(7), 5), take(mk(8), 5)
    assert same_batches(a, b)
    assert not same_batches(a, c)
    # different micro-batches carry different samples
    assert not torch.equal(a[0]["tokens"], a[1]["tokens"])


@pytest.mark.parametrize("kind", ["synthetic", "corpus"])
def test_global_batch_invariant_across_dp(kind):
    ref = global_batches(kind, dp_size=1, mbs=2, num_mb=4, steps=3, **KW)
    for dp, mbs, num_mb in [(2, 2, 2), (4, 2, 1), (2, 1, 4), (1, 8, 1)]:
        got = global_batches(kind, dp_size=dp, mbs=mbs, num_mb=num_mb, steps=3, **KW)
        for (t0, l0), (t1, l1) in zip(ref, got):
            assert torch.equal(t0, t1) and torch.equal(l0, l1), (dp, mbs, num_mb)
    # with DP=2 the two ranks see different samples
    r0 = next(D.make_batches(kind, micro_batch_size=2, num_microbatches=2, dp_rank=0,
                             dp_size=2, **KW))
    r1 = next(D.make_batches(kind, micro_batch_size=2, num_microbatches=2, dp_rank=1,
                             dp_size=2, **KW))
    assert not torch.equal(r0["tokens"], r1["tokens"])


def test_global_sample_indices_mapping():
    # b=2, dp=2: micro-batch j of rank r holds g = 4j + 2r + {0,1}
    assert D.global_sample_indices(0, 2, 0, 2).tolist() == [0, 1]
    assert D.global_sample_indices(0, 2, 1, 2).tolist() == [2, 3]
    assert D.global_sample_indices(3, 2, 1, 2).tolist() == [14, 15]


@pytest.mark.parametrize("kind", ["synthetic", "corpus"])
def test_start_step_resumes(kind):
    full = take(D.make_batches(kind, micro_batch_size=2, num_microbatches=3, dp_rank=0,
                               dp_size=1, **KW), 9)
    resumed = take(D.make_batches(kind, micro_batch_size=2, num_microbatches=3, dp_rank=0,
                                  dp_size=1, start_step=2, **KW), 3)
    assert same_batches(full[6:], resumed)


def test_corpus_batches_are_packed_stream():
    """Consecutive samples overlap by one token (windows of seq_length + 1), documents
    are separated by <eod> and all tokens are in the corpus vocab."""
    it = D.make_batches("corpus", micro_batch_size=4, num_microbatches=1, dp_rank=0,
                        dp_size=1, seq_length=16, vocab_size=D.CORPUS_VOCAB_SIZE, seed=3)
    b = next(it)
    toks, labels = b["tokens"], b["labels"]
    for i in range(3):
        assert labels[i, -1] == toks[i + 1, 0]
    stream = torch.cat([toks[:, :].reshape(-1), labels[-1, -1:]])
    assert int(stream.max()) < D.CORPUS_VOCAB_SIZE
    many = take(it, 20)
    assert any((m["tokens"] == D.EOD_ID).any() for m in many)


def test_synthetic_is_sparse_markov_chain():
    it = D.make_batches("synthetic", micro_batch_size=8, num_microbatches=1, dp_rank=0,
                        dp_size=1, seq_length=64, vocab_size=50, seed=0)
    succ = collections.defaultdict(set)
    for b in take(it, 10):
        for row_t, row_l in zip(b["tokens"].tolist(), b["labels"].tolist()):
            for a, c in zip(row_t, row_l):
                succ[a].add(c)
    assert max(len(s) for s in succ.values()) <= D.SYNTHETIC_BRANCHING
    assert len(succ) > 40  # visits most of the vocabulary


def test_argument_errors():
    base = dict(seq_length=16, micro_batch_size=1, num_microbatches=1, seed=0, dp_rank=0,
                dp_size=1)
    with pytest.raises(ValueError, match="--vocab-size"):
        D.make_batches("corpus", vocab_size=D.CORPUS_VOCAB_SIZE - 1, **base)
    with pytest.raises(ValueError, match="unknown data kind"):
        D.make_batches("wikipedia", vocab_size=512, **base)
    with pytest.raises(ValueError, match="--seq-length"):
        D.make_batches("synthetic", vocab_size=512, **{**base, "seq_length": 0})
    with pytest.raises(ValueError, match="rank"):
        D.make_batches("synthetic", vocab_size=512, **{**base, "dp_rank": 2, "dp_size": 2})


# ---------------------------------------------------------------------- indexed
@pytest.fixture(scope="module")
def corpus_prefix(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("idx") / "corpus")
    info = D.build_corpus_dataset(prefix, num_docs=60, seed=11)
    assert os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")
    assert info["num_docs"] == 60 and info["vocab_size"] == D.CORPUS_VOCAB_SIZE
    return prefix


def test_indexed_file_roundtrip(corpus_prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = D.generate_corpus(60, seed=11)
    ds = IndexedDataset(corpus_prefix)
    assert len(ds) == 60
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == doc + [D.EOD_ID]


def _decompose(sample, docs_with_eod):
    """True if ``sample`` is a contiguous window of some concatenation of documents:
    [suffix of a doc] + [whole docs]* + [prefix of a doc]."""
    pieces, cur = [], []
    for t in sample:
        cur.append(t)
        if t == D.EOD_ID:
            pieces.append(tuple(cur))
            cur = []
    whole = set(docs_with_eod)
    if pieces and cur and not any(d[: len(cur)] == tuple(cur) for d in whole):
        return False
    if not pieces:
        return any(
            tuple(cur) == d[i: i + len(cur)] for d in whole for i in range(len(d) - len(cur) + 1)
        )
    if not any(d[-len(pieces[0]):] == pieces[0] for d in whole):
        return False
    return all(p in whole for p in pieces[1:])


def test_indexed_make_batches_roundtrip(corpus_prefix):
    docs = [tuple(d + [D.EOD_ID]) for d in D.generate_corpus(60, seed=11)]
    total = sum(map(len, docs))
    S = 24
    it = D.make_batches("indexed", seq_length=S, micro_batch_size=4, num_microbatches=1,
                        vocab_size=256, seed=3, dp_rank=0, dp_size=1, data_path=corpus_prefix)
    n_samples = (total - 1) // S  # one epoch, last partial sample dropped
    n_batches = n_samples // 4
    seen = collections.Counter()
    for b in take(it, n_batches):
        assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
        assert torch.all(b["loss_mask"] == 1)
        for row_t, row_l in zip(b["tokens"].tolist(), b["labels"].tolist()):
            sample = row_t + row_l[-1:]
            assert _decompose(sample, docs)
            seen.update(row_t)
    # the samples of one epoch are distinct windows of the token stream
    want = collections.Counter(t for d in docs for t in d)
    assert all(seen[k] <= want[k] for k in seen)
    assert sum(seen.values()) == n_batches * 4 * S
    # an epoch later it wraps around: sample g + n_samples == sample g
    it2 = D.make_batches("indexed", seq_length=S, micro_batch_size=1, num_microbatches=1,
                         vocab_size=256, seed=3, dp_rank=0, dp_size=1, data_path=corpus_prefix)
    first = take(it2, n_samples + 1)
    assert torch.equal(first[0]["tokens"], first[n_samples]["tokens"])


def test_indexed_global_batch_invariant(corpus_prefix):
    kw = dict(seq_length=16, vocab_size=256, seed=9, data_path=corpus_prefix)
    ref = global_batches("indexed", dp_size=1, mbs=2, num_mb=2, steps=3, **kw)
    got = global_batches("indexed", dp_size=2, mbs=2, num_mb=1, steps=3, **kw)
    for (t0, l0), (t1, l1) in zip(ref, got):
        assert torch.equal(t0, t1) and torch.equal(l0, l1)
    again = global_batches("indexed", dp_size=1, mbs=2, num_mb=2, steps=3, **kw)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ref, again))


def test_indexed_errors(corpus_prefix, tmp_path):
    kw = dict(seq_length=16, micro_batch_size=1, num_microbatches=1, vocab_size=256, seed=0,
              dp_rank=0, dp_size=1)
    with pytest.raises(ValueError, match="--data-path"):
        D.make_batches("indexed", **kw)
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=f"--data-path {missing}: {missing}.bin not found"):
        D.make_batches("indexed", data_path=missing, **kw)
    only_bin = str(tmp_path / "onlybin")
    open(only_bin + ".bin", "wb").close()
    with pytest.raises(ValueError, match=r"onlybin\.idx not found"):
        D.make_batches("indexed", data_path=only_bin, **kw)
    # data with token ids >= vocab_size
    it = D.make_batches("indexed", data_path=corpus_prefix, **{**kw, "vocab_size": 10})
    with pytest.raises(ValueError, match="--vocab-size 10"):
        next(it)
    # too short for one sample
    tiny = str(tmp_path / "tiny")
    D.write_indexed_dataset([[5, 6]], tiny)
    with pytest.raises(ValueError, match="too few tokens"):
        D.make_batches("indexed", data_path=tiny, **kw)
    # the ".bin" suffix is tolerated
    b = next(D.make_batches("indexed", data_path=corpus_prefix + ".bin", **kw))
    assert b["tokens"].shape == (1, 16)


def _dist_worker(rank, world, port, prefix, cache_dir, q):
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = []
        for cd in (None, cache_dir):
            it = D.indexed_dataset_iterator(prefix, 16, 2, 9, rank, world, 256, 40,
                                            cache_dir=cd)
            out.append([b["tokens"].numpy().copy() for b in take(it, 3)])
        q.put((rank, out))
    finally:
        torch.distributed.destroy_process_group()


def test_indexed_with_torch_distributed_gloo(corpus_prefix, tmp_path):
    # import megatron here so the forked workers do not pay for it again
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_dist_worker,
                         args=(r, 2, port, corpus_prefix, str(tmp_path / "cache"), q))
             for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert os.listdir(tmp_path / "cache")  # rank 0 wrote megatron's index cache
    single = D.indexed_dataset_iterator(corpus_prefix, 16, 4, 9, 0, 1, 256, 40)
    for j, b in enumerate(take(single, 3)):
        for variant in range(2):
            both = np.concatenate([results[0][variant][j], results[1][variant][j]])
            assert np.array_equal(both, b["tokens"].numpy())
