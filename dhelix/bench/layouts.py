"""`dhelix layouts`: the published evaluation's layout shapes, scaled down to this machine.

Each row keeps which parallel dimensions are > 1 in a published layout (TP×DP,
TP×PP×DP, TP×CP×DP, TP×CP×PP×DP, EP×DP×PP) with each of them 2, and trains the same
model from the same weights twice: megatron's schedule (1F1B with PP) and DHelix's
(`--dhelix`, the fold with PP). The table says whether the losses are equal (the largest
relative difference over the steps) and puts tokens/s side by side. With PP both runs
load one initial checkpoint (the layouts place layers differently, so they would
otherwise start from different weights).

With `--compute paced:CLUSTER[,x=F] --emulate MODEL[,seq=S,mbs=B]` (and a paced `--link`)
the ranks keep an emulated model's time (`train/emulate.py`: megatron's layers paced GEMM
by GEMM, DHelix's op by op, collectives at the emulated bytes), the small model is
`--config` (default `tiny-llama-emu`, whose GEMMs tell apart by shape; `tiny-moe-emu` and
`--emulate-moe` for the MoE row), `--data-parallel-size` widens the rows to 16 ranks and
more, and the table gives the emulated step times and tokens/s.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import List, Optional


@dataclass(frozen=True)
class LayoutRow:
    name: str                 # the dimensions > 1, e.g. "TP×CP×PP×DP"
    published: str            # the layouts of the published evaluation it scales down
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    config: str = "tiny4"

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp


ROWS = (
    LayoutRow("TP×DP", "tp8 × dp8 (64 GPUs)", tp=2, dp=2),
    LayoutRow("TP×PP×DP", "tp8 × pp2 × dp4", tp=2, pp=2, dp=2),
    LayoutRow("TP×CP×DP", "tp8 × cp2 × dp4", tp=2, cp=2, dp=2),
    LayoutRow("TP×CP×PP×DP", "dp2 tp8 cp2 pp2 (A40, A800); dp1 tp8 cp4 pp2 (A800)",
              tp=2, cp=2, pp=2, dp=2),
    LayoutRow("EP×DP×PP", "ep8 dp16 pp4 (MoE)", ep=2, dp=2, pp=2, config="tiny-moe4"),
)


@dataclass
class LayoutsOptions:
    rows: str = ",".join(r.name for r in ROWS)   # which rows, by name
    train_iters: int = 4                         # the first is not timed
    num_microbatches: int = 4
    micro_batch_size: int = 2
    seq_length: int = 64
    link: str = "none"
    compute: str = "none"                        # paced:CLUSTER[,x=F]: emulated time
    emulate: str = ""                            # the emulated shape (with compute)
    emulate_moe: str = "phi-3.5-moe"             # the MoE row's (seq, mbs: --emulate's)
    config: Optional[str] = None                 # the small model (default: the row's;
    #                                              with --compute tiny-llama-emu)
    data_parallel_size: Optional[int] = None     # instead of each row's DP (2)
    out: str = "layouts"                         # prefix for .md and .json


def _common(row: LayoutRow, o: LayoutsOptions) -> List[str]:
    paced = o.compute != "none"
    small = o.config or (row.config if not paced else
                         "tiny-moe-emu" if row.ep > 1 else "tiny-llama-emu")
    argv = ["--config", small, "--tensor-model-parallel-size", str(row.tp),
            "--seq-length", str(o.seq_length), "--micro-batch-size", str(o.micro_batch_size),
            "--data", "synthetic"]
    if row.tp > 1:
        argv += ["--sequence-parallel"]
    if row.cp > 1:
        argv += ["--context-parallel-size", str(row.cp)]
    if row.ep > 1:
        argv += ["--expert-model-parallel-size", str(row.ep),
                 "--expert-tensor-parallel-size", "1"]
    if paced:
        argv += ["--compute", o.compute, "--emulate", _emulated(row, o)]
    return argv


def _emulated(row: LayoutRow, o: LayoutsOptions) -> str:
    """The row's emulated shape: --emulate, or for the MoE row --emulate-moe with
    --emulate's seq= and mbs=."""
    if row.ep == 1:
        return o.emulate
    return ",".join([o.emulate_moe] + o.emulate.split(",")[1:])


def _train_argv(row: LayoutRow, o: LayoutsOptions, method: str, out_json: str,
                init: Optional[str]) -> List[str]:
    argv = ["train"] + _common(row, o) + [
        "--global-batch-size", str(o.micro_batch_size * row.dp * o.num_microbatches),
        "--train-iters", str(o.train_iters), "--json", out_json]
    if row.pp > 1:
        argv += ["--pipeline-model-parallel-size", str(row.pp)]
    if init:
        argv += ["--load", init]
    if method == "dhelix":
        argv += ["--dhelix"] + (["--dhelix-fold"] if row.pp > 1 else [])
    return argv


def run_layouts(o: LayoutsOptions) -> int:
    from tqdm import tqdm

    from dhelix.links import LinkError, launch, parse_link
    from dhelix.train.dist import spawn_local

    names = [n.strip() for n in o.rows.split(",") if n.strip()]
    known = {r.name: r for r in ROWS}
    bad = [n for n in names if n not in known]
    if bad:
        print(f"dhelix layouts: error: --rows {','.join(bad)}: unknown; the rows are "
              f"{', '.join(known)}", file=sys.stderr)
        return 2
    try:
        link = parse_link(o.link, "--link")
    except LinkError as e:
        print(f"dhelix layouts: error: {e}", file=sys.stderr)
        return 2
    rows = [known[n] for n in names]
    if o.data_parallel_size:
        from dataclasses import replace
        rows = [replace(r, dp=o.data_parallel_size) for r in rows]
    if o.compute != "none" and link.kind != "paced":
        print("dhelix layouts: error: --compute paces on the paced link: add --link "
              "paced:1gbit", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="dhelix-layouts-")
    log = os.path.join(work, "runs.log")
    results = []
    bar = tqdm(total=sum(2 + (r.pp > 1) for r in rows), desc="dhelix layouts", unit="run")
    try:
        with launch(link) as (prefix, env):
            for row in rows:
                init = None
                if row.pp > 1:       # one set of initial weights for both pipeline placements
                    init = os.path.join(work, f"init-{row.name}")
                    bar.set_postfix_str(f"{row.name} initial weights")
                    argv = ["train"] + _common(row, o) + ["--train-iters", "0", "--save", init]
                    _spawn(spawn_local, row.tp * row.cp * (row.ep if row.ep > 1 else 1), argv,
                           prefix, env, log)
                    bar.update(1)
                res = {}
                for method in ("megatron", "dhelix"):
                    out = os.path.join(work, f"{row.name}-{method}.json")
                    bar.set_postfix_str(f"{row.name} {method}")
                    _spawn(spawn_local, row.world, _train_argv(row, o, method, out, init),
                           prefix, env, log)
                    with open(out) as f:
                        res[method] = json.load(f)
                    bar.update(1)
                results.append(_row(row, res))
    finally:
        bar.close()         # before a stopped launcher's last line
    _write(results, o)
    print(markdown(results))
    print(f"wrote {o.out}.md and {o.out}.json (runs' log: {log})")
    return 0


def _spawn(spawn_local, nproc, argv, prefix, env, log):
    from dhelix.train.dist import log_tail
    rc = spawn_local(nproc, argv, prefix=prefix, extra_env=env, timeout_s=1800, log=log)
    if rc != 0:
        raise RuntimeError(f"dhelix {' '.join(argv)} --nproc {nproc}: ranks failed (exit "
                           f"{rc}); see {log}; its last lines:{log_tail(log)}")


def _row(row: LayoutRow, res: dict) -> dict:
    base, dh = res["megatron"], res["dhelix"]
    worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(dh["losses"], base["losses"]))
    return {**asdict(row), "world": row.world,
            "megatron_schedule": base["config"]["schedule"],
            "dhelix_schedule": dh["config"]["schedule"],
            "losses_megatron": base["losses"], "losses_dhelix": dh["losses"],
            "loss_rel_diff": worst,
            "tokens_per_s_megatron": base["tokens_per_s"],
            "tokens_per_s_dhelix": dh["tokens_per_s"],
            "speedup": dh["tokens_per_s"] / base["tokens_per_s"],
            # paced compute: the emulated model's step and tokens/s (None otherwise)
            "emulation_megatron": base.get("emulation"),
            "emulation_dhelix": dh.get("emulation")}


def markdown(results: List[dict]) -> str:
    if results and results[0].get("emulation_megatron"):
        return _markdown_emulated(results)
    lines = ["| layout | published | ranks (TP, CP, PP, DP, EP) | schedules | final loss "
             "megatron / DHelix | max loss diff | tokens/s megatron | tokens/s DHelix | "
             "DHelix vs megatron |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['published']} | {r['world']} ({r['tp']}, {r['cp']}, "
            f"{r['pp']}, {r['dp']}, {r['ep']}) | {r['megatron_schedule']} / "
            f"{r['dhelix_schedule']} | {r['losses_megatron'][-1]:.6f} / "
            f"{r['losses_dhelix'][-1]:.6f} | {r['loss_rel_diff']:.1e} | "
            f"{r['tokens_per_s_megatron']:.0f} | {r['tokens_per_s_dhelix']:.0f} | "
            f"{r['speedup']:.2f}x |")
    return "\n".join(lines)


def _markdown_emulated(results: List[dict]) -> str:
    e0 = results[0]["emulation_megatron"]
    lines = [f"emulated: {e0['emulate']} on {e0['cluster']} (the ranks {e0['factor']:g}x "
             f"slower)", "",
             "| layout | ranks (TP, CP, PP, DP, EP) | schedules | final loss megatron / "
             "DHelix | emulated step megatron | emulated step DHelix | DHelix vs megatron | "
             "own share megatron / DHelix |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        a, b = r["emulation_megatron"], r["emulation_dhelix"]
        lines.append(
            f"| {r['name']} | {r['world']} ({r['tp']}, {r['cp']}, {r['pp']}, {r['dp']}, "
            f"{r['ep']}) | {r['megatron_schedule']} / {r['dhelix_schedule']} | "
            f"{r['losses_megatron'][-1]:.6f} / {r['losses_dhelix'][-1]:.6f} | "
            f"{a['step_s'] * 1e3:.1f} ms | {b['step_s'] * 1e3:.1f} ms | "
            f"{a['step_s'] / b['step_s']:.2f}x | {a['own_share']:.1%} / "
            f"{b['own_share']:.1%} |")
    return "\n".join(lines)


def _write(results: List[dict], o: LayoutsOptions) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(o.out)), exist_ok=True)
    with open(o.out + ".json", "w") as f:
        json.dump({"options": asdict(o), "rows": results}, f, indent=1)
    with open(o.out + ".md", "w") as f:
        f.write(markdown(results) + "\n")
