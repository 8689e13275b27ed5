"""Foundation: megatron-core GPT training on local gloo ranks."""
import subprocess
import sys

import pytest

from dhelix.models.config import ConfigError, load_model_config
from dhelix.testing import RankError, RankTimeout, run_ranks
from dhelix.train.config import TrainConfig, check_layout
from compare import same_numbers
from train_fns import train_losses

STEPS = 30


def _falls(losses):
    head = sum(losses[:3]) / 3
    tail = sum(losses[-3:]) / 3
    return tail < head - 0.3, (head, tail)


@pytest.mark.parametrize("tp,sp,world", [(2, True, 2), (2, False, 2), (1, False, 2)],
                         ids=["tp2-sp", "tp2", "dp2"])
def test_loss_falls_on_corpus(tp, sp, world):
    losses = run_ranks(train_losses, world, timeout=240, config="tiny",
                       tensor_model_parallel_size=tp, sequence_parallel=sp,
                       train_iters=STEPS, data="corpus", lr=3e-3)[0]
    ok, (head, tail) = _falls(losses)
    assert ok, f"loss did not fall: first {head:.3f} last {tail:.3f}"


def test_tp2_matches_tp1():
    kw = dict(config="tiny", train_iters=STEPS, data="corpus", seed=7)
    tp1 = run_ranks(train_losses, 1, timeout=240, tensor_model_parallel_size=1, **kw)[0]
    tp2 = run_ranks(train_losses, 2, timeout=240, tensor_model_parallel_size=2,
                    sequence_parallel=True, **kw)[0]
    # ≤1e-4: TP splits the GEMMs' reductions, and 30 steps of Adam carry the difference
    same_numbers(tp2, tp1, 1e-4, "TP=2 vs TP=1 losses")


def test_same_seed_identical():
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=5, seed=3)
    a = run_ranks(train_losses, 2, timeout=180, **kw)[0]
    b = run_ranks(train_losses, 2, timeout=180, **kw)[0]
    c = run_ranks(train_losses, 2, timeout=180, **{**kw, "seed": 4})[0]
    same_numbers(b, a, 0.0, "same seed")
    assert a != c


def test_dp2_matches_dp1_same_global_batch():
    kw = dict(config="tiny", train_iters=5, data="corpus", micro_batch_size=2,
              global_batch_size=4)
    dp1 = run_ranks(train_losses, 1, timeout=180, **kw)[0]
    dp2 = run_ranks(train_losses, 2, timeout=180, **kw)[0]
    same_numbers(dp2, dp1, 1e-5, "DP=2 vs DP=1 losses")     # the DP all-reduce's order


# ---- bad input ---------------------------------------------------------------------------

def test_unknown_config_key(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                 "ffn_hidden_size: 128\nnum_layer: 3\n")
    with pytest.raises(ConfigError, match=r"m.yaml: unknown config key\(s\) num_layer"):
        load_model_config(str(p))


def test_missing_config_file():
    with pytest.raises(ConfigError, match="--config: model config file 'nope' not found"):
        load_model_config("nope")


def test_heads_not_divisible_by_tp():
    m = load_model_config("tiny")   # 4 heads
    with pytest.raises(ConfigError, match="num_attention_heads \\(4\\) is not divisible by "
                                          "--tensor-model-parallel-size 3"):
        check_layout(TrainConfig(tensor_model_parallel_size=3), m, 3)


def test_world_not_divisible():
    m = load_model_config("tiny")
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        check_layout(TrainConfig(tensor_model_parallel_size=2), m, 3)
    with pytest.raises(ConfigError, match="world size 4 is not TP×CP×PP×DP = 2×1×1×1"):
        check_layout(TrainConfig(tensor_model_parallel_size=2, data_parallel_size=1), m, 4)


def test_cli_reports_error_without_starting_ranks():
    r = subprocess.run([sys.executable, "-m", "dhelix.cli", "train", "--nproc", "2",
                        "--tensor-model-parallel-size", "3"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "world size 2 is not divisible by --tensor-model-parallel-size 3" in r.stderr


def test_rank_failure_reports_traceback():
    with pytest.raises(RankError, match="rank 1 failed"):
        run_ranks(_fail_on_rank1, 2, timeout=60)


def test_deadlock_times_out():
    with pytest.raises(RankTimeout):
        run_ranks(_deadlock, 2, timeout=15, env={"DHELIX_PG_TIMEOUT": "300"})


def test_free_port_is_below_the_ephemeral_range():
    """A job's store port comes from below the kernel's ephemeral range (a port the kernel
    hands out may be taken by another job's gloo connection before rank 0 binds it), is
    free, and two picks rarely agree."""
    import socket
    from dhelix.train.dist import _ephemeral_low, free_port
    low = _ephemeral_low()
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), (ports, low)
    assert len(set(ports)) > 10, ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))


def test_log_tail_quotes_the_failed_runs_last_lines(tmp_path):
    """A bench's 'ranks failed' error quotes the ranks' log (the failed run's own words)."""
    from dhelix.train.dist import log_tail
    log = tmp_path / "runs.log"
    log.write_text("".join(f"line {i}\n" for i in range(40)) + "RuntimeError: address in use\n")
    tail = log_tail(str(log), lines=3)
    assert tail.splitlines()[1:] == ["    line 38", "    line 39",
                                     "    RuntimeError: address in use"]
    assert log_tail(str(tmp_path / "missing.log")) == ""


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_see_the_callers_environment_at_the_call(start, monkeypatch):
    # the fork server's own environment is frozen at its start; a variable set later by
    # the caller must still reach the ranks (tests set DHELIX_LANES this way)
    monkeypatch.setenv("DHELIX_RANK_START", start)
    run_ranks(_env_value, 1, "DHELIX_PROBE", timeout=60)   # the server starts here
    monkeypatch.setenv("DHELIX_PROBE", "after-start")
    assert run_ranks(_env_value, 2, "DHELIX_PROBE", timeout=60) == ["after-start"] * 2
    monkeypatch.delenv("DHELIX_PROBE")
    assert run_ranks(_env_value, 2, "DHELIX_PROBE", timeout=60) == [None, None]


def _env_value(name):
    import os
    return os.environ.get(name)


def _fail_on_rank1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("boom")
    return 0


def _deadlock():
    import torch
    import torch.distributed as dist
    import time
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))   # rank 1 never joins
    else:
        time.sleep(600)                   # a hung peer
    return 0


def _launch_env_run(env_per_rank, cmd, timeout=240):
    import os
    procs = [subprocess.Popen(cmd, env={**os.environ, **e, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for e in env_per_rank]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], outs


def test_runs_under_srun_environment(tmp_path):
    from dhelix.train.dist import free_port
    port = str(free_port())
    envs = [{"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
             "SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            for r in range(2)]
    out = tmp_path / "r.json"
    rcs, outs = _launch_env_run(envs, [sys.executable, "-m", "dhelix.cli", "train",
                                       "--tensor-model-parallel-size", "2", "--train-iters",
                                       "3", "--json", str(out)])
    assert rcs == [0, 0], outs
    import json
    r = json.loads(out.read_text())
    assert r["config"]["world_size"] == 2 and len(r["losses"]) == 3
    assert r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0


def test_runs_under_torchrun(tmp_path):
    from dhelix.train.dist import free_port
    out = tmp_path / "r.json"
    rcs, outs = _launch_env_run([{}], [sys.executable, "-m", "torch.distributed.run",
                                       "--nproc_per_node", "2", "--master_port",
                                       str(free_port()), "-m", "dhelix.cli", "train",
                                       "--tensor-model-parallel-size", "2",
                                       "--sequence-parallel", "--train-iters", "3",
                                       "--json", str(out)])
    assert rcs == [0], outs
    import json
    assert json.loads(out.read_text())["config"]["world_size"] == 2
