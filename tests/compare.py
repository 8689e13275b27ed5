"""The one comparison of the equivalence tests: tensors, checksums, losses, whole runs.

Every check here fails on a non-finite value (NaN or inf, on either side: Python's
`max(0.0, nan)` is 0.0, so a hand-rolled `worst = max(worst, err)` drops a NaN), on a
missing or extra name, on a shape that differs, and on a difference above the tolerance.
`tol=0.0` means equal bit for bit (`torch.equal`, `==`), the claim of every test that says
"bit-identical"; elsewhere the test states its tolerance and why. Each function returns
the worst relative difference it saw (0.0 when equal) and raises `Mismatch`, naming what
differed, otherwise. Rank functions call these on every rank (a rank that raises fails
`run_ranks`); `same_runs` checks the results of every rank of two training runs.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch


class Mismatch(AssertionError):
    pass


def _finite(x) -> bool:
    if isinstance(x, torch.Tensor):
        return bool(torch.isfinite(x).all())
    return math.isfinite(x)


def rel_diff(a, b) -> float:
    """max |a − b| / max |b| (tensors) or |a − b| / |b| (numbers); inf if either side holds
    a non-finite value."""
    if not (_finite(a) and _finite(b)):
        return math.inf
    if isinstance(a, torch.Tensor):
        a, b = a.detach().double(), b.detach().double()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() \
            if a.numel() else 0.0
    return abs(a - b) / max(abs(b), 1e-30)


def _check(got, want, tol: float, what: str, scale=None) -> float:
    """One value (a tensor or a number) against the reference."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise Mismatch(f"{what}: expected a tensor, got {type(got).__name__}")
        if got.shape != want.shape:
            raise Mismatch(f"{what}: shape {tuple(got.shape)} vs the reference's "
                           f"{tuple(want.shape)}")
    if not _finite(got) or not _finite(want):
        raise Mismatch(f"{what}: non-finite value (got {_brief(got)}, reference "
                       f"{_brief(want)})")
    if scale is None:
        d = rel_diff(got, want)
    else:
        d = abs(got - want) / max(abs(scale), 1e-30)
    exact = torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
    if tol == 0.0 and not exact:
        raise Mismatch(f"{what}: not bit-identical (relative difference {d:.3e}; got "
                       f"{_brief(got)}, reference {_brief(want)})")
    if not d <= tol:
        raise Mismatch(f"{what}: relative difference {d:.3e} above {tol:g} (got "
                       f"{_brief(got)}, reference {_brief(want)})")
    return 0.0 if exact else d


def _brief(x) -> str:
    if isinstance(x, torch.Tensor):
        bad = int((~torch.isfinite(x)).sum()) if x.is_floating_point() else 0
        return (f"tensor{tuple(x.shape)} max|.| {x.detach().double().abs().max().item():.6g}"
                + (f", {bad} non-finite" if bad else "")) if x.numel() else "empty tensor"
    return repr(x)


def _same_names(got: Mapping, want: Mapping, what: str):
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        raise Mismatch(f"{what.rstrip(':')}: " + "; ".join(
            s for s in (f"missing {missing}" if missing else "",
                        f"not in the reference {extra}" if extra else "") if s))


def same_tensors(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                 tol: float = 0.0, what: str = "") -> float:
    """Name -> tensor against the reference: the same names, and every tensor."""
    _same_names(got, want, what)
    return max([_check(got[n], want[n], tol, f"{what} {n}".strip()) for n in want],
               default=0.0)


def same_numbers(got: Sequence[float], want: Sequence[float], tol: float = 0.0,
                 what: str = "") -> float:
    """A sequence of numbers (losses) against the reference, element by element."""
    if len(got) != len(want):
        raise Mismatch(f"{what}: {len(got)} values vs the reference's {len(want)}")
    return max([_check(g, w, tol, f"{what} [{i}]") for i, (g, w) in
                enumerate(zip(got, want))], default=0.0)


def same_checksums(got: Mapping[str, Sequence[float]], want: Mapping[str, Sequence[float]],
                   tol: float = 0.0, what: str = "") -> float:
    """Name -> [sum, sum of squares] (the trainer's `checksums`) against the reference.
    The sum's difference is relative to max(|sum|, √(sum of squares)): a sum near zero
    of large entries is not held to a relative bound it cannot meet."""
    _same_names(got, want, what)
    worst = 0.0
    for n in want:
        (s1, q1), (s2, q2) = got[n], want[n]
        worst = max(worst, _check(s1, s2, tol, f"{what} {n} sum",
                                  scale=max(abs(s2), math.sqrt(abs(q2))) if
                                  _finite(q2) else None),
                    _check(q1, q2, tol, f"{what} {n} sum of squares"))
    return worst


RUN_KEYS = ("losses", "grad_checksums", "weight_checksums")


def same_runs(got: Sequence[dict], want: Sequence[dict], tol: float = 0.0,
              keys: Sequence[str] = RUN_KEYS) -> float:
    """Two training runs' results (`train_result`, one per rank), every rank: the losses,
    every step's per-parameter gradient checksums, the final weights' checksums."""
    if len(got) != len(want):
        raise Mismatch(f"{len(got)} ranks vs the reference's {len(want)}")
    worst = 0.0
    for rank, (g, w) in enumerate(zip(got, want)):
        rank = w.get("label", rank)
        for key in keys:
            if key not in w or key not in g:
                raise Mismatch(f"rank {rank}: no '{key}' in the "
                               f"{'reference' if key not in w else 'result'} (checksums=True?)")
        if "losses" in keys:
            worst = max(worst, same_numbers(g["losses"], w["losses"], tol,
                                            f"rank {rank} losses"))
        if "grad_checksums" in keys:
            if len(g["grad_checksums"]) != len(w["grad_checksums"]):
                raise Mismatch(f"rank {rank}: {len(g['grad_checksums'])} steps of gradient "
                               f"checksums vs {len(w['grad_checksums'])}")
            for i, (a, b) in enumerate(zip(g["grad_checksums"], w["grad_checksums"])):
                worst = max(worst, same_checksums(a, b, tol, f"rank {rank} step {i + 1} grad"))
        if "weight_checksums" in keys:
            worst = max(worst, same_checksums(g["weight_checksums"], w["weight_checksums"],
                                              tol, f"rank {rank} final weight"))
    return worst


TIED = {"output_layer.weight": "embedding.word_embeddings.weight"}


def merge_stages(results: Sequence[dict]) -> list:
    """A pipelined run's results as one result per (TP, CP, DP) position: every stage's
    per-parameter checksums merged by global name (`build.global_names`: layer numbers of
    the unfolded model), so layouts that place layers differently (megatron's 1F1B, the
    fold) compare parameter by parameter. A tied output layer's copy (1F1B keeps one on
    the last stage) must equal the embedding it copies and is merged into it; any other
    name held twice is an error."""
    groups: dict = {}
    for rank, r in enumerate(results):
        c = r["coords"]
        groups.setdefault((c["tp"], c["cp"], c["dp"]), []).append((c["pp"], rank, r))
    tied = not results[0]["config"]["model"]["untie_embeddings_and_output_weights"]
    out = []
    for pos in sorted(groups):
        stages = sorted(groups[pos], key=lambda x: x[0])

        def merge(dicts, what):
            m = {}
            for (pp, rank, _), d in zip(stages, dicts):
                for name, v in d.items():
                    key = TIED.get(name, name) if tied else name
                    if key in m:
                        if key == name:
                            raise Mismatch(f"{what}: '{name}' held by two stages")
                        same_checksums({key: v}, {key: m[key]}, 0.0,
                                       f"{what} rank {rank} (stage {pp}) tied copy")
                        continue
                    m[key] = v
            return m
        first = stages[0][2]
        merged = {"label": "(TP {}, CP {}, DP {}: stages merged)".format(*pos),
                  "losses": first["losses"],
                  "weight_checksums": merge([s[2]["weight_checksums"] for s in stages],
                                            f"position {pos} final weight")}
        merged["grad_checksums"] = [
            merge([s[2]["grad_checksums"][i] for s in stages], f"position {pos} step {i + 1}")
            for i in range(len(first["grad_checksums"]))]
        out.append(merged)
    return out
