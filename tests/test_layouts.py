"""`dhelix layouts`: the published layout shapes scaled down, megatron vs DHelix."""
import json
import subprocess
import sys


def _layouts(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "dhelix.cli", "layouts", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_layouts_row_trains_megatron_and_dhelix_alike(tmp_path):
    """One row end to end (TP×DP, 4 ranks, 2 steps): both runs' losses are in the JSON,
    equal bit for bit (DHelix's schedule on the same weights), and the table is written."""
    out = tmp_path / "lay"
    r = _layouts("--rows", "TP×DP", "--train-iters", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "lay.json").read_text())["rows"]
    assert [x["name"] for x in rows] == ["TP×DP"]
    row = rows[0]
    assert row["world"] == 4 and row["dhelix_schedule"] == "dhelix"
    assert len(row["losses_dhelix"]) == 2 and row["losses_dhelix"] == row["losses_megatron"]
    assert row["tokens_per_s_dhelix"] > 0 and row["tokens_per_s_megatron"] > 0
    assert "| TP×DP |" in (tmp_path / "lay.md").read_text()


def test_layouts_unknown_row_is_an_error():
    r = _layouts("--rows", "TP×XX", timeout=120)
    assert r.returncode == 2 and "--rows TP×XX: unknown" in r.stderr


def test_layouts_paced_compute_needs_the_paced_link():
    """--compute on a link that is not paced: one message, before any rank."""
    r = _layouts("--rows", "TP×DP", "--compute", "paced:a40", "--emulate", "llama-8b",
                 timeout=120)
    assert r.returncode == 2 and "add --link paced:1gbit" in r.stderr, r.stderr
