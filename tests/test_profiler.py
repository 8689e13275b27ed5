"""`dhelix profile` and `dhelix validate-model` on 2 real gloo ranks (tiny shapes)."""
import csv
import json
import subprocess
import sys

import numpy as np

from dhelix.planner.costs import CostTable, StepExtras
from dhelix.planner.shapes import layer_ops_for_shape
from dhelix.models.config import load_model_config

SHAPE = ["--config", "tiny", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--seq-length", "32", "--micro-batch-size", "2"]


def _dhelix(*args, timeout=400):
    r = subprocess.run([sys.executable, "-m", "dhelix.cli", *args, "--nproc", "2",
                        "--timeout", str(timeout)], capture_output=True, text=True,
                       timeout=timeout + 30)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_profile_writes_table_with_provenance(tmp_path):
    out = tmp_path / "table.json"
    _dhelix("profile", *SHAPE, "--warmup", "0", "--repeats", "1", "--out", str(out))
    layer = layer_ops_for_shape(load_model_config("tiny"), 2, True, 32, 2)
    t = CostTable.load(str(out), layer=layer, pairs="concurrent")   # complete for its use
    assert set(t.alone_f) == {o.name for o in layer.forward}
    assert set(t.alone_b) == {o.name for o in layer.backward}
    assert all(v > 0 for v in list(t.alone_f.values()) + list(t.pair.values()))
    # every comm op's own work on the thread (issue and finish), and only the comm ops'
    for host, ops in ((t.host_f, layer.forward), (t.host_b, layer.backward)):
        assert set(host) == {o.name for o in ops if o.lane != "compute"}
        assert all(0 < v < 1.0 for v in host.values()), host
    prov = t.provenance
    for key in ("model", "seq_length", "dtype", "tensor_model_parallel_size", "node_ids",
                "hardware", "versions", "world_size"):
        assert key in prov, key
    assert prov["tensor_model_parallel_size"] == 2 and prov["world_size"] == 2
    rows = list(csv.DictReader(open(tmp_path / "table.csv")))
    measured = [r for r in rows if r["P_s"]]      # unmeasured pairs are blank cells
    assert len(measured) == len(t.pair) and all(r["OEF"] for r in measured)
    # the rest of a training step, on the whole tiny model (2 layers) at TP 2
    x = t.step_extras
    assert x is not None and x.num_layers == 2 and x.data_parallel_size == 1
    assert all(getattr(x, k) > 0 for k in StepExtras.SECONDS) and x.zero_grad_s >= 0


def test_validate_model_reports_rank_correlation(tmp_path):
    out = tmp_path / "val"
    r = _dhelix("validate-model", *SHAPE, "--warmup", "0", "--repeats", "1", "--plans", "30",
                "--out", str(out))
    res = json.load(open(str(out) + ".json"))
    assert res["n"] == 33 and len(res["measured_s"]) == len(res["predicted_s"]) == 33
    assert res["plans"][:3] == ["trivial", "paired", "dp"]
    meas, pred = np.array(res["measured_s"]), np.array(res["predicted_s"])
    assert np.all(np.isfinite(meas)) and np.all(meas > 0) and np.all(pred > 0)
    # the reported statistics are those of the reported numbers (computed independently)
    rm, rp = _ranks(meas), _ranks(pred)
    rho = np.corrcoef(rm, rp)[0, 1]
    assert abs(res["spearman"] - rho) < 1e-9
    assert abs(res["median_abs_error"] - np.median(np.abs(pred - meas) / meas)) < 1e-12
    assert (tmp_path / "val.png").stat().st_size > 1000
    assert f"Spearman {res['spearman']:.3f}" in r.stdout


def _ranks(x):
    """Ranks with ties averaged."""
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x), dtype=float)
    for v in np.unique(x):
        r[x == v] = r[x == v].mean()
    return r


def test_profile_runs_merge_to_each_entrys_smallest_median(tmp_path):
    """`dhelix profile --nproc 2 --runs 2`: two profiles in rank processes of their own,
    kept as NAME.runK.json, and the table every entry's smaller median (provenance says
    so); `--runs 2` without --nproc, and --runs 0, a one-line error."""
    out = tmp_path / "t.json"
    r = _dhelix("profile", *SHAPE, "--warmup", "0", "--repeats", "1", "--no-step-extras",
                "--runs", "2", "--out", str(out))
    assert "2 runs merged" in r.stdout and "differed by up to" in r.stdout
    runs = [CostTable.load(str(tmp_path / f"t.run{k}.json")) for k in (1, 2)]
    t = CostTable.load(str(out))
    assert t.provenance["runs"] == 2
    for fld in ("alone_f", "alone_b", "in_step_f", "in_step_b", "pair"):
        got = getattr(t, fld)
        assert got and got == {k: min(getattr(x, fld)[k] for x in runs) for k in got}, fld
    assert (tmp_path / "t.csv").exists()
    for bad, msg in (("2", "give --nproc"), ("0", "1 or more")):
        r = subprocess.run([sys.executable, "-m", "dhelix.cli", "profile", *SHAPE, "--runs", bad],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, \
            r.stderr

