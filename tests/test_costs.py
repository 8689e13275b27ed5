"""Cost table format and the analytical cost model."""
import csv
import json
import math
import random
import re
from pathlib import Path

import pytest

from dhelix.planner.costmodel import (ClusterError, analytical_table, comm_time, load_cluster,
                                      pair_time)
from dhelix.planner.costs import CostTable, TableError
from dhelix.planner.example_layer import random_table, tp_sp_layer
from dhelix.planner.opspec import COMM, COMPUTE, LayerOps, OpSpec

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = ["a40", "a800", "h100"]


def small_layer():
    return LayerOps(
        [OpSpec("ln", COMPUTE, "compute", flops=1e9),
         OpSpec("ag", COMM, "intra", group="tp", comm_bytes=1e6, collective="all_gather"),
         OpSpec("mm", COMPUTE, "compute", flops=4e9)],
        [OpSpec("mm_dgrad", COMPUTE, "compute", flops=4e9),
         OpSpec("mm_wgrad", COMPUTE, "compute", flops=4e9, wgrad=True, after="mm_dgrad"),
         OpSpec("rs", COMM, "intra", group="tp", comm_bytes=1e6, collective="reduce_scatter")])


def full_table(layer):
    return random_table(layer, random.Random(0))


def test_roundtrip_json_and_csv(tmp_path):
    layer = small_layer()
    t = full_table(layer)
    t.provenance = {"gpu": "A800", "dtype": "bf16", "tp": 8}
    p = tmp_path / "t.json"
    t.save(str(p))
    d = json.loads(p.read_text())
    assert d["format"] == "dhelix.table" and d["version"] == 1
    assert d["signature"] == layer.signature()
    u = CostTable.load(str(p), layer=layer)
    assert u.alone_f == t.alone_f and u.alone_b == t.alone_b and u.pair == t.pair
    assert u.provenance == t.provenance
    assert u.missing(layer) == []
    c = tmp_path / "t.csv"
    u.write_csv(str(c))
    rows = list(csv.reader(c.open()))
    assert rows[0] == ["forward", "backward", "T_f_s", "T_b_s", "P_s", "OEF"]
    assert len(rows) == 1 + 3 * 3
    r = rows[1]
    assert math.isclose(float(r[5]), u.oef(r[0], r[1]))


def test_host_times_roundtrip_and_are_checked(tmp_path):
    """A comm op's host times (`host_f`/`host_b`) are written only when measured, read
    back as written, and a bad entry is named."""
    layer = small_layer()
    t = full_table(layer)
    p = tmp_path / "t.json"
    t.save(str(p))
    assert "host_f" not in json.loads(p.read_text())
    assert CostTable.load(str(p)).host_f == {}
    comm = next(o.name for o in layer.backward if o.lane != "compute")
    t.host_b = {comm: 2.5e-4}
    t.save(str(p))
    assert CostTable.load(str(p), layer=layer).host_b == {comm: 2.5e-4}
    d = json.loads(p.read_text())
    d["host_b"][comm] = "fast"
    p.write_text(json.dumps(d))
    with pytest.raises(TableError, match=rf"host_b\[{comm}\]"):
        CostTable.load(str(p))


def test_oef_definition():
    layer = small_layer()
    t = CostTable.empty(layer)
    t.alone_f["ag"], t.alone_b["mm_dgrad"] = 1.0, 2.0
    t.pair[("ag", "mm_dgrad")] = 2.0          # comm fully hidden
    assert t.oef("ag", "mm_dgrad") == 1.0 and t.stretch("ag", "mm_dgrad") == 1.0
    t.pair[("ag", "mm_dgrad")] = 3.0          # no overlap
    assert t.oef("ag", "mm_dgrad") == 0.0 and t.stretch("ag", "mm_dgrad") == 2.0
    t.pair[("ag", "mm_dgrad")] = 3.5          # they slow each other
    assert t.oef("ag", "mm_dgrad") == -0.5 and t.stretch("ag", "mm_dgrad") == 2.5
    t.pair[("ag", "mm_dgrad")] = 1.5          # faster than the longer op: clamp
    assert t.stretch("ag", "mm_dgrad") == 1.0


def test_missing_entries_named(tmp_path):
    layer = small_layer()
    t = full_table(layer)
    del t.pair[("ag", "mm_dgrad")]
    del t.alone_b["rs"]
    miss = t.missing(layer)
    assert "pair[ag, mm_dgrad]" in miss and "alone_b[rs]" in miss
    # the simulator only needs pairs on different lanes: (ln, mm_dgrad) is not needed
    del t.pair[("ln", "mm_dgrad")]
    assert "pair[ln, mm_dgrad]" not in t.missing(layer, pairs="concurrent")
    assert "pair[ln, mm_dgrad]" in t.missing(layer, pairs="all")
    p = tmp_path / "t.json"
    t.save(str(p))
    with pytest.raises(TableError) as e:
        CostTable.load(str(p), layer=layer)
    msg = str(e.value)
    assert str(p) in msg and "pair[ag, mm_dgrad]" in msg and "alone_b[rs]" in msg


def test_wrong_signature(tmp_path):
    layer = small_layer()
    t = full_table(layer)
    t.provenance = {"hidden": 1024}
    p = tmp_path / "t.json"
    t.save(str(p))
    other = LayerOps(layer.forward[:2] + [OpSpec("mm", COMPUTE, "compute", flops=8e9)],
                     layer.backward)
    with pytest.raises(TableError) as e:
        CostTable.load(str(p), layer=other)
    msg = str(e.value)
    assert str(p) in msg and layer.signature() in msg and other.signature() in msg
    assert "hidden=1024" in msg
    CostTable.load(str(p), layer=other, force=True)      # forced: accepted


@pytest.mark.parametrize("mutate, expect", [
    (lambda s: s[: len(s) // 2], "not valid JSON"),
    (lambda s: s.replace('"dhelix.table"', '"other"'), "'format'"),
    (lambda s: s.replace('"version": 1', '"version": 7'), "'version'"),
    (lambda s: s.replace('"alone_f"', '"alone_x"'), "missing field 'alone_f'"),
])
def test_corrupt_files(tmp_path, mutate, expect):
    layer = small_layer()
    p = tmp_path / "t.json"
    full_table(layer).save(str(p))
    p.write_text(mutate(p.read_text()))
    with pytest.raises(TableError) as e:
        CostTable.load(str(p), layer=layer)
    assert str(p) in str(e.value) and expect in str(e.value)


def test_bad_entry_and_missing_file(tmp_path):
    layer = small_layer()
    d = full_table(layer).to_json()
    d["pair"]["ag"]["rs"] = "fast"
    p = tmp_path / "t.json"
    p.write_text(json.dumps(d))
    with pytest.raises(TableError, match=r"pair\[ag, rs\]"):
        CostTable.load(str(p))
    d["pair"]["ag"]["rs"] = -1.0
    p.write_text(json.dumps(d))
    with pytest.raises(TableError, match=r"pair\[ag, rs\]"):
        CostTable.load(str(p))
    with pytest.raises(TableError, match="not found"):
        CostTable.load(str(tmp_path / "nope.json"))
    assert issubclass(TableError, ValueError)


# ---- analytical model ------------------------------------------------------------------

@pytest.mark.parametrize("name", CLUSTERS)
def test_cluster_files_load_and_cite_sources(name):
    path = ROOT / "configs" / "clusters" / f"{name}.yaml"
    c = load_cluster(str(path))
    assert c["peak_flops"]["bf16"] > c["peak_flops"]["fp32"] > 1e12
    for line in path.read_text().splitlines():
        body = line.split("#")[0]
        if re.search(r":\s*[0-9]", body):
            assert "#" in line, f"{name}.yaml: number without a source comment: {line!r}"
    layer = tp_sp_layer(hidden=1024, ffn=4096, seq=1024, batch=1, heads=16, tp=8)
    t = analytical_table(layer, c, {"tp": 8})
    assert t.missing(layer) == []
    assert t.provenance["source"] == "analytical"


def test_published_figures():
    a40 = load_cluster(str(ROOT / "configs/clusters/a40.yaml"))
    a800 = load_cluster(str(ROOT / "configs/clusters/a800.yaml"))
    h100 = load_cluster(str(ROOT / "configs/clusters/h100.yaml"))
    assert a40["peak_flops"]["bf16"] == 149.7e12 and a40["peak_flops"]["fp32"] == 37.4e12
    assert a800["peak_flops"]["bf16"] == 312e12 and a800["peak_flops"]["fp32"] == 19.5e12
    assert h100["peak_flops"]["bf16"] == 989e12 and h100["peak_flops"]["fp32"] == 67e12


def test_ring_formulas_and_pairs():
    c = {"peak_flops": {"bf16": 100e12}, "achieved_fraction": 0.5,
         "intra_node": {"bandwidth_GBps": 100, "latency_us": 2},
         "inter_node": {"bandwidth_GBps": 10, "latency_us": 10},
         "gpus_per_node": 8, "comm_compute_slowdown": 0.1}
    ag = OpSpec("ag", COMM, "intra", group="tp", comm_bytes=8e9, collective="all_gather")
    ar = OpSpec("ar", COMM, "inter", group="dp", comm_bytes=8e9, collective="all_reduce")
    assert math.isclose(comm_time(ag, c, 8), 7 / 8 * 8e9 / 100e9 + 7 * 2e-6)
    assert math.isclose(comm_time(ar, c, 4), 2 * (3 / 4 * 8e9 / 10e9 + 3 * 10e-6))
    assert comm_time(ag, c, 1) == 0.0
    mm = OpSpec("mm", COMPUTE, "compute", flops=100e12)
    layer = LayerOps([mm, ag], [OpSpec("mm_b", COMPUTE, "compute", flops=50e12), ar])
    t = analytical_table(layer, c, {"tp": 8, "dp": 4})
    assert math.isclose(t.alone_f["mm"], 2.0)
    assert math.isclose(t.pair[("mm", "mm_b")], 3.0)                       # compute + compute
    assert math.isclose(t.pair[("mm", "ar")], max(2.0 * 1.1, t.alone_b["ar"]))
    assert math.isclose(t.pair[("ag", "ar")], max(t.alone_f["ag"], t.alone_b["ar"]))
    assert math.isclose(t.oef("mm", "mm_b"), 0.0, abs_tol=1e-12)
    assert pair_time(ag, 1.0, ag, 2.0, 0.1) == 3.0                          # same lane
    with pytest.raises(ClusterError, match="group 'dp'"):
        analytical_table(layer, c, {"tp": 8})


def test_bad_cluster(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("peak_flops: {bf16: 1e12}\nintra_node: {bandwidth_GBps: 0}\n")
    with pytest.raises(ClusterError, match="intra_node.bandwidth_GBps"):
        load_cluster(str(p))


def test_speedup_vs_ratio_scales_only_the_comm_ops():
    """scripts/speedup_vs_ratio.py's scaled table: comm ops' alone times k times as long,
    compute ops' unchanged, and every pair of a comm and a compute op keeps its overlap
    stretch (so k = 1 gives the pair times back)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "speedup_vs_ratio", ROOT / "scripts" / "speedup_vs_ratio.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    layer = tp_sp_layer()
    t = random_table(layer, random.Random(3))
    comm = {o.name for o in layer.forward + layer.backward if o.lane != "compute"}
    for k in (1.0, 2.5):
        s = mod.scaled(t, layer, k)
        for alone, orig in ((s.alone_f, t.alone_f), (s.alone_b, t.alone_b)):
            for n, v in orig.items():
                assert alone[n] == pytest.approx(v * (k if n in comm else 1.0)), (k, n)
        for (f, b), p in t.pair.items():
            if (f in comm) == (b in comm):
                assert s.pair[(f, b)] == p, (k, f, b)
                continue
            assert s.stretch(f, b) == pytest.approx(t.stretch(f, b)), (k, f, b)
            if k == 1.0 and p >= max(t.alone_f[f], t.alone_b[b]):
                assert s.pair[(f, b)] == pytest.approx(p), (f, b)


def test_alpha_rotation_model_experiment():
    """scripts/alpha_rotation.py: α's forward chain rotated by s keeps every op once, in
    the chain's cyclic order; a comm whose reader moved to the next layer step loses it
    (the step's barrier waits), the others keep theirs; s = 0 plans the layer's own pair;
    a rotation outside the chain is refused."""
    import importlib.util
    from dhelix.planner import dp
    spec = importlib.util.spec_from_file_location(
        "alpha_rotation", ROOT / "scripts" / "alpha_rotation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from dhelix.planner.chains import layer_chains
    # a chunked MLP's gathers name their readers (each chunk's fc1): some rotations
    # move a reader to the next layer step
    chunked = LayerOps(*layer_chains(2, True, mlp_chunks=2))
    names = [o.name for o in chunked.forward]
    readers = {o.name: o.reader for o in chunked.forward if o.reader}
    assert readers
    moved_any = False
    for s in range(len(names)):
        r = mod.rotated_forward(chunked, s)
        assert [o.name for o in r.forward] == names[s:] + names[:s]
        assert r.backward == chunked.backward
        for o in r.forward:
            if o.name in readers:
                moved = names.index(o.name) < s <= names.index(readers[o.name])
                moved_any |= moved
                assert o.reader == (None if moved else readers[o.name]), (s, o.name)
    assert moved_any
    layer = tp_sp_layer()
    t = random_table(layer, random.Random(5))
    own = dp.plan(layer, t, force=True)
    rot0 = dp.plan(mod.rotated_forward(layer, 0), t, force=True)
    assert rot0.meta["predicted_s"] == own.meta["predicted_s"]
    with pytest.raises(ValueError, match="rotation"):
        mod.rotated_forward(layer, len(layer.forward))


def test_min_of_runs_keeps_each_entrys_smallest_median():
    """Profiling runs merged: every entry (alone, pairs, in-step, host times, step
    extras) the smallest of the runs'; runs of another layer or with other entries
    refused, naming the run."""
    from dataclasses import replace
    from dhelix.planner.costs import StepExtras, min_of_runs
    layer = tp_sp_layer()
    rng = random.Random(11)
    a, b = random_table(layer, rng), random_table(layer, rng)
    for t in (a, b):
        t.in_step_f = {k: rng.uniform(1e-4, 1e-3) for k in t.alone_f}
        t.host_b = {k: rng.uniform(1e-5, 1e-4) for k in t.alone_b}
        t.step_extras = StepExtras(*(rng.uniform(1e-3, 1e-2) for _ in range(6)),
                                   num_layers=4, zero_grad_s=rng.uniform(0, 1e-3))
    m = min_of_runs([a, b])
    for fld in ("alone_f", "alone_b", "pair", "in_step_f", "host_b"):
        assert getattr(m, fld) == {k: min(getattr(a, fld)[k], getattr(b, fld)[k])
                                   for k in getattr(a, fld)}, fld
    assert m.step_extras.optimizer_s == min(a.step_extras.optimizer_s, b.step_extras.optimizer_s)
    assert m.step_extras.zero_grad_s == min(a.step_extras.zero_grad_s, b.step_extras.zero_grad_s)
    assert m.step_extras.num_layers == 4 and m.provenance["runs"] == 2
    assert m.signature == a.signature
    other = replace(b, signature="0123456789abcdef")
    with pytest.raises(TableError, match="run 2: layer signature"):
        min_of_runs([a, other])
    fewer = replace(b, pair=dict(list(b.pair.items())[1:]))
    with pytest.raises(TableError, match="b.json: its pair entries differ"):
        min_of_runs([a, fewer], ["a.json", "b.json"])
