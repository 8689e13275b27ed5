"""`dhelix published` rows `MODEL-best`: megatron at its best layout against DHelix at its
best, as `dhelix advise` picks them for the published cluster (the published rows compare
at one TP-heavy layout; a user choosing a layout gets this number instead).

A best row asks `dhelix advise` (64 GPUs of the row's cluster, its sequence and global
batch, no recomputation) for megatron's best and DHelix's best layout, then runs (or, with
`--simulate`, predicts) each side at its own layout, as `dhelix published` runs a row: the
small model at full depth, DP cut to `--max-ranks` with the DP traffic priced at the
layout's DP, the distributed optimizer on both sides. Both sides train the same global
batch, so their steps compare directly.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

from dhelix.bench.published import Row, TableOptions, bench_options, run_dp

# advise's schedule -> the bench's method
METHODS = {"megatron": "megatron", "1f1b": "megatron-1f1b",
           "interleaved": "megatron-interleaved", "dhelix": "dhelix-plan",
           "fold": "dhelix-fold", "pair-last": "dhelix-last"}


@dataclass(frozen=True)
class BestRow:
    key: str                 # --rows names it: MODEL-best
    model: str
    cluster: str = "a40"
    seq: int = 4096
    global_batch: int = 512  # the issue's `dhelix advise ... --global-batch-size 512`
    gpus: int = 64


BEST: List[BestRow] = [BestRow(f"{m}-best", m) for m in ("llama-8b", "gpt-18b", "llama-39b")]


def advised(row: BestRow, work: str) -> Dict[str, dict]:
    """{"megatron": layout, "dhelix": layout} as `dhelix advise` picks them (its JSON kept
    in `work`, reused while the row's options are unchanged)."""
    from dhelix.advise.run import AdviseOptions, run_advise
    prefix = os.path.join(work, f"advise-{row.key}-{row.global_batch}")
    if not os.path.exists(prefix + ".json"):
        rc = run_advise(AdviseOptions(config=row.model, cluster=row.cluster, gpus=row.gpus,
                                      seq_length=row.seq, global_batch_size=row.global_batch,
                                      recompute="off", top=3, out=prefix))
        if rc != 0:
            raise RuntimeError(f"{row.key}: dhelix advise found no layout (rc {rc})")
    with open(prefix + ".json") as f:
        best = json.load(f)["best"]
    if not best.get("megatron") or not best.get("dhelix"):
        raise RuntimeError(f"{row.key}: dhelix advise has no best layout for both sides")
    return {who: best[who]["layout"] for who in ("megatron", "dhelix")}


def side(row: BestRow, lo: dict, o: TableOptions, work: str, who: str,
         anywhere: bool = False):
    """The bench options that run one side at its layout, or None where it does not fit
    `--max-ranks` even at DP 1 (`anywhere`: at DP 1 on as many ranks as it takes, for the
    simulator, which runs no ranks)."""
    r = Row(f"{row.key}-{who}", row.model, row.cluster, row.seq, lo["dp"], lo["tp"],
            lo["cp"], lo["pp"], lo["ep"], group="best")
    if run_dp(r, o.max_ranks) is None:
        if not anywhere:
            return None
        o = dataclasses.replace(o, max_ranks=r.model_ranks * lo["ep"])
    b = bench_options(r, dataclasses.replace(o, microbatches=lo["microbatches"]), work)
    return dataclasses.replace(
        b, methods=METHODS[lo["schedule"]],
        emulate=f"{row.model},seq={row.seq},mbs={lo['mbs']},dp={lo['dp']}",
        out=os.path.join(work, f"{row.key}-{who}"))


def _name(lo: dict) -> str:
    parts = [f"TP{lo['tp']}", f"CP{lo['cp']}", f"PP{lo['pp']}", f"DP{lo['dp']}"] + \
        ([f"EP{lo['ep']}"] if lo["ep"] > 1 else [])
    return " ".join(parts) + f" mbs{lo['mbs']}×{lo['microbatches']} {lo['schedule']}"


def simulate(row: BestRow, o: TableOptions, work: str) -> dict:
    """Both sides predicted at their layouts (`bench.emulated.predictions`)."""
    from dhelix.bench.emulated import predictions
    from dhelix.train.emulate import parse
    los = advised(row, work)
    out = {"row": row.key, "cluster": row.cluster, "seq": row.seq,
           "global_batch": row.global_batch}
    for who, lo in los.items():
        b = side(row, lo, o, work, who, anywhere=True)
        out[f"{who}_layout"] = _name(lo)
        p = predictions(b, b.configs, parse(b.compute, b.emulate))[b.methods]
        out[f"{who}_ms"] = p["step_s"] * 1e3
    out["speedup"] = out["megatron_ms"] / out["dhelix_ms"]
    return out


def run(row: BestRow, o: TableOptions, work: str) -> Optional[dict]:
    """Both sides run at their layouts; None where a side does not fit `--max-ranks`."""
    from dhelix.bench.run import run_bench
    los = advised(row, work)
    sides = {who: side(row, lo, o, work, who) for who, lo in los.items()}
    if any(b is None for b in sides.values()):
        return None
    res, rc_all = {}, 0
    for who, b in sides.items():
        print(f"dhelix published: {row.key}: {who} at {_name(los[who])} on {b.nproc} "
              f"ranks", file=sys.stderr)
        rc = run_bench(b)
        if rc not in (0, 1):
            raise RuntimeError(f"{row.key}: the {who} run failed (rc {rc})")
        rc_all = rc_all or rc
        with open(b.out + ".json") as f:
            res[who] = json.load(f)["rows"][0]
    meg, dh = res["megatron"], res["dhelix"]
    return {"row": row.key, "cluster": row.cluster, "seq": row.seq,
            "global_batch": row.global_batch,
            "megatron_layout": _name(los["megatron"]), "dhelix_layout": _name(los["dhelix"]),
            "megatron_ms": meg["step_s"] * 1e3, "dhelix_ms": dh["step_s"] * 1e3,
            "speedup": meg["step_s"] / dh["step_s"],
            "speedup_simulated": meg["predicted_step_s"] / dh["predicted_step_s"],
            "memory_vs_megatron": dh["peak_activation_bytes"] /
            max(1, meg["peak_activation_bytes"]), "runs_ok": rc_all == 0}


def markdown(rows: List[dict]) -> str:
    lines = ["| row | global batch | megatron's best (advise) | DHelix's best (advise) | "
             "megatron ms | DHelix ms | DHelix vs megatron |", "|---|---:|---|---|---:|---:|---:|"]
    for r in rows:
        ms = lambda v: "does not fit" if v is None else f"{v:.0f}"  # noqa: E731
        sp = f"**{r['speedup']:.2f}x**" if r.get("speedup") else "-"
        if "speedup_simulated" in r:
            sp += f" (simulated {r['speedup_simulated']:.2f}x)"
        lines.append(f"| {r['row']} ({r['cluster']}, seq {r['seq']}) | {r['global_batch']} | "
                     f"{r['megatron_layout']} | {r['dhelix_layout']} | "
                     f"{ms(r['megatron_ms'])} | {ms(r['dhelix_ms'])} | {sp} |")
    return "\n".join(lines)
