"""`dhelix published` and the DP traffic it prices (`dhelix/bench/published.py`,
`table.py`, `best.py`; `bench/emulated.py`'s `StageDP`; the paced link's group size, NIC
share and per-collective byte scale): the published rows cut to fit and priced at the
published DP, the simulator's DP traffic on hand-computed cases, a table grown over
several runs, `--simulate`, the best-layout rows, and one row end to end at a tiny factor
(the table's machinery, not its numbers; the numbers are docs/results.md's)."""
import json
import subprocess
import sys

import pytest


def dict_ns(ns, **kw):
    from types import SimpleNamespace
    return SimpleNamespace(**dict(vars(ns), **kw))


def test_published_rows_fit_and_price_the_published_dp():
    """Every published row runs with DP cut to ≤ 32 ranks (the A800 32k row, 64 ranks at
    DP 1, does not fit and says so); `--emulate ...,dp=D` prices the DP reduction of the
    cut run as a group of the published D, on the link the run's group spans."""
    from types import SimpleNamespace
    from dhelix.bench import emulated
    from dhelix.bench.published import ROWS, TableError, run_dp
    from dhelix.bench.table import select
    from dhelix.models.config import load_model_config
    from dhelix.train.emulate import _cluster, parse
    fits = {r.key: run_dp(r, 32) for r in ROWS}
    assert fits["llama-8b"] == 8 and fits["gpt-18b"] == 4 and fits["llama-39b"] == 2
    assert fits["phi-3.5-moe"] == 8 and fits["llama-66b-32k"] is None
    for r in ROWS:
        d = fits[r.key]
        assert d is None or (r.dp % d == 0 and r.tp * r.cp * r.pp * d <= 32)
    with pytest.raises(TableError, match="unknown row"):
        select("llama-8b,nope")
    assert parse("paced:a40", "llama-8b,dp=16").data_parallel_size == 16
    c = _cluster("a40")
    small, big = load_model_config("tiny-llama-emu"), load_model_config("llama-8b")

    def dp_comm(emulate, dist_opt=False, cluster=c, nproc=16):
        a = SimpleNamespace(nproc=nproc, tensor_model_parallel_size=4, context_parallel_size=1,
                            pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                            compute="paced:a40", emulate=emulate,
                            distributed_optimizer=dist_opt)
        return emulated.stage_dp(a, big, cluster, [32], [(True, True)])[0]
    run, published = dp_comm("llama-8b"), dp_comm("llama-8b,dp=16")
    assert len(run.reduce) == 32 and run.gather == []      # a bucket per layer
    # the ring's 2(n-1)/n: 16 ranks move 1.875/1.5 of 4 ranks' bytes per rank (+ latency)
    assert sum(published.reduce) / sum(run.reduce) == pytest.approx(1.875 / 1.5, rel=0.02)
    dist = dp_comm("llama-8b,dp=16", True)
    # the distributed optimizer: a reduce-scatter of fp32 gradients (half the all-reduce),
    # an all-gather of bf16 parameters (half that again)
    assert sum(dist.reduce) == pytest.approx(sum(published.reduce) / 2, rel=0.02)
    assert sum(dist.gather) == pytest.approx(sum(dist.reduce) / 2, rel=0.02)
    # the embedding rides the last bucket reduced and the first gathered
    assert dist.reduce[-1] == pytest.approx(max(dist.reduce), rel=0.01)
    assert dist.reduce[-1] == pytest.approx(2 * dist.gather[0], rel=0.02)
    assert dist.reduce[-1] > 3 * dist.reduce[1]
    # A40: the 4 DP rings a node's 8 GPUs (2 TP groups of 4) run share its one NIC; with
    # a NIC per GPU each ring has its own
    rail = dict(c, nics_per_node=8)
    assert sum(dp_comm("llama-8b,dp=16", True, c).reduce) == pytest.approx(
        4 * sum(dp_comm("llama-8b,dp=16", True, rail).reduce), rel=0.05)
    # cut to 8 ranks (DP 2), the DP group would sit in one 8-GPU node where DP 16's crosses
    # nodes: the run's nodes shrink to one TP group each, and the reduction is priced as
    # at 16 ranks (the NIC, shared by the node's 4 rings)
    a8 = SimpleNamespace(nproc=8, tensor_model_parallel_size=4, context_parallel_size=1,
                         pipeline_model_parallel_size=1, compute="paced:a40",
                         emulate="llama-8b,dp=16")
    assert emulated.node_ids(a8, c) == [0] * 4 + [1] * 4
    assert emulated.node_ids(dict_ns(a8, emulate="llama-8b"), c) == [0] * 8
    assert dp_comm("llama-8b,dp=16", True, nproc=8).reduce == pytest.approx(
        dp_comm("llama-8b,dp=16", True).reduce, rel=1e-9)


def test_dp_traffic_hides_behind_the_alone_micro_batches():
    """The simulator's DP traffic (`StageDP.exposed`): gradient buckets reduced as the last
    backward readies them (one per `t_bwd`), the tail exposed; the parameter gathers
    chained through the first forward, throttling it where a gather outlasts a layer."""
    from dhelix.bench.emulated import StageDP
    from dhelix.planner.costmodel import nic_share
    d = StageDP([1.0] * 4, [1.0] * 4)
    # backward 2 s a layer: each bucket reduced within the next layer's backward but the
    # last (1 s after the backward ends); forward 0.5 s: every layer waits for its gather
    assert d.exposed(0.5, 2.0) == pytest.approx((1.0, 2.5))
    # backward 0.5 s: the link is the bottleneck (4 s of reduction from 0.5 s, 2 s of
    # backward); forward 2 s: only the first gather is exposed
    assert d.exposed(2.0, 0.5) == pytest.approx((2.5, 1.0))
    assert StageDP([0.1] * 3, []).exposed(1.0, 1.0) == pytest.approx((0.1, 0.0))
    # a node of 8 GPUs whose rings have 2 members on it: 4 rings; 1 NIC each, 2 for 8
    assert nic_share({}, 8, 2) == 4 and nic_share({"nics_per_node": 8}, 8, 2) == 1
    assert nic_share({"nics_per_node": 2}, 8, 1) == 4


def test_published_table_keeps_the_rows_it_does_not_redo(tmp_path):
    """A table built over several runs: the rows of an earlier table.json in --out that
    this run does not redo are kept, in the table's order."""
    import json
    from dhelix.bench.table import _in_table_order, _kept
    rows = [{"row": "gpt-18b", "speedup": 1.3}, {"row": "llama-8b", "speedup": 1.2}]
    (tmp_path / "table.json").write_text(json.dumps({"rows": rows}))
    kept = _kept(str(tmp_path), {"llama-8b"})
    assert kept == rows[:1]
    assert [r["row"] for r in _in_table_order(kept + [{"row": "llama-8b"}])] == \
        ["llama-8b", "gpt-18b"]
    assert _kept(str(tmp_path / "none"), set()) == []


def test_published_simulate_predicts_rows_without_running_them(tmp_path):
    """`dhelix published --simulate`: each row as it would run, predicted in seconds —
    megatron's better schedule against DHelix's, the layers alone, the head and the DP
    traffic each leaves exposed (equal in both: the same buckets behind the same alone
    micro-batches); a row beyond --max-ranks is simulated at DP 1 and listed."""
    import json
    r = subprocess.run([sys.executable, "-m", "dhelix.cli", "published", "--simulate",
                        "--rows", "gpt-6.7b,llama-66b-32k", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads((tmp_path / "simulated.json").read_text())
    assert d["beyond_max_ranks"] == ["llama-66b-32k"] and len(d["rows"]) == 2
    row, big = d["rows"]
    assert big["ranks"] == 64 and big["run_dp"] == 1      # simulated, as many as it takes
    assert row["ranks"] == 16 and row["run_dp"] == 4 and row["megatron_method"] == "megatron"
    meg, dh = row["dp_exposed_ms"]
    assert meg == pytest.approx(dh) and dh > 0 and row["head_ms"] > 0
    # the same DP traffic and head on both sides dilute the layers' gain
    assert 1.0 < row["speedup"] < row["layers_speedup"]
    assert row["megatron_ms"] / row["dhelix_ms"] == pytest.approx(row["speedup"])
    # --dhelix-pair-last: two backwards after the last forward hide more of the DP
    # reduction (a PP row has no such column)
    assert row["pair_last_speedup"] > row["speedup"] and big["pair_last_speedup"] is None
    assert "| gpt-6.7b (a40) |" in (tmp_path / "simulated.md").read_text()


def test_best_rows_run_each_side_at_the_layout_advise_picks(tmp_path):
    """A best row (`bench/best.py`): `dhelix advise` picks megatron's and DHelix's best
    layouts for the row's GPUs, sequence and global batch; each side runs at its own
    layout and schedule (advise's micro-batches, its micro-batch size and DP in the
    emulated shape), both training the row's global batch; the simulator's step of each
    side gives the row's prediction; `--rows best` names every best row."""
    from dhelix.bench.best import BEST, METHODS, BestRow, advised, side, simulate
    from dhelix.bench.published import TableOptions
    from dhelix.bench.table import select
    row = BestRow("tiny-best", "tiny-llama-emu", cluster="a40", seq=256, global_batch=16,
                  gpus=8)
    o = TableOptions(max_ranks=8)
    los = advised(row, str(tmp_path))
    assert set(los) == {"megatron", "dhelix"}
    for who, lo in los.items():
        assert METHODS[lo["schedule"]].startswith(who)
        assert lo["dp"] * lo["mbs"] * lo["microbatches"] == row.global_batch
        b = side(row, lo, o, str(tmp_path), who)
        assert b.methods == METHODS[lo["schedule"]] and b.num_microbatches == lo["microbatches"]
        assert b.emulate == f"tiny-llama-emu,seq=256,mbs={lo['mbs']},dp={lo['dp']}"
        assert b.nproc <= 8 and b.distributed_optimizer
        assert (b.tensor_model_parallel_size, b.pipeline_model_parallel_size) == \
            (lo["tp"], lo["pp"])
    p = simulate(row, o, str(tmp_path))
    assert p["speedup"] == pytest.approx(p["megatron_ms"] / p["dhelix_ms"])
    assert p["megatron_layout"].endswith(los["megatron"]["schedule"])
    assert [r.key for r in select("best")] == [r.key for r in BEST]


@pytest.mark.timeout(600)
def test_published_row_end_to_end(tmp_path):
    """`dhelix published` runs one row end to end at a tiny factor (the table's machinery,
    not its numbers): gpt-6.7b's DP16 × TP4 cut to 8 ranks (DP 2), 2 layers, megatron and
    DHelix's plan with the paired tail (`--pair-last`) both with the distributed
    optimizer and overlapped reduce and gather, the reduction priced at DP 16; the losses
    equal megatron's, the table written."""
    import json
    import subprocess
    import sys
    out = tmp_path / "pub"
    r = subprocess.run([sys.executable, "-m", "dhelix.cli", "published", "--rows", "gpt-6.7b",
                        "--max-ranks", "8", "--num-layers", "2", "--factor", "1",
                        "--microbatches", "2", "--pair-last", "--out", str(out)],
                       capture_output=True, text=True, timeout=550)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads((out / "table.json").read_text())["rows"]
    assert (row["ranks"], row["run_dp"], row["layers"], row["global_batch"]) == (8, 2, 2, 32)
    assert row["losses_equal"] and row["final_loss"][0] == row["final_loss"][1]
    assert (row["megatron_method"], row["dhelix_method"]) == ("megatron", "dhelix-last")
    assert row["speedup"] > 0 and row["dp_exposed_ms"] > 0
    bench = json.loads((out / "rows" / "gpt-6.7b.json").read_text())
    assert bench["args"]["distributed_optimizer"] is True
    assert bench["args"]["emulate"] == "gpt-6.7b,seq=4096,mbs=1,dp=16"
    md = (out / "table.md").read_text()
    assert "| gpt-6.7b (a40) | DP16 × TP4 (4096) | 8, DP2, 2 |" in md and "(pair-last)" in md
    assert (out / "table.png").stat().st_size > 1000


def test_paced_link_prices_a_group_at_its_emulated_size():
    """The paced link's `group_size` (set by `--emulate ...,dp=D`) prices a group's
    collective as that many ranks: a 4-rank all-reduce priced as 16 takes the ring's
    2·15/16 of the bytes instead of 2·3/4, plus 15 latencies instead of 3; `share`
    divides a group's rate among the rings crossing one NIC, and a byte scale keyed by
    (group, collective) overrides the group's for that collective."""
    import time as _time
    from dhelix.links.paced import PacedLink
    from dhelix.planner.costmodel import collective_seconds

    class Group:
        def size(self):
            return 4
    for size in (None, 16):
        link, g = PacedLink(1e9, 1e-5), Group()
        link._keys[id(g)] = "inter:0-1"          # the nodes it spans (no process group here)
        if size:
            link.group_size = {id(g): size}
        t = _time.perf_counter()
        done = link.schedule(g, "all_reduce", 8_000_000)
        want = collective_seconds("all_reduce", 8e6, size or 4, 1e9, 1e-5)
        assert done - t == pytest.approx(want, rel=0.01, abs=2e-4)
    # the NIC shared with 3 other rings (`share`): a quarter of the rate; a byte scale
    # for one kind of collective (the parameters' all-gather in bf16) beside the group's
    link, g = PacedLink(1e9, 1e-5), Group()
    link._keys[id(g)] = "inter:0-1"
    link.share, link.byte_scale = {id(g): 4.0}, {id(g): 2.0, (id(g), "all_gather"): 1.0}
    for kind, scale in (("reduce_scatter", 2.0), ("all_gather", 1.0)):
        t = _time.perf_counter()
        done = link.schedule(g, kind, 8_000_000)
        link.free_at.clear()
        want = collective_seconds(kind, 8e6 * scale, 4, 1e9 / 4, 1e-5)
        assert done - t == pytest.approx(want, rel=0.01, abs=2e-4)
