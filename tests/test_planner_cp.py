"""Context parallel (ring attention) on the planner side: the ring ops' chains and
estimates (dhelix/planner/shapes.py), the CP group's size and lane, C++ ≡ Python plans
of CP layers, and `--context-parallel-size` in `dhelix plan | simulate | plan-sweep`."""
import json
import random
import re

import pytest
import yaml

from dhelix.cli import main
from dhelix.models.config import load_model_config
from dhelix.planner import dp
from dhelix.planner.problem import cp_lane, layer_for_shape, load_costs, per_rank_shape
from dhelix.planner.costmodel import analytical_table, group_sizes_of, load_cluster
from dhelix.planner.example_layer import random_table
from dhelix.planner.plan import Plan, trivial_plan, validate
from dhelix.planner.shapes import layer_ops_for_shape
from dhelix.planner.simulate import simulate

L66 = ["--config", "llama-66b", "--tensor-model-parallel-size", "8", "--sequence-parallel",
       "--micro-batch-size", "1", "--bf16"]


def llama66(cp, seq=16384, tp=8, sp=True, lane="intra"):
    return layer_ops_for_shape(load_model_config("llama-66b"), tp, sp, seq, 1, bf16=True,
                               cp=cp, cp_lane=lane)


def ops(layer):
    return {o.name: o for o in list(layer.forward) + list(layer.backward)}


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# ---- chains ----------------------------------------------------------------------------------

@pytest.mark.parametrize("C", [2, 3, 4])
def test_ring_chain_structure(C):
    layer = llama66(C, seq=4096 * C, lane="inter")
    f = [o.name for o in layer.forward]
    b = [o.name for o in layer.backward]
    ring_f = ["attn_in"]
    for i in range(C):
        ring_f += ([f"kv_{i}"] if i < C - 1 else []) + [f"attn_{i}"]
    assert f[f.index("qkv") + 1:f.index("proj")] == ring_f
    ring_b = [x for i in range(C) for x in (f"kv_b_{i}", f"attn_b_{i}")] + \
        [f"kv_b_{C}", "attn_in_b"]
    assert b[b.index("proj_wgrad") + 1:b.index("ag_attn_w")] == ring_b
    assert "attn" not in f and "attn_b" not in b
    comm = [o for o in layer.forward + layer.backward if o.group == "cp"]
    assert [o.name for o in comm] == [f"kv_{i}" for i in range(C - 1)] + \
        [f"kv_b_{i}" for i in range(C + 1)]
    assert all(o.kind == "comm" and o.collective == "send_recv" and o.lane == "inter"
               for o in comm)
    # every wgrad names an op before it in the backward chain, every re-gather (no
    # `after`: it floats) a wgrad after it as its reader
    for k, o in enumerate(layer.backward):
        if o.wgrad and o.kind == "comm":
            assert o.after is None and o.reader in b[k + 1:], o.name
        elif o.wgrad:
            assert o.after in b[:k], o.name
    assert ops(layer)["ag_attn_w"].reader == "qkv_wgrad"
    assert layer.shape["cp"] == C


def test_cp1_layer_is_unchanged_and_records_cp():
    a, b = llama66(1), layer_ops_for_shape(load_model_config("llama-66b"), 8, True, 16384, 1,
                                           bf16=True)
    assert a.signature() == b.signature() and b.shape["cp"] == 1
    assert "attn" in [o.name for o in b.forward]
    assert group_sizes_of(b.shape, b) == {"tp": 8}


# ---- estimates -------------------------------------------------------------------------------

@pytest.mark.parametrize("C", [2, 3, 4])
def test_ring_flops_are_the_causal_attention_over_cp(C):
    """2C+1 blocks of c×c (c = s/2C), each counted whole: (2C+1)/(2C) of the causal half of
    the CP=1 layer's s×s count, divided by C; so within 1.25× of it."""
    seq = 4096 * C
    one, ring = ops(llama66(1, seq)), ops(llama66(C, seq))
    fwd = sum(ring[f"attn_{i}"].flops for i in range(C))
    causal_over_c = one["attn"].flops / 2 / C
    assert fwd / causal_over_c == pytest.approx((2 * C + 1) / (2 * C), rel=1e-12)
    assert 1.0 < fwd / causal_over_c <= 1.25
    assert ring["attn_0"].flops == pytest.approx(1.5 * ring["attn_1"].flops)
    for i in range(C):                              # backward: 2× the step's forward
        assert ring[f"attn_b_{i}"].flops == 2 * ring[f"attn_{i}"].flops


@pytest.mark.parametrize("config,tp,kv_heads", [("llama-66b", 8, 8), ("llama-8b", 8, 1),
                                                ("llama-8b", 16, 1)])
def test_kv_message_bytes(config, tp, kv_heads):
    """One K/V block: K and V of s/C tokens, max(1, groups/TP) heads of 128, bf16; the
    backward sends K/V, K/V + dK/dV, ..., dK/dV, dK/dV."""
    C, seq = 4, 32768
    layer = layer_ops_for_shape(load_model_config(config), tp, True, seq, 1, bf16=True, cp=C)
    o = ops(layer)
    block = 2 * (seq // C) * 1 * kv_heads * 128 * 2
    assert [o[f"kv_{i}"].comm_bytes for i in range(C - 1)] == [block] * (C - 1)
    assert [o[f"kv_b_{i}"].comm_bytes / block for i in range(C + 1)] == [1, 2, 2, 1, 1]
    assert all(o[n].temp_bytes == o[n].comm_bytes for n in o if n.startswith("kv_"))


def test_cp2_kv_backward_messages():
    o = ops(llama66(2))
    block = 2 * 8192 * 8 * 128 * 2
    assert [o[f"kv_b_{i}"].comm_bytes for i in range(3)] == [block] * 3


def test_other_ops_see_s_over_cp_tokens():
    """Every op outside the attention core at CP=2, seq S is the CP=1 op at seq S/2: the
    GEMMs see S/2·b tokens, the SP collectives move S/2·b·h (sharded S/2/TP)."""
    one, two = ops(llama66(1, 8192)), ops(llama66(2, 16384))
    core = {"attn", "attn_b", "qkv"}
    shared = (set(one) & set(two)) - core
    assert {"ag_attn", "rs_attn", "ag_mlp", "rs_mlp_b", "fc1", "proj_dgrad"} <= shared
    for n in shared:
        assert (two[n].flops, two[n].comm_bytes, two[n].saved_bytes) == \
            (one[n].flops, one[n].comm_bytes, one[n].saved_bytes), n
    assert two["ag_attn"].comm_bytes == 8192 * 1 * 8192 * 2
    assert two["qkv"].flops == one["qkv"].flops and two["qkv"].saved_bytes == 0


def test_ring_memory_is_saved_once_and_freed():
    """attn_in keeps q and the own K/V (the qkv GEMM no longer does), the last step the
    output and log-sum-exp; the backward frees them: forward saved - backward freed is
    the CP=1 layer's at S/C."""
    one, two = llama66(1, 8192), llama66(2, 16384)

    def balance(layer):
        return sum(o.saved_bytes for o in layer.forward) - \
            sum(o.saved_bytes for o in layer.backward)
    assert balance(two) == balance(one)
    o = ops(two)
    T, ap = 8192, 64 * 128 // 8
    q_kv = T * (ap + 2 * 8 * 128) * 2
    assert o["attn_in"].saved_bytes == o["attn_in_b"].saved_bytes == q_kv
    lse = T * 8 * 4
    assert o["attn_1"].saved_bytes == T * ap * 2 + lse and o["attn_0"].saved_bytes == 0
    assert o["attn_b_1"].saved_bytes == lse and o["attn_b_0"].saved_bytes == 0


# ---- refusals --------------------------------------------------------------------------------

def test_sequence_that_does_not_split_is_refused():
    m = load_model_config("llama-66b")
    with pytest.raises(ValueError, match=re.escape(
            "sequence length 16384 does not split into 2·CP = 6 chunks (megatron's "
            "load-balanced context parallel); choose a multiple of 6")):
        layer_ops_for_shape(m, 8, True, 16384, 1, cp=3)
    with pytest.raises(ValueError, match="context-parallel size must be an integer >= 1"):
        layer_ops_for_shape(m, 8, True, 16384, 1, cp=0)
    with pytest.raises(ValueError, match="sequence parallel splits each CP rank's 12 tokens"):
        layer_ops_for_shape(m, 8, True, 24, 1, cp=2)


# ---- group sizes and lanes -------------------------------------------------------------------

def test_group_sizes_and_kv_price():
    layer = llama66(2, lane="inter")
    assert group_sizes_of(layer.shape, layer) == {"tp": 8, "cp": 2}
    c = load_cluster("configs/clusters/a800.yaml")
    t = analytical_table(layer, c, group_sizes_of(layer.shape, layer), dtype="bf16")
    inter = c["inter_node"]
    bw = inter["bandwidth_GBps"] * 1e9 * inter["efficiency"]
    kv = ops(layer)["kv_0"].comm_bytes
    assert t.alone_f["kv_0"] == pytest.approx(kv / bw + inter["latency_us"] * 1e-6)


@pytest.mark.parametrize("tp,cp,gpn,lane", [(8, 2, 8, "inter"), (4, 2, 8, "intra"),
                                            (2, 4, 8, "intra"), (1, 8, 8, "intra"),
                                            (2, 3, 8, "inter"), (8, 2, 16, "intra")])
def test_cp_lane_follows_megatron_rank_order(tp, cp, gpn, lane):
    """TP fastest, then CP: a CP group spans TP×CP consecutive ranks."""
    assert cp_lane({"tp": tp, "cp": cp}, gpn) == lane


def test_cp_lane_from_the_cluster_file(tmp_path, capsys):
    """TP8 × CP2 leaves an 8-GPU node, not a 16-GPU one: the kv ops' lane follows the
    cluster file's gpus_per_node."""
    c = yaml.safe_load(open("configs/clusters/a800.yaml"))
    lanes = {}
    for gpn in (8, 16):
        path = tmp_path / f"c{gpn}.yaml"
        path.write_text(yaml.safe_dump(dict(c, gpus_per_node=gpn)))
        out = str(tmp_path / f"p{gpn}.json")
        rc, stdout, err = run(["plan", *L66, "--seq-length", "16384",
                               "--context-parallel-size", "2", "--cluster", str(path),
                               "--no-reorder", "--out", out], capsys)
        assert rc == 0, err
        layer = Plan.load(out).meta["layer"]
        lanes[gpn] = {o["lane"] for o in layer["forward"] + layer["backward"]
                      if o["group"] == "cp"}
        assert f"CP=2 ({'inter' if gpn == 8 else 'intra'})" in stdout
    assert lanes == {8: {"inter"}, 16: {"intra"}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(dict(c, gpus_per_node=0)))
    rc, _, err = run(["plan", *L66, "--seq-length", "16384", "--context-parallel-size", "2",
                      "--cluster", str(path), "--out", str(tmp_path / "x.json")], capsys)
    assert rc == 2 and "gpus_per_node must be a positive integer" in err


# ---- planning --------------------------------------------------------------------------------

def test_cpp_and_python_plan_cp_layers_identically(cpp_core):
    rng = random.Random(31)
    # one cluster's table and one random table per ring length (the Python DP takes
    # seconds per plan: every cluster on every C cost a minute of CI)
    for C, seq, clu in ((2, 16384, "a800"), (3, 12288, "a40"), (4, 32768, "h100")):
        shape = {"config": "llama-66b", "tp": 8, "sp": True, "seq": seq, "mbs": 1,
                 "bf16": True, "lane": "intra", "cp": C}
        layer = layer_for_shape(shape)
        tables = [load_costs(layer, shape, None, clu, False)[0], random_table(layer, rng)]
        for t in tables:
            a = dp.plan(layer, t, backend="python")
            b = dp.plan(layer, t, backend="cpp")
            assert b.meta["backend"] == "cpp"
            assert a.steps == b.steps, C
            for k in ("predicted_s", "trivial_predicted_s", "predicted_peak_bytes"):
                assert a.meta[k] == b.meta[k], (C, k)


def test_cp2_plan_hides_ring_exchanges_behind_the_other_strand():
    """Inter-node ring (TP8 × CP2 on 8-GPU A800 nodes): the plan is legal, faster than the
    trivial plan, and runs at least one K/V exchange beside the other strand's compute."""
    shape = {"config": "llama-66b", "tp": 8, "sp": True, "seq": 16384, "mbs": 1,
             "bf16": True, "lane": "intra", "cp": 2}
    layer = layer_for_shape(shape)
    costs, _ = load_costs(layer, shape, None, "a800", False)
    assert costs.alone_f["kv_0"] > 1e-3            # slow: over IB, >1 ms
    p = dp.plan(layer, costs)
    validate(p, layer)
    o = ops(layer)

    def ring_beside_compute(fwd, bwd):
        return any(o[x].group == "cp" for x in fwd) and any(o[y].kind == "compute"
                                                            for y in bwd)
    assert any(ring_beside_compute(s.fwd, s.bwd) or ring_beside_compute(s.bwd, s.fwd)
               for s in p.steps)
    assert p.meta["predicted_s"] < p.meta["trivial_predicted_s"]
    assert simulate(layer, p, costs).makespan == pytest.approx(p.meta["predicted_s"])
    assert simulate(layer, trivial_plan(layer), costs).makespan == \
        pytest.approx(p.meta["trivial_predicted_s"])


# ---- the command line ------------------------------------------------------------------------

def _speedup(stdout, config="llama-66b"):
    row = next(x for x in stdout.splitlines() if x.startswith(f"| {config}"))
    return float(re.search(r"\| ([0-9.]+)x", row).group(1))


def test_plan_sweep_llama66b_cp2_a800(tmp_path, capsys):
    js = str(tmp_path / "s.json")
    rc, out, err = run(["plan-sweep", "--configs", "llama-66b", "--clusters", "a800",
                        "--tensor-model-parallel-size", "8", "--context-parallel-size", "2",
                        "--seq-length", "16384", "--no-progress", "--json", js,
                        "--png", str(tmp_path / "s.png")], capsys)
    assert rc == 0, err
    assert "CP=2 (ring attention, 8192 tokens per rank, inter-node)" in out
    assert "DP=1 × TP=8 × CP=2 × PP=1 = 16 GPUs" in out
    assert _speedup(out) > 1.05
    d = json.load(open(js))
    assert d["setting"]["cp"] == 2
    row = d["rows"][0]
    assert row["shape"]["cp"] == 2 and row["cp_lane"] == "inter"
    assert row["cost_source"]["group_sizes"] == {"tp": 8, "cp": 2}


def test_plan_and_simulate_a_cp_plan(tmp_path, capsys):
    """`dhelix plan` records CP in the plan's shape; `dhelix simulate` rebuilds the same
    layer from that shape alone (no meta.layer) and plays it to the planner's time."""
    out = str(tmp_path / "cp.json")
    rc, stdout, err = run(["plan", *L66, "--seq-length", "16384", "--context-parallel-size",
                           "2", "--cluster", "a800", "--out", out], capsys)
    assert rc == 0, err
    assert "CP=2 (inter)" in stdout
    d = json.load(open(out))
    assert d["meta"]["shape"]["cp"] == 2
    assert d["meta"]["cost_source"]["group_sizes"] == {"tp": 8, "cp": 2}
    del d["meta"]["layer"]
    json.dump(d, open(out, "w"))
    rc, stdout, err = run(["simulate", out, "--png", str(tmp_path / "t.png"), "--trace",
                           str(tmp_path / "t.json")], capsys)
    assert rc == 0, err
    assert "layer from the plan's shape" in stdout
    made = float(re.search(r"planner said:\s+([0-9.]+) ms", stdout).group(1))
    played = float(re.search(r"makespan:\s+([0-9.]+) ms", stdout).group(1))
    assert played == pytest.approx(made, abs=1e-3)


def test_pipeline_p2p_carries_one_cp_ranks_tokens():
    shape = {"config": "llama-66b", "tp": 8, "sp": True, "seq": 16384, "mbs": 1, "cp": 4}
    assert per_rank_shape(shape)["seq"] == 4096 and shape["seq"] == 16384
    assert per_rank_shape({"seq": 64, "tp": 1})["seq"] == 64


@pytest.mark.parametrize("cmd", ["plan", "plan-sweep"])
@pytest.mark.parametrize("cp,seq,msg", [
    ("0", "16384", "--context-parallel-size must be a positive integer, got 0"),
    ("-2", "16384", "--context-parallel-size must be a positive integer, got -2"),
    ("3", "16384", "--seq-length 16384 does not split into 2·CP = 6 chunks (megatron's "
                   "load-balanced context parallel, --context-parallel-size 3); choose a "
                   "multiple of 6")])
def test_cli_refuses_a_bad_context_parallel_size(cmd, cp, seq, msg, tmp_path, capsys):
    if cmd == "plan":
        argv = ["plan", *L66, "--cluster", "a800", "--out", str(tmp_path / "p.json")]
    else:
        argv = ["plan-sweep", "--configs", "llama-66b", "--clusters", "a800", "--no-progress",
                "--json", str(tmp_path / "s.json"), "--png", str(tmp_path / "s.png")]
    rc, out, err = run(argv + ["--seq-length", seq, "--context-parallel-size", cp], capsys)
    assert rc == 2
    assert err.strip() == f"dhelix {cmd}: error: {msg}"
    assert not (tmp_path / "p.json").exists() and not (tmp_path / "s.json").exists()


def test_cli_refuses_sp_shards_that_do_not_divide(tmp_path, capsys):
    rc, _, err = run(["plan", "--config", "tiny", "--tensor-model-parallel-size", "4",
                      "--sequence-parallel", "--seq-length", "20", "--context-parallel-size",
                      "2", "--cluster", "a800", "--out", str(tmp_path / "p.json")], capsys)
    assert rc == 2
    assert "--seq-length 20 (its 10 tokens per CP rank) must be divisible by " \
           "--tensor-model-parallel-size 4" in err
