"""Issue 6 pieces: the intra-batch peer trains like megatron; traces are valid."""
import json

import pytest

from dhelix.bench.report import markdown
from dhelix.bench.run import _split_links
from dhelix.testing import run_ranks
from compare import same_runs
from train_fns import train_result


def test_intra_batch_peer_matches_baseline():
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=10, micro_batch_size=2, global_batch_size=6)
    """The intra-batch peer (two batch halves round-robin) vs megatron, every rank: the
    losses ≤1e-5, every step's per-parameter gradient checksums ≤1e-4, the final weights'
    ≤1e-3 relative. Not bit for bit: a weight's grad adds the halves' parts in another
    order (~1e-7), and Adam carries that on: an entry whose grad is near zero still moves
    by about the learning rate, in the direction the rounding gave it."""
    base = run_ranks(train_result, 2, timeout=300, checksums=True, **kw)
    peer = run_ranks(train_result, 2, timeout=300, checksums=True,
                     dhelix={"peer": "intra-batch"}, **kw)
    assert peer[0]["config"]["schedule"] == "intra-batch"
    assert same_runs(peer, base, 1e-5, keys=("losses",)) <= 1e-5
    assert same_runs(peer, base, 1e-4, keys=("grad_checksums",)) <= 1e-4
    assert same_runs(peer, base, 1e-3, keys=("weight_checksums",)) <= 1e-3


def test_intra_batch_peer_rejects_odd_micro_batch():
    from dhelix.testing import RankError
    with pytest.raises(RankError, match="--micro-batch-size must be even"):
        run_ranks(train_result, 2, timeout=200, config="tiny", tensor_model_parallel_size=2,
                  train_iters=1, micro_batch_size=1, dhelix={"peer": "intra-batch"})


def test_trace_is_chrome_json_with_every_op(tmp_path):
    path = str(tmp_path / "trace.json")
    run_ranks(train_result, 2, timeout=300, config="tiny", tensor_model_parallel_size=2,
              sequence_parallel=True, train_iters=2, global_batch_size=4,
              dhelix={"enabled": True, "trace": path})
    # every rank's files carry its rank, rank 0's too
    assert not (tmp_path / "trace.json").exists() and not (tmp_path / "trace.png").exists()
    for p in (str(tmp_path / "trace.rank0.json"), str(tmp_path / "trace.rank1.json")):
        d = json.load(open(p))
        meta = {e["args"]["name"] for e in d["traceEvents"] if e.get("name") == "thread_name"}
        assert {"compute", "intra", "inter"} <= meta
        ev = [e for e in d["traceEvents"] if e["ph"] == "X"]
        assert all(e["dur"] >= 0 and "ts" in e and "strand" in e["args"] for e in ev)
        assert {e["tid"] for e in ev} == {0, 1}            # compute and intra lanes used
        # every op of every layer step of the last iteration: 2 micro-batches × 2 layers
        from dhelix.models.config import load_model_config
        n_layers = load_model_config("tiny").num_layers
        names = [e["name"] for e in ev]
        for op in ("ln_attn", "ag_attn", "qkv", "attn", "rs_attn", "bda_mlp", "bda_mlp_b",
                   "fc1_wgrad", "ag_attn_w", "rs_attn_b", "ln_attn_b"):
            assert names.count(op) == 2 * n_layers, op
        mbs = {(e["args"]["strand"], e["args"]["microbatch"]) for e in ev}
        assert mbs == {("α", "F1"), ("α", "F2"), ("β", "B1"), ("β", "B2")}
    assert (tmp_path / "trace.rank0.png").stat().st_size > 1000
    assert (tmp_path / "trace.rank1.png").stat().st_size > 1000


def test_link_rates_and_table():
    assert _split_links("none,paced:2gbit,20us,paced:1gbit,2gbit") == \
        ["none", "paced:2gbit,20us", "paced:1gbit", "2gbit"]
    # the paced link's contention option stays with its link, after a latency or not
    assert _split_links("paced:1gbit,paced:2gbit,paced:1gbit,20us,slow=0.15") == \
        ["paced:1gbit", "paced:2gbit", "paced:1gbit,20us,slow=0.15"]
    assert _split_links("paced:1gbit,slow=0.1,none,2gbit") == \
        ["paced:1gbit,slow=0.1", "none", "2gbit"]
    row = {"config": "small", "link": "2gbit", "method": "dhelix-plan", "tokens_per_s": 10,
           "speedup": 1.5, "step_s": 0.1, "lower_bound_s": 0.05, "layer_compute_s": 0.04,
           "layer_comm_s": 0.05, "hidden_share": 0.8, "memory_vs_baseline": 1.02}
    md = markdown([row])
    assert "| small | 2gbit | dhelix-plan | 10 | 1.50x |" in md and "80%" in md
    assert "40 / 50 (1.25)" in md


def test_a_dhelix_run_that_trains_otherwise_is_flagged():
    """The bench compares every DHelix run's losses with megatron's of the same round: a
    reordered plan once trained on a peer's later data on the paced link and its times
    were reported; now that run fails the bench. The intra-batch peer and DHelix's halves
    (a batch's GEMMs split in two round differently) are not held to it."""
    from dhelix.bench.report import loss_mismatch
    base = {"losses": [6.29, 6.17]}
    assert loss_mismatch("dhelix-plan", {"losses": [6.29, 6.17]}, "megatron", base) == ""
    msg = loss_mismatch("dhelix-plan", {"losses": [6.29, 6.16]}, "megatron", base)
    assert "dhelix-plan" in msg and "6.16" in msg and "megatron" in msg
    assert loss_mismatch("dhelix-fold", {"losses": [1.0]}, "megatron-1f1b", base)
    for peer in ("intra-batch", "dhelix-halves"):       # a batch split in two rounds
        assert loss_mismatch(peer, {"losses": [6.3, 6.1]}, "megatron", base) == ""


def test_peer_waits_per_step_from_a_runs_link():
    """A bench row's `peer_wait_s`: the run's late-peer and slot waits over its steps;
    None without a paced link (or a result written before the link counted them)."""
    from dhelix.bench.report import peer_wait_per_step
    r = {"step_times_s": [1.0, 1.0, 1.0, 1.0],
         "link": {"peer_late_s": 0.3, "peer_slot_s": 0.1, "waited_s": 2.0}}
    assert peer_wait_per_step(r) == pytest.approx(0.1)
    assert peer_wait_per_step({"step_times_s": [1.0], "link": None}) is None
    assert peer_wait_per_step({"step_times_s": [1.0], "link": {"waited_s": 1.0}}) is None


def test_rounds_pool_their_steps_and_keep_each_rounds_speedup(tmp_path):
    """Three rounds of two methods: the pooled row's speedup is megatron's median over all
    timed steps against the method's (each run's first step a warm-up); `round_speedups`
    holds each round's ratio against megatron's run of the same round, and the table and
    picture show them (one round: "-")."""
    from dhelix.bench.report import plot, pool_round, rows, round_speedups
    runs = {"megatron": [[9.0, 4.0, 4.0, 4.0], [9.0, 6.0, 6.0, 6.0], [9.0, 5.0, 5.0, 5.0]],
            "dhelix-plan": [[9.0, 2.0, 2.0, 2.0], [9.0, 5.0, 5.0, 5.0], [9.0, 4.0, 4.0, 4.0]]}
    res = {}
    for rnd in range(3):
        for m, steps in runs.items():
            r = {"step_times_s": list(steps[rnd]), "tokens_per_s": 10.0 * (rnd + 1),
                 "peak_memory_bytes": 100, "losses": [1.0], "peer_wait_s": 0.1 * rnd}
            res[m] = pool_round(res.get(m), r, rnd)
    plan = res["dhelix-plan"]
    assert plan["step_times_s"] == [9.0] + [2.0] * 3 + [5.0] * 3 + [4.0] * 3
    assert plan["round_step_s"] == [2.0, 5.0, 4.0]
    assert plan["tokens_per_s"] == pytest.approx(20.0)
    assert plan["peer_wait_s"] == pytest.approx(0.1)
    assert round_speedups(res["megatron"], plan) == pytest.approx([2.0, 1.2, 1.25])
    assert round_speedups({}, plan) == []          # a result pooled before rounds were kept
    res["dhelix-trivial"] = res["megatron"]
    tr = {"layer_compute_s": 2.0, "layer_comm_s": 2.0}
    out = rows("small16", "paced:1gbit", res, tr, ("megatron", "dhelix-plan"))
    row = out[1]
    assert row["speedup"] == pytest.approx(5.0 / 4.0)
    assert row["round_speedups"] == pytest.approx([2.0, 1.2, 1.25])
    assert row["thread_floor_s"] is None
    md = markdown(out)
    assert "| 1.25x | 2.00 / 1.20 / 1.25 |" in md
    assert "| 1.00x | 1.00 / 1.00 / 1.00 |" in md
    one = dict(row, round_speedups=[1.25])
    assert "| 1.25x | - |" in markdown([one])
    plot(out, str(tmp_path / "b.png"), ("megatron", "dhelix-plan"))
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_bench_rows_carry_the_thread_floor_of_their_table(tmp_path):
    """The bench's thread floor (`predict.step_floor`): the whole step's
    `planner.whole_step.thread_floor` on the run's table and layer — the keeping layer's
    (no backward re-gathers, so no host work for them) below the plain one's — shown after
    the measured lower bound; none for the analytical model or a table without extras."""
    import random
    from types import SimpleNamespace

    from dhelix.bench.predict import step_floor
    from dhelix.bench.report import rows
    from dhelix.planner.costs import StepExtras
    from dhelix.planner.example_layer import random_table
    from dhelix.planner.problem import layer_for_shape
    from dhelix.planner.whole_step import thread_floor

    a = SimpleNamespace(tensor_model_parallel_size=2, seq_length=32, micro_batch_size=2,
                        expert_model_parallel_size=1, context_parallel_size=1,
                        num_microbatches=4, dhelix_mlp_chunks=1)
    shape = {"config": "tiny", "tp": 2, "sp": True, "seq": 32, "mbs": 2, "bf16": False,
             "lane": "intra", "ep": 1, "cp": 1, "mlp_chunks": 1, "keep_gathered": False}
    layer = layer_for_shape(shape)
    table = random_table(layer, random.Random(3), host=True)
    for ops, host in ((layer.forward, table.host_f), (layer.backward, table.host_b)):
        for o in ops:                      # every comm op with some host work
            if o.lane != "compute":
                host[o.name] = host.get(o.name) or 0.01
    path = str(tmp_path / "table.json")
    table.save(path)
    assert step_floor(a, "tiny", path) is None          # no step extras in it
    ex = StepExtras(pre_fwd_s=0.01, pre_bwd_s=0.01, post_fwd_s=0.01, post_bwd_s=0.01,
                    optimizer_s=0.1, finalize_s=0.01, num_layers=2, zero_grad_s=0.01)
    table.step_extras = ex
    table.save(path)
    plain = step_floor(a, "tiny", path)
    assert plain == pytest.approx(thread_floor(layer, table, 2, 4, ex).step_s)
    kept = step_floor(a, "tiny", path, keep=True)
    assert kept < plain
    assert step_floor(a, "tiny", "this-machine") is None     # the analytical model
    res = {m: {"step_times_s": [9.0, 2.0], "tokens_per_s": 1.0, "peak_memory_bytes": 1,
               "losses": [1.0]} for m in ("megatron", "dhelix-trivial", "dhelix-plan")}
    out = rows("tiny", "paced:1gbit", res, {"layer_compute_s": 1.0, "layer_comm_s": 0.5},
               ("megatron", "dhelix-plan"), floors={"megatron": plain, "dhelix-plan": plain})
    assert out[1]["thread_floor_s"] == plain
    assert f"| {out[1]['lower_bound_s'] * 1e3:.0f} ({plain * 1e3:.0f}) |" in markdown(out)
