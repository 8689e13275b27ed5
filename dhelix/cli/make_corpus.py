"""`dhelix make-corpus`: the generated grammar corpus as a Megatron indexed dataset."""
from __future__ import annotations


def add_parser(sub) -> None:
    c = sub.add_parser("make-corpus", help="write the generated grammar corpus as a "
                                           "Megatron indexed dataset")
    c.add_argument("--output", required=True, help="path prefix for .bin/.idx")
    c.add_argument("--num-docs", type=int, default=2000,
                   help="documents to generate (default: %(default)s)")
    c.add_argument("--seed", type=int, default=1234, help="random seed (default: %(default)s)")
    c.set_defaults(func=run)


def run(a) -> int:
    from dhelix.train.data import build_corpus_dataset
    build_corpus_dataset(a.output, num_docs=a.num_docs, seed=a.seed)
    print(f"dhelix make-corpus: wrote {a.output}.bin and {a.output}.idx ({a.num_docs} documents)")
    return 0
