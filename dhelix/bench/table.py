"""`dhelix published`, the command: the rows `--rows` names — the published ones
(`bench/published.py`) and megatron's best against DHelix's best (`bench/best.py`) — run
one after another (or `--simulate`d), the table written after each: table.md, table.json,
table.png (simulated.md, simulated.json). A table grows over several runs: the rows of an
earlier table.json in the output directory that a run does not redo are kept."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import asdict
from typing import List

from dhelix.bench import best
from dhelix.bench.published import (ROWS, TableError, TableOptions, _layers, bench_options,
                                    markdown, plot, run_dp, simulated, summarize)


def select(text: str) -> list:
    """The rows `--rows` names: published rows (`Row`) and best-layout rows
    (`bench.best.BestRow`, "MODEL-best", or "best" for all of them); "" = the published."""
    if not text:
        return list(ROWS)
    keys = [k.strip() for k in text.split(",") if k.strip()]
    by = {r.key: r for r in ROWS + best.BEST}
    keys = [x for k in keys for x in ([b.key for b in best.BEST] if k == "best" else [k])]
    bad = [k for k in keys if k not in by]
    if bad:
        raise TableError(f"--rows: unknown row(s) {', '.join(bad)}; the rows are "
                         f"{', '.join(by)}, and best (every MODEL-best)")
    return [by[k] for k in dict.fromkeys(keys)]


def run_table(o: TableOptions) -> int:
    from dhelix.bench.run import run_bench
    if o.simulate:
        return simulate_table(o)
    rows = select(o.rows)
    os.makedirs(os.path.join(o.out, "rows"), exist_ok=True)
    ran, bests, skipped, rc_all = [], [], [], 0
    kept = _kept(o.out, {r.key for r in rows})
    done = _in_table_order(kept)
    for k, row in enumerate(rows):
        if isinstance(row, best.BestRow):
            r = best.run(row, o, os.path.join(o.out, "rows"))
            if r is None:
                skipped.append(f"{row.key}: a side's layout does not fit --max-ranks "
                               f"{o.max_ranks}")
            else:
                print(best.markdown([r]))
                bests.append(r)
            _write(o, done, skipped, bests)
            continue
        d = run_dp(row, o.max_ranks)
        if d is None:
            skipped.append(f"{row.key} ({row.layout()}): {row.model_ranks} ranks at DP 1, "
                           f"more than --max-ranks {o.max_ranks}")
            print(f"dhelix published: [{k + 1}/{len(rows)}] {row.key}: skipped, "
                  f"{skipped[-1]}", file=sys.stderr)
            continue
        print(f"dhelix published: [{k + 1}/{len(rows)}] {row.key}: {row.layout()} as "
              f"{row.model_ranks * d} ranks (DP {d})", file=sys.stderr)
        b = bench_options(row, o, os.path.join(o.out, "rows"))
        t0 = time.time()
        rc = run_bench(b)
        if rc not in (0, 1):
            return rc
        with open(b.out + ".json") as f:
            bench_rows = json.load(f)["rows"]
        for r in bench_rows:
            r["config_layers"] = o.num_layers or _layers(row)
        ran.append(summarize(row, o, bench_rows, rc, time.time() - t0))
        rc_all = rc_all or rc
        done = _in_table_order(kept + ran)
        _write(o, done, skipped, bests)   # after every row: a stopped table keeps its rows
    print(markdown(done, skipped))
    print(f"dhelix published: wrote {o.out}/table.md, table.json, table.png")
    return rc_all


def simulate_table(o: TableOptions) -> int:
    """`--simulate`: every selected row's prediction in seconds, as simulated.md/.json."""
    rows = select(o.rows)
    work = os.path.join(o.out, "rows")
    os.makedirs(work, exist_ok=True)
    out, skipped, bests = [], [], []
    for row in rows:
        if isinstance(row, best.BestRow):
            bests.append(best.simulate(row, o, work))
            print(f"dhelix published: simulated {row.key}", file=sys.stderr)
            continue
        ro = o
        if run_dp(row, o.max_ranks) is None:      # no ranks run: as many as it takes
            skipped.append(row.key)
            ro = dataclasses.replace(o, max_ranks=row.model_ranks * row.ep)
        out.append(simulated(row, ro, work))
        print(f"dhelix published: simulated {row.key}", file=sys.stderr)
    lines = ["| row | published layout (seq) | ran as: ranks, DP | megatron (best) ms | "
             "DHelix ms | DHelix vs megatron | layers only | head ms | DP traffic exposed "
             "ms (megatron / DHelix) | with --dhelix-pair-last |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out:
        last = r.get("pair_last_speedup")
        lines.append(
            f"| {r['row']} ({r['cluster']}) | {r['published']} ({r['seq']}) | {r['ranks']}, "
            f"DP{r['run_dp']} | {r['megatron_ms']:.0f} ({r['megatron_method']}) | "
            f"{r['dhelix_ms']:.0f} | {r['speedup']:.2f}x | {r['layers_speedup']:.2f}x | "
            f"{r['head_ms']:.0f} | {r['dp_exposed_ms'][0]:.0f} / "
            f"{r['dp_exposed_ms'][1]:.0f} | {f'{last:.2f}x' if last else '—'} |")
    if skipped:
        lines.append(f"\n{', '.join(skipped)}: more ranks than --max-ranks {o.max_ranks} at "
                     f"DP 1, so `dhelix published` would not run them; simulated at DP 1")
    if bests:
        lines += ["", "Megatron's best layout against DHelix's best (`dhelix advise`), "
                  "simulated:", "", best.markdown(bests)]
    md = "\n".join(lines)
    with open(os.path.join(o.out, "simulated.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(o.out, "simulated.json"), "w") as f:
        json.dump({"options": asdict(o), "rows": out, "best": bests,
                   "beyond_max_ranks": skipped}, f, indent=1)
    print(md)
    print(f"dhelix published: wrote {o.out}/simulated.md, simulated.json")
    return 0


def _kept(out: str, rerun) -> List[dict]:
    """The rows of an earlier table in `out` that this run does not redo: a table built
    over several runs (`--rows` a few at a time) keeps them."""
    path = os.path.join(out, "table.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in json.load(f).get("rows", []) if r.get("row") not in rerun]


def _in_table_order(done: List[dict]) -> List[dict]:
    order = {r.key: i for i, r in enumerate(ROWS)}
    return sorted(done, key=lambda r: order.get(r["row"], len(order)))


def _write(o: TableOptions, done: List[dict], skipped: List[str],
           bests: List[dict]) -> None:
    with open(os.path.join(o.out, "table.md"), "w") as f:
        f.write(markdown(done, skipped) + "\n")
        if bests:
            f.write("\nMegatron's best layout against DHelix's best (`dhelix advise`):\n\n"
                    + best.markdown(bests) + "\n")
    with open(os.path.join(o.out, "table.json"), "w") as f:
        json.dump({"options": asdict(o), "rows": done, "best": bests, "not_run": skipped},
                  f, indent=1)
    if done:
        plot(done, os.path.join(o.out, "table.png"))
