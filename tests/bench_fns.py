"""A small `dhelix bench` run for the tests: 2 ranks, TP=1, link none, 2 steps."""
import json
import os
import re
import subprocess
import sys


def run_bench(tmp_path, config, *extra):
    """Run the bench; returns (rows, out prefix, its working folder). Fails the test
    with the bench's stderr if it exits non-zero."""
    out = str(tmp_path / "b")
    r = subprocess.run([sys.executable, "-m", "dhelix.cli", "bench", "--configs", config,
                        "--links", "none", "--nproc", "2", "--tensor-model-parallel-size", "1",
                        "--seq-length", "32", "--num-microbatches", "4", "--train-iters", "2",
                        "--profile-repeats", "1", "--profile-runs", "1", "--out", out,
                        *extra],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.load(open(out + ".json"))["rows"]
    work = re.search(r"runs under (\S+)\)", r.stdout).group(1)
    assert os.path.exists(os.path.join(work, f"table-{config}-none.json"))  # profiled
    assert os.path.getsize(out + ".png") > 1000
    return rows, out, work
