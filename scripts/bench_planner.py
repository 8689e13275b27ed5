#!/usr/bin/env python3
"""Time the DP planner (Python reference vs the C++ core) on the canonical 14-op forward /
18-op backward TP+SP layer with an analytical A800 cost table.

    python3 scripts/bench_planner.py [--cluster configs/clusters/a800.yaml] [--repeat 5]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dhelix.planner import dp  # noqa: E402
from dhelix.planner.costmodel import analytical_table, load_cluster  # noqa: E402
from dhelix.planner.example_layer import tp_sp_layer  # noqa: E402


def timed(fn, repeat):
    ts, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def main(argv=None):
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default=os.path.join(here, "configs/clusters/a800.yaml"))
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--ffn", type=int, default=28672)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)

    layer = tp_sp_layer(a.hidden, a.ffn, a.seq, a.batch, a.heads, a.tp, 2)
    table = analytical_table(layer, load_cluster(a.cluster), {"tp": a.tp}, dtype="bf16")
    print(f"layer: {len(layer.forward)} forward x {len(layer.backward)} backward ops "
          f"(hidden {a.hidden}, ffn {a.ffn}, seq {a.seq}, batch {a.batch}, tp {a.tp}); "
          f"cluster {os.path.basename(a.cluster)}")

    t_py, p_py = timed(lambda: dp.plan(layer, table, backend="python"), a.repeat)
    print(f"python DP : {t_py * 1e3:8.2f} ms  (median of {a.repeat})")
    if dp.cpp_available():
        t_cc, p_cc = timed(lambda: dp.plan(layer, table, backend="cpp"), a.repeat)
        # the C++ solve alone, without building the inputs and the Plan in Python
        L = dp._Legality(layer)
        model = dp.LaneModel(layer, table)
        t_core, _ = timed(lambda: dp._cpp_problem(model, L).solve(), a.repeat)
        print(f"C++ DP    : {t_cc * 1e3:8.2f} ms  end to end, {t_core * 1e3:.3f} ms in the core "
              f"(x{t_py / t_cc:.0f} / x{t_py / t_core:.0f} vs python)")
        print(f"same plan : {p_py.steps == p_cc.steps}")
    else:
        print("C++ DP    : dhelix._planner_core not built (pip install -e . or see csrc/planner.cpp)")
    m = p_py.meta
    print(f"predicted : {m['predicted_s'] * 1e3:.3f} ms per layer step vs trivial "
          f"{m['trivial_predicted_s'] * 1e3:.3f} ms (x{m['speedup_vs_trivial']:.3f}), "
          f"{len(p_py.steps)} steps, {p_py.num_paired()} paired")
    print(p_py.table())


if __name__ == "__main__":
    main()
