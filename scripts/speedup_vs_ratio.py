"""What the simulator says a plan can reach as the link gets slower or faster: a profiled
table's comm ops scaled by k (their alone times, and each pair's time so that the pair's
overlap stretch `CostTable.stretch` is kept), re-planned at each
k, the whole step (`planner.whole_step`) of megatron's order and of the plan. Prints one
row per k — comm/compute of the layer (comm ops' alone times / compute ops'), the two
steps, the speedup, and the speedup's bound (megatron / max(compute, comm) + the rest) —
and draws the curve (PNG).

    python scripts/speedup_vs_ratio.py --table table.json --config small16 \\
        --tensor-model-parallel-size 2 --seq-length 128 --micro-batch-size 4 \\
        --num-microbatches 8 --png speedup-vs-ratio.png

A scaled table is not a measured one: the comm ops' host times and overlap factors are
the profiled link's. It answers "what does the plan structure allow at this ratio", not
"what will a run measure".

`--host-scales 1,0` draws one curve per F, the comm ops' host times (issue and finish:
on the paced link its shared-memory copies and sums) at F × the table's (`dhelix plan
--host-scale`; 0: a GPU's launch), each with its thread floor (`planner.whole_step.
thread_floor`: the speedup over megatron's order no schedule on one thread can pass).
"""
from __future__ import annotations

import argparse
import copy
import json


def scaled(costs, layer, k: float):
    """`costs` with every comm op k times as long (its pairs keep their stretch)."""
    comm_f = {o.name for o in layer.forward if o.lane != "compute"}
    comm_b = {o.name for o in layer.backward if o.lane != "compute"}
    out = copy.deepcopy(costs)
    for n in comm_f:
        out.alone_f[n] *= k
    for n in comm_b:
        out.alone_b[n] *= k
    for (f, b), p in costs.pair.items():
        if (f in comm_f) == (b in comm_b):
            continue                      # same lane kind: never overlapped, unchanged
        s = costs.stretch(f, b)
        tf, tb = out.alone_f[f], out.alone_b[b]
        out.pair[(f, b)] = max(tf, tb) + (s - 1.0) * min(tf, tb)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", required=True)
    p.add_argument("--config", default="small16")
    p.add_argument("--tensor-model-parallel-size", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=8)
    p.add_argument("--scales", default="0.5,0.6,0.7,0.8,0.9,1.0,1.2,1.5,2.0",
                   help="comm time factors (1.0: the table as profiled)")
    p.add_argument("--keep-gathered", nargs="?", const=True, default=False,
                   metavar="PARTS",
                   help="plan the layer that keeps its gathered inputs (no backward "
                        "re-gathers, `--dhelix-keep-gathered [PARTS]`: attn, mlp or both, "
                        "the default); megatron's step stays the plain layer's")
    p.add_argument("--host-scales", default="1",
                   help="comm host time factors, one curve each (1: as profiled; 0: none)")
    p.add_argument("--png", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from dhelix.models.config import load_model_config
    from dhelix.planner import dp
    from dhelix.planner.problem import InputError, layer_for_shape, load_costs
    from dhelix.planner.whole_step import simulate_megatron_step, simulate_step, thread_floor
    tp = a.tensor_model_parallel_size
    shape = {"config": a.config, "tp": tp, "sp": tp > 1, "seq": a.seq_length,
             "mbs": a.micro_batch_size, "bf16": False, "lane": "intra", "ep": 1, "cp": 1,
             "mlp_chunks": 1}
    layer = layer_for_shape(shape)
    hosts = [float(x) for x in a.host_scales.split(",")]
    try:
        by_host = {F: load_costs(layer, shape, a.table, None, False, F)[0] for F in hosts}
    except InputError as e:
        raise SystemExit(f"speedup_vs_ratio.py: error: {e}")
    costs = by_host[hosts[0]]
    planned = layer_for_shape(dict(shape, keep_gathered=a.keep_gathered)) \
        if a.keep_gathered else layer
    if costs.step_extras is None:
        raise SystemExit(f"{a.table}: no step_extras (profile it with `dhelix profile`)")
    L, N = load_model_config(a.config).num_layers, a.num_microbatches
    # a layer's compute (in-step times where measured) and comm, forward and backward
    strands = ((layer.forward, "alone_f", "in_step_f"), (layer.backward, "alone_b", "in_step_b"))
    rows = []
    for F, k in [(F, float(x)) for F in hosts for x in a.scales.split(",")]:
        c = scaled(by_host[F], layer, k)
        comp = sum(getattr(c, in_step).get(o.name, getattr(c, alone)[o.name])
                   for ops, alone, in_step in strands for o in ops if o.lane == "compute")
        comm = sum(getattr(c, alone)[o.name]
                   for ops, alone, _ in strands for o in ops if o.lane != "compute")
        mg = simulate_megatron_step(layer, c, L, N, c.step_extras).total_s
        plan = dp.plan(planned, c, rotate=True, reorder=True, num_layers=L)
        dh = simulate_step(planned, plan, c, L, N, c.step_extras).total_s
        rest = c.step_extras.per_microbatch() * N + c.step_extras.per_step()
        bound = mg / (rest + L * N * max(comp, comm))
        floor = mg / thread_floor(planned, c, L, N, c.step_extras).step_s
        rows.append({"host_scale": F, "scale": k, "comm_compute": comm / comp,
                     "megatron_s": mg, "dhelix_s": dh, "speedup": mg / dh, "bound": bound,
                     "floor": floor})
        print(f"host x{F:g}  k {k:4.2f}  comm/compute {comm / comp:4.2f}  megatron "
              f"{mg * 1e3:7.0f} ms  plan {dh * 1e3:7.0f} ms  speedup {mg / dh:.3f}x  "
              f"(bound {bound:.3f}x, thread floor {floor:.3f}x)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"table": a.table, "rows": rows}, f, indent=1)
    if a.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, F in enumerate(hosts):
            rs = [r for r in rows if r["host_scale"] == F]
            x, tag = [r["comm_compute"] for r in rs], f" (host work x{F:g})" * (len(hosts) > 1)
            ax.plot(x, [r["speedup"] for r in rs], "o-", color=f"C{i}",
                    label="plan (simulated)" + tag)
            ax.plot(x, [r["floor"] for r in rs], ":", color=f"C{i}",
                    label="thread floor" + tag)
        rs = [r for r in rows if r["host_scale"] == hosts[0]]
        ax.plot([r["comm_compute"] for r in rs], [r["bound"] for r in rs], "--",
                color="gray", label="bound: megatron / (max(compute, comm) + rest)")
        ax.axhline(1.5, color="red", lw=0.8, label="goal 1.5x")
        ax.set_xlabel("layer comm / compute")
        ax.set_ylabel("whole-step speedup over megatron")
        ax.set_title(f"{a.config}, TP={tp}, {N} micro-batches: the simulator's plan")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.png, dpi=120)
        print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
